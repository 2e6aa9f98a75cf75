"""Whether peft, which LoRA jobs (training.lora) train with, is installed where they run."""

from __future__ import annotations

import importlib.util
import shlex

#: the peft xffl is tested with (pyproject.toml's dependency), for install commands
PEFT_REQUIREMENT = "peft>=0.13,<1"

#: a Python one-liner that exits 0 when peft is importable, PROBE_MISSING when it is not (no
#: import: finding the package is enough, and importing it would cost seconds of torch)
PROBE_MISSING = 3
PROBE = ("import importlib.util as u, sys; "
         f"sys.exit(0 if u.find_spec('peft') is not None else {PROBE_MISSING})")


def peft_installed() -> bool:
    """Whether this Python can import peft (a package blocked in sys.modules is missing)."""
    try:
        return importlib.util.find_spec("peft") is not None
    except (ImportError, ValueError):  # sys.modules['peft'] is None, or a finder refused it
        return False


def install_command(python: str) -> str:
    """The command that installs peft into ``python``'s environment."""
    return f"{shlex.quote(python)} -m pip install {shlex.quote(PEFT_REQUIREMENT)}"
