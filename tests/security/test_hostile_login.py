"""`xffl cancel` against a login node whose squeue and scancel print garbage (the real stack).

The attack: a facility's login node answers squeue with markup, escapes, binary bytes, lines
shaped like SLURM's with fields that are not (HEAD crashed reading an elapsed time ``zz:qq``),
and more than xffl keeps; its scancel prints garbage too. A second sshd of the stack's serves
cluster alpha with those commands first on its PATH (``ForceCommand``); beta is honest. The
cancel still removes the run's crontab entry, stops the process holding the round lock,
cancels the real SLURM jobs at both sites and records the run cancelled; status and runs
still show it.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from tests.security.processes import lock_holder
from tests.stack.extra_login import extra_login
from tests.stack.profiles import write_profile
from xffl.cli.app import app
from xffl.jobs import schedule
from xffl.jobs.registry.round_lock import holder
from xffl.jobs.registry.store import Registry

runner = CliRunner()

GARBAGE_SQUEUE = r"""#!/bin/sh
printf '[/]\033[2J\033]0;owned\007 [bold red]not squeue\n'
printf '\377\376\000binary\n'
printf '12|{job}|CANCELLED|yesterday|2026-13-45T99:99:99|zz:qq|n[1-2]\n'
printf '13|{job}|RUN[/]NING|x|y|0:01|n1\n'
printf '14|{job}|PENDING|x|y|0:01|$(touch /tmp/pwned)\n'
head -c 3000000 /dev/zero | tr '\0' 'A'
printf '\n'
"""
GARBAGE_SCANCEL = r"""#!/bin/sh
printf '[/]\033[31m scancel says hello\n'
exec {real} "$@"
"""


@pytest.fixture
def hostile_login(slurm_stack: Any, tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """The port of an sshd that logs into cluster alpha with a garbage-printing squeue and
    scancel, and the folder they are in (squeue: written by the test)."""
    alpha = slurm_stack.clusters["alpha"]
    bin_dir = tmp_path / "hostile-bin"
    bin_dir.mkdir()
    real_scancel = subprocess.run(["sh", "-c", "command -v scancel"], capture_output=True,
                                  text=True, check=True).stdout.strip()
    (bin_dir / "scancel").write_text(GARBAGE_SCANCEL.format(real=real_scancel))
    (bin_dir / "scancel").chmod(0o755)
    with extra_login(slurm_stack, tmp_path, [
            f"SetEnv SLURM_CONF={alpha.slurm_conf} XFFL_STACK_CLUSTER=alpha",
            f'ForceCommand PATH={bin_dir}:$PATH; export PATH; eval "$SSH_ORIGINAL_COMMAND"',
    ]) as port:
        yield port, bin_dir


def _job(tmp_path: Path, stack: Any, port: int) -> Path:
    """The quickstart at the two clusters, alpha reached through the hostile login."""
    profiles = tmp_path / "site_profiles"
    profiles.mkdir()
    known = tmp_path / "known_hosts"
    host_key = " ".join(Path(stack.host_key_pub).read_text().split()[:2])
    known.write_text(Path(stack.known_hosts).read_text() + f"[127.0.0.1]:{port} {host_key}\n")
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["evaluation"] = {"final": False}  # test_final_evaluation
    spec.update(name="garbage", rounds=2)
    for site in spec["sites"]:
        name = write_profile(profiles, stack.clusters[site["name"]], stack)
        if site["name"] == "alpha":
            path = profiles / f"{name}.yaml"
            profile = yaml.safe_load(path.read_text())
            profile["connector"].update(port=port, known_hosts=str(known))
            path.write_text(yaml.safe_dump(profile))
        site["profile"] = name
        site["data"]["path"] = str(tmp_path / "data" / site["name"])
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job


def _queued(stack: Any, cluster: str, name: str) -> list[str]:
    """The job ids the real squeue lists under ``name`` (through the honest login)."""
    out = stack.ssh(cluster, f"squeue -h -n {name} -o %i", timeout=20)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.slow
@pytest.mark.serial  # the real crontab
def test_cancel_against_a_login_node_that_prints_garbage(
        tmp_path: Path, slurm_stack: Any, hostile_login: tuple[int, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    port, bin_dir = hostile_login
    submitted = runner.invoke(app, ["submit", str(_job(tmp_path, slurm_stack, port)),
                                    "--no-start", "--json"])
    assert submitted.exit_code == 0, submitted.output
    run_id, run_dir = (json.loads(submitted.stdout)[k] for k in ("run_id", "run_dir"))
    names = {c: f"xffl-{run_id}-{c}-r1" for c in ("alpha", "beta")}
    squeue = bin_dir / "squeue"  # what alpha's login node runs for squeue from now on
    squeue.write_text(GARBAGE_SQUEUE.replace("{job}", names["alpha"]))
    squeue.chmod(0o755)
    registry = Registry()
    registry.set_state(run_id, "running", "set by the test")
    assert runner.invoke(app, ["schedule", run_id, "--cron", "0 3 * * *"]).exit_code == 0
    executing = lock_holder(Path(run_dir))  # the run's runner
    try:
        for cluster, name in names.items():  # the round's jobs, really queued
            out = slurm_stack.ssh(cluster, f"sbatch -p {slurm_stack.clusters[cluster].partition}"
                                  f" -J {name} -t 00:05:00 --wrap 'sleep 300'", timeout=30)
            assert out.returncode == 0, out.stderr
        result = runner.invoke(app, ["cancel", run_id, "--json"])
        assert result.exit_code == 0, result.output
        assert schedule.current(run_id) is None
        executing.wait(timeout=15)
        assert holder(Path(run_dir)) is None
        record = registry.get_run(run_id)
        assert record.state == "cancelled" and "cron entry removed" in record.message
        assert "\033" not in record.message and "AAAA" not in record.message
        assert sorted(json.loads(result.stdout)["cancelled_sites"]) == ["alpha", "beta"]
        deadline = time.monotonic() + 20
        while any(_queued(slurm_stack, c, n) for c, n in names.items()):
            assert time.monotonic() < deadline, "scancel left a job queued"
            time.sleep(0.3)
        assert not Path("/tmp/pwned").exists()
        for argv in (["status", run_id], ["runs"], ["status", run_id, "--json"]):
            shown = runner.invoke(app, argv)
            assert shown.exit_code == 0, shown.output
            assert "\033" not in shown.stdout
    finally:
        executing.kill()
        executing.wait(timeout=10)
        schedule.remove(run_id)
        for cluster, name in names.items():
            slurm_stack.ssh(cluster, f"scancel -n {name}", timeout=20)
