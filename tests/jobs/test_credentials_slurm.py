"""Two-factor facilities on the real stack: OpenSSH certificates, ssh-agent, jump hosts, expiry.

The stack's sshd trusts a user CA (``TrustedUserCAKeys``); keys here are fresh and in no
authorized_keys, and HOME holds only known_hosts, so a login can only work through the
certificate or the agent the test sets up. SLURM's own records show what was submitted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from tests.stack.certs import agent_add, bare_home, new_key, sign, ssh_agent
from tests.stack.profiles import profile_env
from xffl.cli.app import app
from xffl.core.paths import runs_dir
from xffl.jobs.registry.store import Registry

runner = CliRunner()


def _profile(folder: Path, stack: Any, cluster: str, name: str, **conn: Any) -> str:
    """A SLURM profile of ``cluster`` logging in as ``conn`` says (no key unless given)."""
    info = stack.clusters[cluster]
    (folder / f"{name}.yaml").write_text(yaml.safe_dump({
        "name": name,
        "connector": {"type": "ssh", "host": "127.0.0.1", "port": info.ssh_port,
                      "user": stack.user, "known_hosts": stack.known_hosts,
                      "renew": f"ssh-keygen -s CA -V +12h {name}.pub", **conn},
        "slurm": {"partition": info.partition, "time": "00:10:00", "polling_interval": 1},
        "launcher": "srun", "python": sys.executable, "workdir": info.work_dir,
        "env": profile_env(),  # warm ranks: logins are under test, not the ranks' start
    }))
    return name


def _job(tmp_path: Path, name: str, profiles: dict[str, str], rounds: int = 1) -> Path:
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["evaluation"] = {"final": False}  # test_final_evaluation
    spec.update(name=name, rounds=rounds)
    spec["training"].update(steps=2)
    for site in spec["sites"]:
        site["ranks"] = 1  # logins are under test, not DDP
        site["profile"] = profiles[site["name"]]
        site["data"]["path"] = str(tmp_path / "data" / site["name"])
        site["data"]["synthetic_sequences"] = 64
    job = tmp_path / f"{name}.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job


def _jobs_named(stack: Any, prefix: str) -> list[dict[str, str]]:
    """SLURM's records (both clusters, finished or queued) of jobs whose name starts so."""
    found = []
    for cluster in ("alpha", "beta"):
        found += [r for r in stack.jobcomp_records(cluster)
                  if r.get("Name", "").startswith(prefix)]
        queued = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True,
                                env=stack.slurm_env(cluster), timeout=60,
                                check=True).stdout.split()
        found += [{"Name": n, "JobState": "QUEUED"} for n in queued if n.startswith(prefix)]
    return found


