"""Every process xffl starts collects garbage less often while it imports (xffl.core.startup)."""

from __future__ import annotations

import ast
import gc
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO
from xffl.core.startup import YOUNG, collect_less

PACKAGES = ("aggregator", "cli", "core", "jobs", "site_profiles", "training", "workflows")


@pytest.fixture
def thresholds() -> Iterator[None]:
    saved = gc.get_threshold()
    try:
        yield
    finally:
        gc.set_threshold(*saved)


@pytest.mark.parametrize(("before", "after"), [
    ((700, 10, 10), (YOUNG, 10, 10)),  # CPython's defaults: the first generation raised
    ((YOUNG * 2, 5, 5), (YOUNG * 2, 5, 5)),  # already rarer: kept
    ((0, 10, 10), (0, 10, 10)),  # collection off: kept off
])
def test_the_first_generation_is_raised_never_lowered(
        thresholds: None, before: tuple[int, int, int], after: tuple[int, int, int]) -> None:
    gc.set_threshold(*before)
    collect_less()
    assert gc.get_threshold() == after


def _calls(node: ast.stmt) -> bool:
    """Whether the statement is ``collect_less()``."""
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
        and getattr(node.value.func, "id", None) == "collect_less"


def _entry_points() -> list[Path]:
    """Every module of xffl that runs as a program (``if __name__ == "__main__"``)."""
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")
                  if '__name__ == "__main__"' in p.read_text())


@pytest.mark.parametrize("path", _entry_points(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_entry_point_calls_it_before_its_imports_or_first_in_main(path: Path) -> None:
    """At module level before any import but ``__future__`` and its own, or as main()'s
    first statement (its imports are inside the functions it calls)."""
    tree = ast.parse(path.read_text())
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and
                                         isinstance(n.value, ast.Constant))]
    first = next(i for i, n in enumerate(body) if not (
        isinstance(n, ast.ImportFrom) and n.module in ("__future__", "xffl.core.startup")))
    if _calls(body[first]):
        return
    main = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == "main")
    statements = [n for n in main.body if not (isinstance(n, ast.Expr) and
                                               isinstance(n.value, ast.Constant))]
    assert _calls(statements[0]), f"{path}: main() does not call collect_less() first"


def _python(code: str) -> list[str]:
    """The words ``python -c code`` printed (it must exit 0)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True).stdout.split()


def test_a_training_process_has_the_raised_threshold_when_torch_is_imported() -> None:
    """``python -m xffl.training``: torch (imported at the module's top) saw the threshold."""
    code = ("import sys, gc; sys.argv = ['x', '--help']\n"
            "import builtins; real = builtins.__import__; seen = []\n"
            "def spy(name, *a, **k):\n"
            "    if name == 'torch' and not seen: seen.append(gc.get_threshold()[0])\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = spy\n"
            "import runpy\n"
            "try: runpy.run_module('xffl.training', run_name='__main__')\n"
            "except SystemExit: pass\n"
            "print(seen[0])\n")
    assert int(_python(code)[-1]) == YOUNG


def test_the_heap_is_frozen_at_exit_after_the_other_handlers() -> None:
    """At the interpreter's exit every object still alive is in the permanent generation, which
    the finalisation's full collections skip; the handler is registered once however often the
    process calls collect_less (the CLI calls it per command).

    ``report`` is registered before collect_less, so it runs after its handler (last
    registered, first run): it sees the 100,000 lists ``keep`` holds frozen, and none of them
    left in the collector's three generations.
    """
    code = ("import atexit, gc\n"
            "def report():\n"
            "    print(gc.get_freeze_count(), len(gc.get_objects()), flush=True)\n"
            "atexit.register(report)\n"
            "before = atexit._ncallbacks()\n"  # CPython's count of registered handlers
            "from xffl.core.startup import collect_less\n"
            "collect_less(); collect_less(); collect_less()\n"
            "print(atexit._ncallbacks() - before, flush=True)\n"
            "keep = [[i] for i in range(100_000)]\n")
    out = _python(code)
    assert out[0] == "1"
    frozen, tracked = int(out[1]), int(out[2])
    assert frozen >= 100_000 and tracked < 1_000, (frozen, tracked)
