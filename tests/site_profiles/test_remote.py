"""site_profiles.remote and .checks on the real test stack: host keys verified, preflight."""

from __future__ import annotations

import platform
import re
import shlex
import sys
from importlib import metadata
from pathlib import Path

import paramiko
import pytest
import yaml

from tests.conftest import QUICKSTART, REPO
from xffl.core.errors import ConnectionFailed
from xffl.core.versions import FORMAT_VERSION, xffl_version
from xffl.site_profiles.checks import check_site, preflight
from xffl.site_profiles.lookup import bundled_dir, load_profile_file
from xffl.site_profiles.remote import connect, run
from xffl.site_profiles.schema import SiteProfile
from xffl.workflows.submit import submit


def write_profile(folder: Path, stack, cluster: str = "alpha",  # type: ignore[no-untyped-def]
                  known_hosts: str | None = None, name: str | None = None) -> Path:
    """A profile for one test cluster in ``folder``; return its file."""
    info = stack.clusters[cluster]
    name = name or f"test-{cluster}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name,
        "connector": {"type": "ssh", "host": "127.0.0.1", "port": info.ssh_port,
                      "user": stack.user, "key_file": stack.ssh_key,
                      "known_hosts": known_hosts or stack.known_hosts},
        "slurm": {"partition": info.partition, "time": "00:10:00", "polling_interval": 1},
        "launcher": "srun",
        "python": sys.executable,
        "workdir": info.work_dir,
    }))
    return path


def wrong_known_hosts(path: Path, port: int) -> str:
    """A known_hosts file holding a different key for [127.0.0.1]:PORT."""
    key = paramiko.RSAKey.generate(2048)
    path.write_text(f"[127.0.0.1]:{port} ssh-rsa {key.get_base64()}\n")
    return str(path)


def other_host_known_hosts(path: Path) -> str:
    """A known_hosts file that knows some other host only."""
    key = paramiko.RSAKey.generate(2048)
    path.write_text(f"[10.9.8.7]:2222 ssh-rsa {key.get_base64()}\n")
    return str(path)


@pytest.mark.parametrize("name", ["leonardo", "karolina", "lumi", "local"])
def test_bundled_profiles_load(name: str) -> None:
    profile = load_profile_file(bundled_dir() / f"{name}.yaml")
    assert profile.name == name
    if name != "local":
        assert profile.slurm is not None and profile.slurm.partition
        assert profile.launcher == "srun"


def test_local_profile_checks(xffl_home: Path) -> None:
    result = check_site("local", load_profile_file(bundled_dir() / "local.yaml"))
    assert result.ok, result.rows
    assert {r[0] for r in result.rows} == {"xffl importable", "versions", "exchange format",
                                           "gpus", "workdir writable", "workdir private"}


def test_a_workdir_others_can_write_fails_the_check(xffl_home: Path) -> None:
    """Another user who can write the workdir could swap what a job leaves there."""
    profile = load_profile_file(bundled_dir() / "local.yaml")
    workdir = Path(profile.workdir.replace("{xffl_home}", str(xffl_home))
                   .replace("{site}", "local"))
    assert check_site("local", profile).ok
    assert workdir.stat().st_mode & 0o777 == 0o700  # created owner-only
    workdir.chmod(0o775)
    result = check_site("local", profile)
    assert not result.ok
    (row,) = [r for r in result.rows if r[0] == "workdir private"]
    assert row[1] is False and "mode 0775" in row[2] and "chmod go-w" in row[2]


def test_placeholders_reported() -> None:
    profile = load_profile_file(bundled_dir() / "leonardo.yaml")
    result = check_site("leonardo", profile.model_copy(update={
        "connector": profile.connector.model_copy(update={"host": "127.0.0.1", "port": 1})}))
    assert not result.ok and not result.connected
    row = result.rows[0]
    assert row[0] == "placeholders" and "site_profiles/leonardo.yaml" in row[2]
    assert "user" in row[2] and "account" in row[2]