@pytest.fixture
def certs(tmp_path: Path, slurm_stack: Any,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A bare HOME (known_hosts only), no agent, a site_profiles folder and a fresh key."""
    monkeypatch.setenv("HOME", str(bare_home(tmp_path / "home", slurm_stack)))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    folder = tmp_path / "site_profiles"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)  # `xffl profiles check NAME` finds ./site_profiles/NAME.yaml
    yield {"profiles": folder, "key": new_key(tmp_path / "keys", "leo")}


def _check(name: str) -> tuple[int, dict[str, Any]]:
    result = runner.invoke(app, ["profiles", "check", name, "--json"])
    return result.exit_code, json.loads(result.stdout)


@pytest.mark.slow
def test_certificate_and_agent_with_jump_host_and_a_cron_round_that_waits_for_renewal(
        tmp_path: Path, slurm_stack: Any, certs: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """alpha: a CA-signed key (no key authorized); beta: only the ssh-agent, via a jump host.
    One run (its round 1 the only one trained, as a cron tick): the tick waits while alpha's
    certificate has run out, and runs the round once it is renewed."""
    key = certs["key"]
    # the certificate away from KEY-cert.pub, where step-ca users may keep it
    cert = sign(slurm_stack, key, "-5m:+2h", cert=tmp_path / "certs" / "leonardo.cert")
    alpha = _profile(certs["profiles"], slurm_stack, "alpha", "cert-alpha", key_file=str(key),
                     certificate=str(cert))
    # beta's key lives only in the agent, and the login goes through alpha's sshd as a bastion
    agent_key = new_key(tmp_path / "keys", "agent-only")
    sign(slurm_stack, agent_key, "-5m:+3h")
    beta = _profile(certs["profiles"], slurm_stack, "beta", "agent-beta",
                    jump=f"{slurm_stack.user}@127.0.0.1:{slurm_stack.clusters['alpha'].ssh_port}")
    code, checked = _check(beta)
    assert code == 3 and not checked["connected"]  # no agent yet: nothing to log in with
    assert "SSH_AUTH_SOCK" in checked["checks"][0]["detail"]

    with ssh_agent(tmp_path / "agent") as sock:
        monkeypatch.setenv("SSH_AUTH_SOCK", sock)
        agent_add(sock, agent_key)
        agent_key.unlink()  # the agent is the only holder of the key now

        code, checked = _check(alpha)
        assert code == 0, checked
        cred = checked["credential"]["endpoints"][0]
        assert cred["method"] == "certificate" and cred["detail"] == str(cert)
        assert cred["principals"] == [slurm_stack.user] and cred["expires"]
        code, checked = _check(beta)
        assert code == 0, checked
        assert [e["method"] for e in checked["credential"]["endpoints"]] == \
            ["ssh-agent certificate"] * 2  # the jump host and the login node
        assert " via " in checked["checks"][1]["detail"]

        job = _job(tmp_path, "crontick", {"alpha": alpha, "beta": beta}, rounds=2)
        result = runner.invoke(app, ["submit", str(job), "--no-start", "--json"])
        assert result.exit_code == 0, result.output
        run_id = json.loads(result.stdout)["run_id"]
        _waits_for_renewal(slurm_stack, key, cert, run_id)

        sign(slurm_stack, key, "-1m:+2h", cert=cert)  # renewed: the next tick runs round 1
        result = runner.invoke(app, ["round", run_id])
        assert result.exit_code == 0, result.output
        status = json.loads(runner.invoke(app, ["status", run_id, "--json", "--no-live"]).stdout)
        assert status["rounds_done"] == 1 and status["state"] == "waiting"
        assert status["rounds"][0]["state"] == "completed"
        assert all(c["waiting"] is None for c in status["credentials"])
        streamflow = yaml.safe_load((Path(status["run_dir"]) / "streamflow.yml").read_text())
        login_beta = streamflow["deployments"]["login-beta"]["config"]
        assert "sshKey" not in login_beta  # asyncssh used the agent
        assert login_beta["tunnel"]["hostname"] == \
            f"127.0.0.1:{slurm_stack.clusters['alpha'].ssh_port}"
        # asyncssh finds a certificate only at KEY-cert.pub: the run links key and certificate
        linked = Path(streamflow["deployments"]["login-alpha"]["config"]["sshKey"])
        assert linked.resolve() == key and Path(f"{linked}-cert.pub").resolve() == cert
    done = {r["Name"]: r["JobState"] for r in _jobs_named(slurm_stack, f"xffl-{run_id}-")}
    assert done == {f"xffl-{run_id}-alpha-r1": "COMPLETED",
                    f"xffl-{run_id}-beta-r1": "COMPLETED"}


def _waits_for_renewal(stack: Any, key: Path, cert: Path, run_id: str) -> None:
    """alpha's certificate runs out before a cron tick: the tick submits nothing, the run
    waits, and a human's `xffl resume` is refused."""
    sign(stack, key, "-3h:-1h", cert=cert)
    result = runner.invoke(app, ["round", run_id])
    assert result.exit_code == 0, result.output
    assert "site alpha" in result.output and "expired at" in result.output
    status = json.loads(runner.invoke(app, ["status", run_id, "--json", "--no-live"]).stdout)
    assert status["state"] == "waiting" and status["rounds_done"] == 0
    assert "site alpha:" in status["message"] and "expired at" in status["message"]
    assert "nothing submitted" in status["message"] and status["rounds"] == []
    creds = {c["site"]: c for c in status["credentials"]}
    assert "expired at" in creds["alpha"]["waiting"] and creds["beta"]["waiting"] is None
    assert creds["alpha"]["seconds_left"] < 0
    shown = runner.invoke(app, ["status", run_id, "--no-live"])
    assert "waiting: " in shown.output and "failed" not in shown.output
    assert any(kind == "credential" for _, kind, _ in Registry().events(run_id))
    assert _jobs_named(stack, f"xffl-{run_id}-") == []
    resumed = runner.invoke(app, ["resume", run_id])  # a human resuming is refused, exit 3
    assert resumed.exit_code == 3, resumed.output
    assert f"then run `xffl resume {run_id}` again" in " ".join(resumed.output.split())
    assert Registry().get_run(run_id).state == "waiting"


@pytest.mark.slow
def test_expired_or_short_certificate_refused_before_any_job(
        tmp_path: Path, slurm_stack: Any, certs: dict[str, Any]) -> None:
    key = certs["key"]
    sign(slurm_stack, key, "20200101:20200102")  # expired years ago
    alpha = _profile(certs["profiles"], slurm_stack, "alpha", "cert-alpha", key_file=str(key))
    beta = _profile(certs["profiles"], slurm_stack, "beta", "plain-beta",
                    key_file=slurm_stack.ssh_key)
    code, checked = _check(alpha)
    assert code == 3 and not checked["connected"]
    assert "expired at 2020-01-02 00:00 UTC" in checked["checks"][0]["detail"]
    assert [c["check"] for c in checked["checks"]] == ["login"]  # no connection was tried

    job = _job(tmp_path, "expired", {"alpha": alpha, "beta": beta})
    result = runner.invoke(app, ["submit", str(job)])
    assert result.exit_code == 3, result.output
    said = " ".join(result.output.split())
    assert "site alpha:" in said and "expired at 2020-01-02 00:00 UTC" in said
    assert f"ssh-keygen -s CA -V +12h {alpha}.pub" in said and "Traceback" not in said

    # valid now, but for 3 minutes only: less than the SLURM time limit of 10 minutes
    sign(slurm_stack, key, "-1m:+3m")
    code, checked = _check(alpha)
    assert code == 0, checked  # the login itself works
    result = runner.invoke(app, ["submit", str(job)])
    assert result.exit_code == 3, result.output
    said = " ".join(result.output.split())
    assert "site alpha:" in said and "before a round's time limit of 10m" in said
    assert "SLURM time limit 00:10:00" in said
    assert Registry().list_runs() == []
    assert not runs_dir().exists() or not any(runs_dir().iterdir())
    assert _jobs_named(slurm_stack, "xffl-expired-") == []
