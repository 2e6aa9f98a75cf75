"""``connector.transfer_host`` on the real stack: beta's bulk copies go through a data
transfer node, its jobs through its login node.

Both are sshds of the stack's keys and settings (tests/stack/extra_login.py) that act as
cluster beta and log every command they are asked to run (``ForceCommand``) before running it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tests.stack.extra_login import extra_login
from tests.workflows.test_dropped_copies import _job
from xffl.aggregator.exchange import verify_checkpoint
from xffl.cli.app import app

runner = CliRunner()


def _logging_sshd(where: Path, stack: Any) -> list[str]:
    """sshd_config lines: cluster beta's environment, every command logged to commands.log."""
    where.mkdir()
    log, script = where / "commands.log", where / "log-command.sh"
    script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$SSH_ORIGINAL_COMMAND" >> {log}\n'
                      'exec /bin/sh -c "${SSH_ORIGINAL_COMMAND:-exec $SHELL -l}"\n')
    script.chmod(0o700)
    beta = stack.clusters["beta"]
    return [f"SetEnv SLURM_CONF={beta.slurm_conf} XFFL_STACK_CLUSTER=beta",
            f"ForceCommand {script}"]


@pytest.mark.slow
def test_bulk_copies_go_through_the_transfer_host(
        tmp_path: Path, slurm_stack: Any,  # type: ignore[no-untyped-def]
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    login_dir, dtn_dir = tmp_path / "login", tmp_path / "dtn"
    login_extra = _logging_sshd(login_dir, slurm_stack)
    dtn_extra = _logging_sshd(dtn_dir, slurm_stack)
    with extra_login(slurm_stack, login_dir, login_extra) as login_port, \
            extra_login(slurm_stack, dtn_dir, dtn_extra) as dtn_port:
        job = _job(tmp_path, slurm_stack, "dtn", login_port)
        spec = yaml.safe_load(job.read_text())
        beta = next(site for site in spec["sites"] if site["name"] == "beta")
        path = tmp_path / "site_profiles" / f"{beta['profile']}.yaml"
        profile = yaml.safe_load(path.read_text())
        profile["connector"]["transfer_host"] = f"127.0.0.1:{dtn_port}"
        known = Path(profile["connector"]["known_hosts"])
        key = Path(slurm_stack.host_key_pub).read_text().split()[:2]
        known.write_text(known.read_text() + f"[127.0.0.1]:{dtn_port} {' '.join(key)}\n")
        path.write_text(yaml.safe_dump(profile))
        result = runner.invoke(app, ["submit", str(job), "--wait", "--json"])
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    assert status["state"] == "completed", status["message"]
    verify_checkpoint(Path(status["run_dir"]) / "rounds" / "1" / "global")
    at_login = (login_dir / "commands.log").read_text()
    at_dtn = (dtn_dir / "commands.log").read_text()
    # the update came back, and the global went out, through the DTN only
    for bulk in ("head -c", "dd of="):
        assert bulk in at_dtn and bulk not in at_login, (at_login, at_dtn)
    # StreamFlow's persistent shell (sbatch, squeue, mkdir: its stdin) ran at the login
    # node only (upstream opens it on the data transfer connection)
    assert "sh" in at_login.splitlines() and "sh" not in at_dtn.splitlines()