@pytest.mark.slow
def test_check_alpha_passes(tmp_path: Path, slurm_stack) -> None:  # type: ignore[no-untyped-def]
    profile = load_profile_file(write_profile(tmp_path, slurm_stack))
    result = check_site("alpha", profile)
    assert result.ok, result.rows
    assert [r[0] for r in result.rows] == [
        "login", "connect", "slurm commands", "partition", "workdir writable", "workdir private",
        "xffl importable", "versions", "exchange format", "gpus"]
    rows = {r[0]: r[2] for r in result.rows}
    # the site's Python (this venv's, over SSH) and the partition's GRES as sinfo lists them
    assert rows["versions"] == (
        f"Python {platform.python_version()}, xffl {xffl_version()} (exchange format "
        f"{FORMAT_VERSION}), torch {metadata.version('torch')} (CPU only), transformers "
        f"{metadata.version('transformers')}")
    assert rows["exchange format"] == f"{FORMAT_VERSION}, as this xffl {xffl_version()} reads"
    assert rows["gpus"].startswith(f"0 where the probe ran; partition "
                                   f"{slurm_stack.clusters['alpha'].partition}: GRES "), rows
    client = connect(profile)
    with client:
        rc, out, _ = run(client, "echo $SLURM_CONF", timeout=10)
        assert rc == 0 and out.strip()
        # a workdir other users can write fails the check, read over SSH
        workdir = shlex.quote(profile.workdir)
        rc, _, _ = run(client, f"chmod 0777 {workdir}", timeout=10)
        assert rc == 0
        try:
            result = check_site("alpha", profile)
        finally:
            run(client, f"chmod 0700 {workdir}", timeout=10)
    (row,) = [r for r in result.rows if r[0] == "workdir private"]
    assert not result.ok and row[1] is False and "mode 0777" in row[2]


@pytest.mark.slow
def test_changed_host_key(tmp_path: Path, slurm_stack) -> None:  # type: ignore[no-untyped-def]
    port = slurm_stack.clusters["alpha"].ssh_port
    kh = wrong_known_hosts(tmp_path / "kh", port)
    profile = load_profile_file(write_profile(tmp_path, slurm_stack, known_hosts=kh))
    with pytest.raises(ConnectionFailed, match=re.escape(f"host key of 127.0.0.1:{port} changed")):
        connect(profile)
    with pytest.raises(ConnectionFailed, match="host key"):
        preflight({"alpha": profile})


@pytest.mark.slow
def test_unknown_host(tmp_path: Path, slurm_stack) -> None:  # type: ignore[no-untyped-def]
    kh = other_host_known_hosts(tmp_path / "kh")
    profile = load_profile_file(write_profile(tmp_path, slurm_stack, known_hosts=kh))
    with pytest.raises(ConnectionFailed, match="not in known_hosts"):
        connect(profile)


def test_refused_port(tmp_path: Path) -> None:
    profile = SiteProfile.model_validate({
        "name": "nowhere", "connector": {"type": "ssh", "host": "127.0.0.1", "port": 1}})
    with pytest.raises(ConnectionFailed, match=re.escape("127.0.0.1:1")):
        connect(profile)


@pytest.mark.slow
def test_an_unreachable_transfer_host_is_one_line(tmp_path: Path,
                                                  slurm_stack) -> None:  # type: ignore[no-untyped-def]
    """The login node answers, the transfer_host does not: `profiles check` has a failed
    row and preflight (what submit runs first) stops, each one line naming the field."""
    path = write_profile(tmp_path, slurm_stack)
    data = yaml.safe_load(path.read_text())
    data["connector"]["transfer_host"] = "127.0.0.1:1"
    path.write_text(yaml.safe_dump(data))
    profile = load_profile_file(path)
    result = check_site("alpha", profile)
    (row,) = [r for r in result.rows if r[0] == "transfer host"]
    assert not result.ok and row[1] is False
    why = re.escape("127.0.0.1:1") + r".*\(connector\.transfer_host of site_profiles/"
    assert re.search(why, row[2]) and "\n" not in row[2], row
    with pytest.raises(ConnectionFailed, match=why):
        preflight({"alpha": profile})
    assert [r[0] for r in check_site("alpha", load_profile_file(
        write_profile(tmp_path, slurm_stack))).rows][-1] == "gpus"


@pytest.mark.slow
def test_submit_stops_before_writing(tmp_path: Path, slurm_stack,  # type: ignore[no-untyped-def]
                                     xffl_home: Path) -> None:
    port = slurm_stack.clusters["alpha"].ssh_port
    kh = wrong_known_hosts(tmp_path / "kh", port)
    write_profile(tmp_path / "site_profiles", slurm_stack, known_hosts=kh, name="test-alpha")
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["sites"] = spec["sites"][:1]
    spec["sites"][0]["profile"] = "test-alpha"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    with pytest.raises(ConnectionFailed, match="host key"):
        submit(job)
    runs = xffl_home / "runs"
    assert not runs.exists() or not any(runs.iterdir())


def test_no_disabled_host_key_checks() -> None:
    pattern = re.compile(r"AutoAddPolicy|WarningPolicy|checkHostKey\W+(false|False)")
    offenders = [
        str(path.relative_to(REPO)) for path in REPO.rglob("*")
        if path.is_file() and path.suffix in {".py", ".yaml", ".yml", ".j2", ".cwl"}
        and "tests" not in path.relative_to(REPO).parts
        and not any(p.startswith(".") or p.endswith(".egg-info") for p in path.parts)
        and pattern.search(path.read_text(errors="ignore"))
    ]
    assert not offenders
