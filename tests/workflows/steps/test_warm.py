"""The warm step server: a coordinator step handed to it runs as it runs alone (same files,
same streams, same exit code), in a fork of a process that imported the steps once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import QUICKSTART
from xffl.core.files import write_json
from xffl.core.layout import RunLayout
from xffl.jobs.spec.load import load_job
from xffl.workflows.plan.compile import write_plan
from xffl.workflows.steps import warm
from xffl.workflows.steps.handoff import SOCKET


def _step(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``python -X importtime -m xffl.workflows.steps ARGV`` (its imports listed on stderr)."""
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "xffl.workflows.steps",
                           *argv], cwd=cwd, capture_output=True, text=True, timeout=300,
                          check=False)


def _imported(stderr: str, module: str) -> bool:
    return any(line.startswith("import time:") and line.split("|")[-1].strip() == module
               for line in stderr.splitlines())


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _said(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("import time:")]


@pytest.fixture
def plan(tmp_path: Path, xffl_home: Path) -> Iterator[RunLayout]:
    layout = write_plan(load_job(QUICKSTART), "qs-1", tmp_path / "plan")
    write_json(tmp_path / "beta.json", {"format": 1, "site": "beta", "samples": 13,
                                        "tokens": 13 * 64, "losses": {"global": 3.25}})
    yield layout


def test_a_step_runs_the_same_warm_and_cold(plan: RunLayout, tmp_path: Path) -> None:
    """The final validation step, cold (no server) then warm: the same file in its working
    directory, the same line on its stderr, exit 0; warm, the client imported no step."""
    args = ["final_validation", "--run-dir", str(plan.root), "--round", "3",
            "--sites", "alpha,beta", f"--evaluation=beta={tmp_path / 'beta.json'}"]
    outputs = {}
    for mode in ("cold", "warm"):
        here = tmp_path / mode
        here.mkdir()
        plan.final_validation.unlink(missing_ok=True)
        server = warm.spawn(plan.root) if mode == "warm" else None
        try:
            if server is not None:
                while not (plan.root / SOCKET).exists():  # listening once it is there
                    assert server.poll() is None, "the server ended"
                    time.sleep(0.05)
            done = _step(here, *args)
        finally:
            if server is not None:
                warm.stop(server)
        assert done.returncode == 0, done.stderr
        # cold, the step's imports are this process's; warm, the server's
        assert _imported(done.stderr, "pydantic") == (
            mode == "cold"), mode
        outputs[mode] = (json.loads((here / plan.final_validation.name).read_text()),
                         _said(done.stderr))
    assert outputs["warm"] == outputs["cold"]
    assert outputs["warm"][0]["sites"] == {"beta": 3.25}
    assert any("the final model's held-out loss is 3.2500" in line
               for line in outputs["warm"][1])
    assert not (plan.root / SOCKET).exists()  # the server took its socket away


def test_a_failing_step_exits_as_it_would_alone(plan: RunLayout, tmp_path: Path) -> None:
    """A step refusing its arguments (argparse: usage on stderr, exit 2), warm and cold."""
    said = {}
    server = warm.spawn(plan.root)
    try:
        while not (plan.root / SOCKET).exists():
            assert server.poll() is None, "the server ended"
            time.sleep(0.05)
        warm_run = _step(tmp_path, "aggregate", "--run-dir", str(plan.root), "--round", "1")
    finally:
        warm.stop(server)
    cold_run = _step(tmp_path, "aggregate", "--run-dir", str(plan.root), "--round", "1")
    for name, done in (("warm", warm_run), ("cold", cold_run)):
        assert done.returncode == 2, (name, done.stderr)
        said[name] = _said(done.stderr)
    assert said["warm"] == said["cold"]
    assert "the following arguments are required: --sites" in said["warm"][-1]
    assert not _imported(warm_run.stderr, "pydantic")
    assert _imported(cold_run.stderr, "pydantic")


def test_only_the_plan_steps_are_run(tmp_path: Path) -> None:
    """A name that is not one of the coordinator's steps: usage, exit 2, nothing imported."""
    done = _step(tmp_path, "os", "--run-dir", str(tmp_path))
    assert done.returncode == 2
    assert "usage: python -m xffl.workflows.steps {admit,aggregate,final_validation}" in \
        done.stderr


def test_the_server_ends_with_its_supervisor(plan: RunLayout, tmp_path: Path) -> None:
    """A supervisor killed outright (no finally, no stop): its server sees its parent gone,
    takes its socket away and ends; a step then runs cold."""
    said = tmp_path / "parent.out"  # a file, not a pipe: the server shares its streams
    with said.open("w") as out:
        parent = subprocess.run(
            [sys.executable, "-c", "import os, sys, time\n"
             "from pathlib import Path\n"
             "from xffl.workflows.steps import warm\n"
             "server = warm.spawn(Path(sys.argv[1]))\n"
             "while not (Path(sys.argv[1]) / 'steps.sock').exists(): time.sleep(0.05)\n"
             "print(server.pid, flush=True)\n"
             "os._exit(9)\n", str(plan.root)],
            stdout=out, stderr=subprocess.STDOUT, timeout=300, check=False)
    assert parent.returncode == 9, said.read_text()
    server = int(said.read_text().split()[-1])
    deadline = time.monotonic() + 120  # an upper bound on a loaded machine, not a measure
    try:
        while _running(server):
            assert time.monotonic() < deadline, "the server outlived its supervisor"
            time.sleep(0.1)
    finally:
        if _running(server):  # the test failed: leave no server behind
            os.kill(server, signal.SIGTERM)
    assert not (plan.root / SOCKET).exists()
    done = _step(tmp_path, "aggregate", "--run-dir", str(plan.root), "--round", "1")
    assert done.returncode == 2 and _imported(done.stderr, "pydantic")  # cold


def test_a_step_that_ends_at_once_keeps_its_exit_code() -> None:
    """The server's two replies (the fork's pid, then its exit code) can arrive in one packet
    when a step ends at once (an admit step of a site given up: under CI's load that run
    failed with exit 1). The client reads both through one buffer: it still sees 3."""
    import socket
    import threading

    from xffl.workflows.steps import handoff

    client, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def serve() -> None:
        _data, fds, _flags, _addr = socket.recv_fds(server, 1 << 20, 3)
        for fd in fds:
            os.close(fd)
        server.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n"
                       + json.dumps({"exit": 3}).encode() + b"\n")

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with client, server:
            assert handoff.warm(client, "admit", ["--run-dir", "x"]) == 3
    finally:
        thread.join(timeout=10)
        for sig in (signal.SIGTERM, signal.SIGINT):  # warm() relays them to the step's pid
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_DFL)


PRELOADED = """
import sys
from pathlib import Path
from xffl.workflows.steps.warm import preload
preload(Path(sys.argv[1]))
print("mlflow.tracking" in sys.modules)
"""


@pytest.mark.parametrize("tracking", [None, {"mlflow": "mlruns"}])
def test_the_server_imports_the_trackers_the_job_logs_to(
        tmp_path: Path, xffl_home: Path, tracking: dict[str, str] | None) -> None:
    """A job that logs to MLflow: the server imports MLflow's client once, before it forks
    the rounds' aggregate steps (each imported it again: about 3 CPU-seconds a round); a job
    that tracks nothing never pays for it."""
    spec = yaml.safe_load(QUICKSTART.read_text())
    if tracking is not None:
        spec["tracking"] = tracking
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    layout = write_plan(load_job(job), "qs-1", tmp_path / "plan")
    done = subprocess.run([sys.executable, "-c", PRELOADED, str(layout.root)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(tracking is not None)]
