"""A profile's login resolved with the user's ~/.ssh/config, and used for real on the stack."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tests.stack.certs import bare_home, new_key, sign
from xffl.cli.app import app
from xffl.core.errors import InvalidInput
from xffl.site_profiles.login import resolve
from xffl.site_profiles.schema import SshConnector
from xffl.workflows.plan.deployments import ssh_connection

runner = CliRunner()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HOME with ~/.ssh."""
    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _config(home: Path, text: str) -> None:
    (home / ".ssh" / "config").write_text(text)


def test_host_alias_fills_what_the_profile_leaves_out(home: Path) -> None:
    key = home / ".ssh" / "leo"
    key.write_text("not read here")
    Path(f"{key}-cert.pub").write_text("not read here")
    _config(home, f"""
Host leonardo
    HostName login.leonardo.cineca.it
    User aria0001
    Port 2022
    IdentityFile {key}
Host *
    User nobody
""")
    login = resolve(SshConnector(host="leonardo"))
    assert (login.host, login.port, login.user) == ("login.leonardo.cineca.it", 2022, "aria0001")
    assert login.key_file == str(key) and login.certificate == f"{key}-cert.pub"
    assert login.alias == "leonardo" and login.jump is None
    # what the profile says wins over the config
    mine = resolve(SshConnector(host="leonardo", port=22, user="me", key_file="~/.ssh/other"))
    assert (mine.port, mine.user, mine.key_file) == (22, "me", str(home / ".ssh" / "other"))
    assert mine.certificate is None  # ~/.ssh/other-cert.pub does not exist
    # ssh_config: false ignores the file entirely
    raw = resolve(SshConnector(host="leonardo", ssh_config=False))
    assert (raw.host, raw.port, raw.user, raw.key_file) == ("leonardo", 22, None, None)


def test_proxyjump_chain_and_profile_jump(home: Path) -> None:
    _config(home, """
Host bastion
    HostName gw.example.org
    User gwuser
Host inner
    HostName 10.0.0.5
    ProxyJump bastion,hop@relay.example.org:2200
Host legacy
    ProxyCommand ssh -W %h:%p gw.example.org
""")
    login = resolve(SshConnector(host="inner", user="u"))
    assert [(h.host, h.port, h.user) for h in login.chain()] == [
        ("gw.example.org", 22, "gwuser"), ("relay.example.org", 2200, "hop"),
        ("10.0.0.5", 22, "u")]
    assert login.describe() == ("u@10.0.0.5:22 (Host inner of ~/.ssh/config) via "
                                "hop@relay.example.org:2200 via gwuser@gw.example.org:22 "
                                "(Host bastion of ~/.ssh/config)")
    # the profile's jump replaces the config's ProxyJump
    direct = resolve(SshConnector.model_validate({"host": "inner", "jump": "me@other:2022"}))
    assert [(h.host, h.port, h.user) for h in direct.chain()] == [
        ("other", 2022, "me"), ("10.0.0.5", 22, None)]
    with pytest.raises(InvalidInput, match="ProxyCommand"):
        resolve(SshConnector(host="legacy"), "site profile x")


def test_streamflow_connection_links_a_certificate_kept_elsewhere(home: Path,
                                                                  tmp_path: Path) -> None:
    key, cert = tmp_path / "k", tmp_path / "certs" / "k.cert"
    login = resolve(SshConnector.model_validate({
        "host": "h", "port": 2222, "user": "u", "key_file": str(key),
        "certificate": str(cert), "jump": {"host": "j", "user": "ju"}}))
    node = ssh_connection(login, tmp_path / "plan" / "ssh", Path("/run/final/ssh"), "leo")
    assert node == {"hostname": "h:2222", "checkHostKey": True, "username": "u",
                    "sshKey": "/run/final/ssh/leo",
                    "tunnel": {"hostname": "j:22", "checkHostKey": True, "username": "ju"}}
    links = tmp_path / "plan" / "ssh"
    assert os.readlink(links / "leo") == str(key)
    assert os.readlink(links / "leo-cert.pub") == str(cert)


def test_sites_check_through_a_host_alias(tmp_path: Path, slurm_stack: Any,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile naming only a Host alias logs in with the config's port, user and key."""
    home = bare_home(tmp_path / "home", slurm_stack)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    key = new_key(tmp_path / "keys", "aliased")
    sign(slurm_stack, key, "-1m:+1h")
    port = slurm_stack.clusters["alpha"].ssh_port
    (home / ".ssh" / "config").write_text(
        f"Host xffl-alpha\n    HostName 127.0.0.1\n    Port {port}\n"
        f"    User {slurm_stack.user}\n    IdentityFile {key}\n")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "site_profiles").mkdir()
    (tmp_path / "site_profiles" / "aliased.yaml").write_text(yaml.safe_dump({
        "name": "aliased", "connector": {"type": "ssh", "host": "xffl-alpha"},
        "slurm": {"partition": slurm_stack.clusters["alpha"].partition},
        "python": sys.executable, "workdir": slurm_stack.clusters["alpha"].work_dir}))
    result = runner.invoke(app, ["profiles", "check", "aliased", "--json"])
    assert result.exit_code == 0, result.output
    checks = {c["check"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["connect"]["detail"].startswith(
        f"{slurm_stack.user}@127.0.0.1:{port} (Host xffl-alpha of ~/.ssh/config)")
    assert f"certificate {key}-cert.pub, valid until" in checks["login"]["detail"]


def test_transfer_settings_reach_streamflow(home: Path, tmp_path: Path) -> None:
    from xffl.site_profiles.schema import SiteProfile
    from xffl.workflows.plan.deployments import site_deployments

    profile = SiteProfile.model_validate({
        "name": "slow", "connector": {"type": "ssh", "host": "h", "user": "u",
                                      "transfer": {"connect_timeout": 90, "retries": 8,
                                                   "retry_delay": 30, "buffer_size": 1 << 20}},
        "slurm": {"partition": "p"}})
    deployments, target = site_deployments("slow", profile, tmp_path, tmp_path)
    login = deployments["login-slow"]["config"]
    assert {k: login[k] for k in ("connectTimeout", "retries", "retryDelay",
                                  "transferBufferSize")} == \
        {"connectTimeout": 90, "retries": 8, "retryDelay": 30, "transferBufferSize": 1 << 20}
    assert login["nodes"] == ["h:22"] and target == {"deployment": "slurm-slow",
                                                     "service": "train"}
    default = SiteProfile.model_validate({"name": "d", "connector": {"type": "ssh",
                                                                     "host": "h"}})
    deployments, _ = site_deployments("d", default, tmp_path, tmp_path)
    assert deployments["login-d"]["config"]["transferBufferSize"] == 4 << 20
