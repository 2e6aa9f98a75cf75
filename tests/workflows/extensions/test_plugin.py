"""xffl's StreamFlow plugin on real StreamFlow runs of a small cyclic workflow (sf_fixtures/).

Two sites, a and b, train (a shell stand-in) and the coordinator joins what came back, for
three rounds; the global of each round says which sites it holds. The failure manager and
the deadline-keeping local connector are exercised through ``streamflow run`` itself, with
the plugin found through its entry point, as a user's ``streamflow run streamflow.yml`` of a
rendered plan finds it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from xffl.jobs.registry.store import Registry

FIXTURES = Path(__file__).with_name("sf_fixtures")
STREAMFLOW = Path(sys.executable).with_name("streamflow")
SITES = {"a": ["/rounds/train_a"], "b": ["/rounds/train_b"]}
RUN_ID = "fixture-20261125-000000-abcd"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_rounds(tmp_path: Path, deployments: dict[str, Any], *, retries: int = 0,
               retry_delay: float = 0.0, min_sites: int = 1, limit: int = 0, rounds: int = 3,
               failure_manager: bool = True, services: dict[str, str] | None = None,
               start: bool = True, registry: Registry | None = None) -> tuple[int, str, Path]:
    """``streamflow run`` the fixture for ``rounds`` rounds: (exit code, output, run dir).

    ``services`` binds a site's step to a service of its deployment; without ``start`` the
    files are written and nothing runs. With ``registry``, the run is registered there as
    ``RUN_ID`` and xffl's data manager times the sites' transfers into it.
    """
    ctl = tmp_path / "ctl"
    ctl.mkdir(exist_ok=True)
    (tmp_path / "model0").mkdir(exist_ok=True)
    (tmp_path / "model0" / "content").write_text("w0")
    (tmp_path / "inputs.yml").write_text(yaml.safe_dump({
        "max_rounds": rounds, "min_sites": min_sites, "limit": limit, "ctl": str(ctl),
        "model": {"class": "Directory", "path": "model0"},
        "train_sh": {"class": "File", "path": str(FIXTURES / "tools" / "train.sh")},
        "aggregate_py": {"class": "File", "path": str(FIXTURES / "tools" / "aggregate.py")},
    }))
    config: dict[str, Any] = {
        "version": "v1.0",
        "workflows": {"rounds": {
            "type": "cwl", "config": {"file": str(FIXTURES / "main.cwl"),
                                      "settings": "inputs.yml"},
            "bindings": [{"step": f"/rounds/train_{s}", "target": {
                "deployment": f"site-{s}", **({"service": services[s]} if s in (services or {})
                                              else {})}} for s in ("a", "b")]}},
        "deployments": deployments,
        "database": {"type": "default", "config": {"connection": str(tmp_path / "sf.db")}},
    }
    if registry is not None:
        registry.create_run(RUN_ID, "fixture", tmp_path / "job.yaml", tmp_path, rounds, ["a", "b"])
        (tmp_path / "run.json").write_text(json.dumps({"run_id": RUN_ID,
                                                       "registry": str(registry.path)}))
        config["dataManager"] = {"type": "xffl", "config": {
            "run_dir": str(tmp_path), "sites": {"site-a": "a", "site-b": "b"}}}
    if failure_manager:
        config["failureManager"] = {"enabled": True, "type": "xffl", "config": {
            "retries": retries, "retry_delay": retry_delay, "run_dir": str(tmp_path),
            "sites": SITES}}
    (tmp_path / "streamflow.yml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir(exist_ok=True)
    if not start:
        return 0, "", tmp_path
    proc = subprocess.run([str(STREAMFLOW), "run", "streamflow.yml", "--outdir", "out"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
                          check=False)
    return proc.returncode, proc.stdout + proc.stderr, tmp_path


def local_sites() -> dict[str, Any]:
    """Both sites on this machine, through xffl's local connector."""
    return {f"site-{s}": {"type": "xffl-local", "config": {}} for s in ("a", "b")}


