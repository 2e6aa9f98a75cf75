"""The benchmark scripts under bench/, loaded as modules for their smoke tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str, script: str = "run.py") -> ModuleType:
    """``bench/<name>/<script>`` as a module (its ``main(argv)`` runs the benchmark)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}_{Path(script).stem}",
                                                  BENCH / name / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
