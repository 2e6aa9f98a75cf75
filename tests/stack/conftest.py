"""Make the stack fixtures available to tests/stack even before tests/conftest.py imports them."""

import sys
from pathlib import Path

try:
    from tests.stack.fixtures import slurm_stack
except ModuleNotFoundError:  # `tests` not importable (plain `pytest` with importlib mode)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.stack.fixtures import slurm_stack

__all__ = ["slurm_stack"]