def final_global(run_dir: Path) -> str:
    """The content of the last round's global model (which sites, which rounds)."""
    return (run_dir / "out" / "global" / "content").read_text()


def attempts(run_dir: Path, rnd: int, site: str) -> dict[str, Any] | None:
    """The failure manager's record of a site in a round."""
    path = run_dir / "rounds" / str(rnd) / "attempts" / f"{site}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def test_the_plugin_is_found_by_streamflow() -> None:
    out = subprocess.run([str(STREAMFLOW), "plugin", "list"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert "xffl.workflows.extensions.plugin.XfflPlugin" in out


@pytest.mark.slow
def test_a_failed_job_is_retried_and_a_lost_site_is_left_out(tmp_path: Path) -> None:
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    (ctl / "fail-a-r2").write_text("1")  # a's round-2 job fails once: the retry trains it
    (ctl / "fail-b-r3").write_text("9")  # b fails round 3 for good: the round goes on
    registry = Registry(tmp_path / "registry.db")
    started = time.time()
    code, out, run_dir = run_rounds(tmp_path, local_sites(), retries=1, retry_delay=1.0,
                                    registry=registry)
    assert code == 0, out[-3000:]
    # failure.retry_delay, through StreamFlow's failureManager config: each retry started
    # at least 1 s after the attempt before it (a lower bound asyncio.sleep guarantees,
    # never how long anything took); without the delay the retry follows within ~0.1 s
    for name in ("started-a-r2", "started-b-r3"):
        starts = [float(t) for t in (ctl / name).read_text().split()]
        assert len(starts) == 2 and starts[1] - starts[0] >= 1.0, (name, starts)
    # xffl's data manager timed every copy between the coordinator and a site, and nothing
    # else: the model and the tool to each site every round (a's retry reuses them), each
    # update back (b's round 3 never came back)
    moved = registry.transfers(RUN_ID)
    assert all(started <= t.started <= t.ended <= time.time() for t in moved)
    counts = {(s, d): sum(t.site == s and t.direction == d for t in moved)
              for s in ("a", "b") for d in ("in", "out")}
    assert counts == {("a", "in"): 6, ("a", "out"): 3, ("b", "in"): 6, ("b", "out"): 2}, moved
    r1 = "a@1(w0)+b@1(w0)"
    r2 = f"a@2({r1})+b@2({r1})"
    assert final_global(run_dir) == f"a@3({r2})"  # round 3 holds a alone
    assert attempts(run_dir, 1, "a") is None and attempts(run_dir, 1, "b") is None
    assert attempts(run_dir, 2, "a") == {
        "site": "a", "round": 2, "attempts": 2, "gave_up": False, "timed_out": False,
        "progressed": 0, "best_step": 0,  # no checkpoint inside the round: no free retry
        "continued": 0, "steps": 0, "step_seconds": 0.0,  # and no round of several jobs
        "failures": ["attempt 1: xffl.training (rank 0): a cannot train round 2"]}
    lost = attempts(run_dir, 3, "b")
    assert lost is not None and lost["gave_up"] and lost["attempts"] == 2
    assert lost["failures"] == [f"attempt {n}: xffl.training (rank 0): b cannot train round 3"
                                for n in (1, 2)]


@pytest.mark.slow
def test_without_the_failure_manager_one_failed_site_fails_the_run(tmp_path: Path) -> None:
    """StreamFlow's own behaviour, which the plugin changes: the whole workflow fails."""
    (tmp_path / "ctl").mkdir()
    (tmp_path / "ctl" / "fail-b-r2").write_text("1")
    code, out, _ = run_rounds(tmp_path, local_sites(), failure_manager=False)
    assert code != 0 and "FAILED Workflow execution" in out


@pytest.mark.slow
def test_too_few_sites_fail_the_run_at_the_aggregate_step(tmp_path: Path) -> None:
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    (ctl / "fail-b-r2").write_text("9")
    code, out, run_dir = run_rounds(tmp_path, local_sites(), min_sites=2)
    assert code != 0  # a failure of a step of no site is not the failure manager's to hide
    assert "round 2: 1 update(s), need 2" in out
    assert attempts(run_dir, 2, "b")["gave_up"]  # type: ignore[index]


@pytest.mark.slow
def test_a_site_that_cannot_be_reached_is_left_out_of_every_round(tmp_path: Path) -> None:
    """b's login node refuses connections: scheduling its jobs fails, the rounds go on."""
    deployments: dict[str, Any] = {"site-a": {"type": "xffl-local", "config": {}}}
    deployments["site-b"] = {"type": "ssh", "workdir": str(tmp_path / "b"), "config": {
        "nodes": [f"127.0.0.1:{_free_port()}"], "username": "nobody", "checkHostKey": True,
        "connectTimeout": 2, "retries": 0, "retryDelay": 0}}
    code, out, run_dir = run_rounds(tmp_path, deployments, retries=1)
    assert code == 0, out[-3000:]
    assert final_global(run_dir) == "a@3(a@2(a@1(w0)))"
    for rnd in (1, 2, 3):
        lost = attempts(run_dir, rnd, "b")
        assert lost is not None and lost["gave_up"] and lost["attempts"] == 1
        assert lost["failures"][0].startswith("attempt 1: ")


@pytest.mark.slow
@pytest.mark.waits
def test_a_local_job_past_its_time_limit_is_killed(tmp_path: Path) -> None:
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    (ctl / "sleep-b-r2").write_text("6")  # b's round-2 job would sleep 6 s, then train
    started = time.monotonic()
    code, out, run_dir = run_rounds(tmp_path, local_sites(), retries=2, limit=3)
    assert code == 0, out[-3000:]
    r2 = "a@2(a@1(w0)+b@1(w0))"  # round 2 went on without b; b is back in round 3
    assert final_global(run_dir) == f"a@3({r2})+b@3({r2})"
    lost = attempts(run_dir, 2, "b")
    assert lost is not None and lost["gave_up"] and lost["timed_out"]
    assert lost["attempts"] == 1  # a round timeout is not retried
    assert "xffl: round timeout" in lost["failures"][0]
    # past when it would have woken (its job starts after round 1, so after `started`)
    time.sleep(max(0.0, started + 9 - time.monotonic()))
    assert not (ctl / "woke-b-r2").exists()  # its process group was killed, not left behind


_ATTEMPT = """
import asyncio, sys
from streamflow.core.deployment import ExecutionLocation
from streamflow.deployment.connector.local import LocalConnector
from xffl.workflows.extensions.connectors import XfflLocalConnector
cls = {"upstream": LocalConnector, "xffl": XfflLocalConnector}[sys.argv[1]]
connector = cls(deployment_name="site", config_dir=".")
location = ExecutionLocation(name="__LOCAL__", deployment="site", local=True)
command = ["sleep", "3", "&&", "touch", sys.argv[2]]
try:
    asyncio.run(connector.run(location, command, capture_output=True, timeout=1,
                              job_name="/rounds/train_a/0.0"))
except BaseException as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.slow
def test_upstream_local_connector_leaves_a_timed_out_command_running(tmp_path: Path) -> None:
    """The upstream defect XfflLocalConnector fixes: LocalConnector.run only stops waiting."""
    said = {}
    for kind in ("upstream", "xffl"):
        said[kind] = subprocess.run([sys.executable, "-c", _ATTEMPT, kind,
                                     str(tmp_path / kind)], capture_output=True, text=True,
                                    timeout=60, check=True).stdout
    assert said["upstream"].startswith("TimeoutError")
    assert said["xffl"].startswith("WorkflowExecutionException xffl: round timeout")
    deadline = time.monotonic() + 10
    while not (tmp_path / "upstream").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (tmp_path / "upstream").exists()  # upstream: the command ran on past its limit
    assert not (tmp_path / "xffl").exists()  # xffl: its process group was killed
