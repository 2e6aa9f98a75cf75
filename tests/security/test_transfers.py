"""xffl-ssh against StreamFlow's SSH connector: hostile tar streams, job folders, host keys.

The tar tests feed crafted streams (what a compromised facility account can send in place of
``tar chf -``) to upstream's ``extract_tar_stream`` and to xffl's ``safe_extract``; the stack
tests run the small cyclic workflow of tests/workflows/sf_fixtures/ with site b behind
cluster beta's login node through each connector.
"""

from __future__ import annotations

import asyncio
import io
import stat
import tarfile
from pathlib import Path
from typing import Any

import pytest

from tests.workflows.extensions.test_plugin import final_global, run_rounds
from xffl.workflows.extensions.ssh import (
    COPY_SLACK_BYTES,
    COPY_SLACK_MEMBERS,
    CopyCaps,
    UnsafeArchive,
    reference_caps,
    safe_extract,
)


class _Stream:
    """The read side of a byte stream, as StreamFlow's tar reader takes it."""

    def __init__(self, data: bytes) -> None:
        self._buf = io.BytesIO(data)

    async def read(self, size: int = -1) -> bytes:
        return self._buf.read(size)

    async def close(self) -> None:
        """Nothing to release."""


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            info.size = len(data) if data is not None else 0
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.mode = 0o644
    return info, data


def _entry(name: str, kind: bytes, target: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def _extract(fn: Any, data: bytes, dst: Path, *args: Any) -> None:
    from streamflow.deployment import aiotarstream

    async def run() -> None:
        async with aiotarstream.open(stream=_Stream(data), mode="r") as tar:
            await fn(tar, "/site/job/update", str(dst), 1 << 16, *args)

    asyncio.run(run())


def test_a_checkpoint_copy_is_extracted(tmp_path: Path) -> None:
    dst = tmp_path / "update"
    data = _tar([(_entry("update", tarfile.DIRTYPE)[0], None), _file("update/model.bin", b"w" * 9),
                 _file("update/manifest.json", b"{}")])
    _extract(safe_extract, data, dst)
    assert sorted(p.name for p in dst.iterdir()) == ["manifest.json", "model.bin"]
    assert (dst / "model.bin").read_bytes() == b"w" * 9
    assert stat.S_IMODE((dst / "model.bin").stat().st_mode) == 0o600  # owner-only


@pytest.mark.parametrize(("member", "why"), [
    (_file("update/../../escaped.txt"), "not a path under update"),
    (_file("/tmp/xffl-absolute.txt"), "not a path under update"),
    (_file("other/file.txt"), "not a path under update"),
    (_entry("update/link", tarfile.SYMTYPE, "/etc"), "not a regular file or folder"),
    (_entry("update/hard", tarfile.LNKTYPE, "/etc/passwd"), "not a regular file or folder"),
    (_entry("update/fifo", tarfile.FIFOTYPE), "not a regular file or folder"),
    (_entry("update/dev", tarfile.CHRTYPE), "not a regular file or folder"),
], ids=["dotdot", "absolute", "outside", "symlink", "hardlink", "fifo", "device"])
def test_a_hostile_member_is_refused(tmp_path: Path, member: Any, why: str) -> None:
    dst = tmp_path / "job" / "update"
    dst.mkdir(parents=True)
    with pytest.raises(UnsafeArchive, match=why):
        _extract(safe_extract, _tar([member]), dst)
    assert list(dst.iterdir()) == [] and not (tmp_path / "escaped.txt").exists()
    assert not Path("/tmp/xffl-absolute.txt").exists()


def test_a_copied_file_is_extracted(tmp_path: Path) -> None:
    """A File output: the one member is the copied file, its destination a file path."""
    from streamflow.deployment import aiotarstream

    async def run() -> None:
        async with aiotarstream.open(stream=_Stream(_tar([_file("probe.json", b"{}")])),
                                     mode="r") as tar:
            await safe_extract(tar, "/site/job/probe.json", str(tmp_path / "probe.json"),
                               1 << 16)

    asyncio.run(run())
    assert (tmp_path / "probe.json").read_bytes() == b"{}"


def test_the_size_of_a_copy_is_capped(tmp_path: Path) -> None:
    data = _tar([_file("update/a", b"a" * 600), _file("update/b", b"b" * 600)])
    with pytest.raises(UnsafeArchive, match="exceeds 1000 bytes"):
        _extract(safe_extract, data, tmp_path / "update", CopyCaps(bytes=1000))


def test_the_number_of_members_of_a_copy_is_capped(tmp_path: Path) -> None:
    """Empty files cost no bytes, but each is a file (an inode, a tar header) at the end."""
    data = _tar([_file(f"update/{i}", b"") for i in range(11)])
    with pytest.raises(UnsafeArchive, match="more than 10 files and folders"):
        _extract(safe_extract, data, tmp_path / "update", CopyCaps(members=10))
    assert len(list((tmp_path / "update").iterdir())) == 10  # refused at the 11th


def test_the_caps_follow_the_size_of_the_runs_global(tmp_path: Path) -> None:
    """copyFactor x the round-0 global (+ room for JSON files), never above the ceiling."""
    glob = tmp_path / "rounds" / "0" / "global"
    glob.mkdir(parents=True)
    (glob / "model.safetensors").write_bytes(b"w" * 1000)
    (glob / "manifest.json").write_bytes(b"{}")
    ceiling = CopyCaps()
    caps = reference_caps(str(glob), 4.0, ceiling)
    # 4 x 1002 bytes + 64 MiB; 4 x (2 files + the folder) + 64 entries
    assert caps == CopyCaps(bytes=4008 + COPY_SLACK_BYTES, members=12 + COPY_SLACK_MEMBERS)
    assert reference_caps(str(glob), 4.0, CopyCaps(bytes=100, members=5)) == \
        CopyCaps(bytes=100, members=5)
    assert reference_caps(str(tmp_path / "none"), 4.0, ceiling) == ceiling
    # an update twice the global's factor is refused, one within it extracted
    big = _tar([_file("update/model.safetensors", b"w" * (caps.bytes + 1))])
    with pytest.raises(UnsafeArchive, match=f"exceeds {caps.bytes} bytes"):
        _extract(safe_extract, big, tmp_path / "big", caps)
    _extract(safe_extract, _tar([_file("update/model.safetensors", b"w" * 4000)]),
             tmp_path / "ok", caps)
    assert (tmp_path / "ok" / "model.safetensors").stat().st_size == 4000


def test_a_link_on_disk_in_the_destination_is_not_followed(tmp_path: Path) -> None:
    """A folder in the destination that is a link to elsewhere (put there by anyone who could
    write it) would carry a plain, well-named member out of the destination."""
    dst = tmp_path / "job" / "update"
    dst.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (dst / "sub").symlink_to(outside)
    for member in (_file("update/sub/model.bin", b"owned"),
                   (_entry("update/sub/deeper", tarfile.DIRTYPE)[0], None)):
        with pytest.raises(UnsafeArchive, match="a link on its way leads outside"):
            _extract(safe_extract, _tar([member]), dst)
    assert list(outside.iterdir()) == []


def test_upstream_extracts_outside_the_destination_and_creates_links(tmp_path: Path) -> None:
    """The upstream defect xffl-ssh fixes, shown on the same streams."""
    from streamflow.deployment.connector.base import extract_tar_stream

    dst = tmp_path / "job" / "update"
    dst.mkdir(parents=True)
    _extract(extract_tar_stream, _tar([_file("update/../../escaped.txt", b"owned")]), dst)
    assert (tmp_path / "escaped.txt").read_bytes() == b"owned"  # outside the destination
    _extract(extract_tar_stream, _tar([_entry("update/link", tarfile.SYMTYPE, "/etc")]), dst)
    link = dst / "link"  # a link the coordinator follows out of the destination
    assert link.is_symlink() and not link.resolve().is_relative_to(dst)


def _login_b(stack: Any, kind: str, **config: Any) -> dict[str, Any]:
    cluster = stack.clusters["beta"]
    return {"type": kind, "workdir": f"{cluster.work_dir}/sfssh-{kind}", "config": {
        "nodes": [f"127.0.0.1:{cluster.ssh_port}"], "username": stack.user,
        "sshKey": stack.ssh_key, "checkHostKey": True, **config}}


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "mode"), [("ssh", 0o777), ("xffl-ssh", 0o700)])
def test_job_folders_at_the_site(tmp_path: Path, slurm_stack: Any,
                                 monkeypatch: pytest.MonkeyPatch, kind: str, mode: int) -> None:
    """Upstream creates every job folder at the site world-writable; xffl-ssh owner-only."""
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    deployments = {"site-a": {"type": "xffl-local", "config": {}},
                   "site-b": _login_b(slurm_stack, kind)}
    code, out, run_dir = run_rounds(tmp_path, deployments, rounds=1)
    assert code == 0, out[-3000:]
    assert final_global(run_dir) == "a@1(w0)+b@1(w0)"
    workdir = Path(deployments["site-b"]["workdir"])
    folders = [p for p in workdir.iterdir() if p.is_dir()]
    assert folders and {stat.S_IMODE(p.stat().st_mode) for p in folders} == {mode}


