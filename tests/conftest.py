"""Shared fixtures: an isolated XFFL_HOME per test, and the real two-cluster test stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from xffl.core.startup import collect_less

collect_less()  # the workers import torch and transformers too (xffl.core.startup)

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "examples" / "quickstart.yaml"
# what a new user types (README, docs/getting-started.md), plus the flags a test reads by
QUICKSTART_COMMANDS = [["init", "demo"],
                       ["submit", "demo/job.yaml", "--wait", "--json", "--timeout", "300"],
                       ["status"], ["report", "--json", "-o", "report"]]

# The pytest-xdist workers share the machine's cores, so every torch process of the suite
# runs one intra-op thread: the launcher's own choice (xffl.training.threads) assumes the
# machine is the run's alone, and torch's default (a thread per core in every process) makes
# concurrent processes spin against each other. tests/training/test_threads.py unsets this
# to test the launcher's choice.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def xffl_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own data directory, registry and config dir."""
    home = tmp_path / "xffl-home"
    monkeypatch.setenv("XFFL_HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return home


@pytest.fixture(scope="session", autouse=True)
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One XDG cache for the whole test run, its pytest-xdist workers included: the seeded
    initial models (xffl.workflows.plan.init_cache) are built once, not in every run's supervisor.
    tests/workflows/plan/test_init_cache.py tests that cache with caches of its own."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "xdg-cache"
    os.environ["XDG_CACHE_HOME"] = str(root)
    return root


@dataclass(frozen=True)
class FinishedRun:
    """A run that ``xffl submit --wait`` completed: its data directory and final status."""

    home: Path
    status: dict[str, Any]
    report: dict[str, Any]  # what `xffl report --json -o DIR` printed (DIR outside the run)

    @property
    def run_id(self) -> str:
        """The run's id."""
        return str(self.status["run_id"])

    @property
    def run_dir(self) -> Path:
        """The run's directory."""
        return Path(self.status["run_dir"])


def wheel_venv(where: Path) -> Path:
    """A virtual environment with xffl installed by pip from the wheel of this tree, as on a
    login node: no clone on its path, xffl's data files (bundled profiles, the quickstart,
    templates) only as the wheel ships them. Its dependencies are this venv's, seen through
    one .pth line holding a plain path (the .pth files found there, the editable install's
    among them, are not read), so nothing is downloaded."""
    dist = where / "dist"
    build = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    for argv in (
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
             "-w", str(dist), str(REPO)],
            [getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip",
             str(where / "venv")]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=build)
        assert done.returncode == 0, done.stderr
    venv = where / "venv"
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (venv / "lib" / version / "site-packages" / "xffl-test-deps.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                           "install", "-q", "--no-deps", "--no-index",
                           *map(str, dist.glob("xffl-*.whl"))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return venv


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FinishedRun]:
    """The README's quickstart as a new user runs it from the wheel, outside any clone:
    `xffl init demo && xffl submit demo/job.yaml --wait && xffl status && xffl report`, under
    a login shell's umask (022), for the tests that read a finished run (end to end, report,
    file modes).

    Tests that use it carry ``xdist_group("quickstart")`` (added below): one worker runs it.
    Each such test points XFFL_HOME at ``home`` and may add files, never change the run.
    """
    where = tmp_path_factory.mktemp("quickstart")
    home = where / "xffl-home"
    xffl = str(wheel_venv(where) / "bin" / "xffl")
    env = {**os.environ, "XFFL_HOME": str(home), "XDG_CONFIG_HOME": str(where / "config")}
    done: dict[str, subprocess.CompletedProcess[str]] = {}
    old = os.umask(0o022)
    try:
        for argv in QUICKSTART_COMMANDS:
            step = argv[0]
            done[step] = subprocess.run([xffl, *argv], cwd=where, env=env, capture_output=True,
                                        text=True, timeout=400)
            assert done[step].returncode == 0, (step, done[step].stdout, done[step].stderr)
    finally:
        os.umask(old)
    assert (where / "demo" / "job.yaml").read_text() == QUICKSTART.read_text()
    status = json.loads(done["submit"].stdout)
    assert status["state"] == "completed"
    assert f"run {status['run_id']}: completed" in done["status"].stdout
    yield FinishedRun(home, status, json.loads(done["report"].stdout))


def _module_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a fixture made once per module."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(
        defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values())


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests of state the whole machine shares (the crontab: ``serial``) run in one worker,
    with the tests that wait out a deadline (``waits``: minutes idle, hardly any CPU);
    the tests of one shared finished run in one worker; the tests of a module that share a
    module fixture (one real run, an image, an installed venv) in one worker, so that it is
    made once, not once per worker; tests of the SLURM stack are marked
    ``stack`` (``-m "not stack"`` leaves them out). That one worker starts with the waiting
    tests, so that they wait beside the other workers' CPU instead of idling the cores all at
    once; slow tests come next, so that the workers do not end on one long test while the
    others idle (scripts/test.sh keeps this order: ``--no-loadscope-reorder``).

    Every pytest-xdist worker has its own SLURM stack (tests/stack/fixtures.py).
    """
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if any(item.get_closest_marker(mark) is not None for mark in ("waits", "serial")):
            item.add_marker(pytest.mark.xdist_group("machine"))
        elif "quickstart_run" in fixtures:
            item.add_marker(pytest.mark.xdist_group("quickstart"))
        elif item.get_closest_marker("xdist_group") is None and _module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
        if "slurm_stack" in fixtures:
            item.add_marker(pytest.mark.stack)
    items.sort(key=lambda item: (item.get_closest_marker("waits") is None,
                                 item.get_closest_marker("slow") is None))


from tests.stack.fixtures import slurm_stack  # noqa: E402, F401
from tests.typer_once import build_each_app_once  # noqa: E402

build_each_app_once()  # CliRunner.invoke: each app's click command built once per process


_TIMELINE = os.environ.get("XFFL_TEST_TIMELINE")  # scripts/test_timeline.py reads what it writes
if _TIMELINE:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        """With ``XFFL_TEST_TIMELINE=PREFIX``: each test's start and end (setup to teardown),
        one JSON line in ``PREFIX.<worker>``, to see what the workers ran when the cores idled."""
        import time

        start, times = time.time(), os.times()
        yield
        after = os.times()
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        own = after.user + after.system - times.user - times.system  # the worker's own, no children
        record = {"test": item.nodeid, "start": start, "end": time.time(), "cpu": round(own, 3)}
        with open(f"{_TIMELINE}.{worker}", "a") as out:
            out.write(json.dumps(record) + "\n")
