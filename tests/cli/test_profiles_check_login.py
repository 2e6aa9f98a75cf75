"""`xffl profiles check` of a certificate facility's profile whose key has no certificate, and
the checks a failed login leaves unreached (no stack: nothing connects)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.cli.schemas import check
from xffl.cli.app import app

runner = CliRunner()
RENEW = "step ssh certificate me@example.org ~/.ssh/hpc --provisioner hpc --force"


def _profile(tmp_path: Path, renew: str | None) -> Path:
    """A profile named ``hpc`` in ./site_profiles whose key exists, with no -cert.pub."""
    key = tmp_path / "hpc"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                   check=True, capture_output=True, timeout=30)
    folder = tmp_path / "site_profiles"
    folder.mkdir()
    connector = {"type": "ssh", "host": "127.0.0.1", "port": 9, "user": "me",
                 "key_file": str(key), "ssh_config": False,
                 "known_hosts": str(tmp_path / "known_hosts"), **({"renew": renew} if renew
                                                                  else {})}
    (folder / "hpc.yaml").write_text(yaml.safe_dump({
        "name": "hpc", "connector": connector,
        "slurm": {"partition": "gpu", "time": "00:10:00"}, "workdir": "/scratch/me/xffl"}))
    return key


def test_a_key_without_its_certificate_is_not_a_login_where_the_facility_needs_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile renews a certificate (its facility's 2FA issues one): a key without its
    -cert.pub is "login NO", naming the missing file and the command that gets it; nothing
    is tried on the network, and every check after login is listed as not run."""
    key = _profile(tmp_path, RENEW)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["profiles", "check", "hpc", "--json"])
    assert result.exit_code == 3, result.output
    data = check("profiles-check", json.loads(result.stdout))
    (login,) = data["checks"]
    assert login["check"] == "login" and login["ok"] is False
    assert f"{key}-cert.pub does not exist" in login["detail"]
    assert f"get one with `{RENEW}`" in login["detail"]
    assert data["not_checked"] == ["connect", "slurm commands", "partition",
                                   "workdir writable", "workdir private", "xffl importable",
                                   "versions", "exchange format", "gpus"]
    table = runner.invoke(app, ["profiles", "check", "hpc"])
    assert table.exit_code == 3
    for name in data["not_checked"]:
        assert any(name in line and "not run" in line for line in table.stdout.splitlines()), \
            table.stdout


def test_a_plain_key_facility_still_tries_the_key(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """No renew command: a key is a login as before; the connection (to a closed port) fails,
    and the checks after it are listed as not run."""
    _profile(tmp_path, None)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["profiles", "check", "hpc", "--json"])
    assert result.exit_code == 3, result.output
    data = check("profiles-check", json.loads(result.stdout))
    assert [(c["check"], c["ok"]) for c in data["checks"]] == [("login", True),
                                                               ("connect", False)]
    assert data["not_checked"] == ["slurm commands", "partition", "workdir writable",
                                   "workdir private", "xffl importable", "versions",
                                   "exchange format", "gpus"]