@pytest.mark.slow
def test_host_keys_are_checked_with_the_profiles_known_hosts(
        tmp_path: Path, slurm_stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no ~/.ssh/known_hosts, only the node's own known_hosts lets StreamFlow in."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    for name in ("upstream", "ours", "wrong"):
        (tmp_path / name).mkdir()
    # a refused host key is no passing fault: one attempt (StreamFlow's default is 3, 5 s apart)
    once = {"retries": 1, "retryDelay": 0}
    upstream = {"site-a": {"type": "xffl-local", "config": {}},
                "site-b": _login_b(slurm_stack, "ssh", **once)}
    code, out, run_dir = run_rounds(tmp_path / "upstream", upstream, rounds=1)
    assert final_global(run_dir) == "a@1(w0)"  # b's host key could not be checked: left out
    ours = {"site-a": {"type": "xffl-local", "config": {}},
            "site-b": _login_b(slurm_stack, "xffl-ssh", knownHosts=slurm_stack.known_hosts)}
    code, out, run_dir = run_rounds(tmp_path / "ours", ours, rounds=1)
    assert code == 0, out[-3000:]
    assert final_global(run_dir) == "a@1(w0)+b@1(w0)"
    # a known_hosts that does not hold the site's key refuses it, as ssh does
    (tmp_path / "other_hosts").write_text("")
    wrong = {"site-a": {"type": "xffl-local", "config": {}},
             "site-b": _login_b(slurm_stack, "xffl-ssh",
                                knownHosts=str(tmp_path / "other_hosts"), **once)}
    code, out, run_dir = run_rounds(tmp_path / "wrong", wrong, rounds=1)
    assert final_global(run_dir) == "a@1(w0)"
