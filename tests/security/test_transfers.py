"""xffl-ssh against StreamFlow's SSH connector: hostile tar streams, job folders, host keys.

The tar test feeds crafted streams (what a compromised facility account can send in place of
``tar chf -``) to upstream's ``extract_tar_stream`` (xffl-ssh takes no tar stream: its checked
copies are attacked in tests/workflows/extensions/test_copies.py); the caps test sizes a copy
by the run's global and lists one over it; the stack tests run the small cyclic workflow of
tests/workflows/sf_fixtures/ with site b behind cluster beta's login node through each
connector.
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
from xffl.workflows.extensions.caps import (
    COPY_SLACK_BYTES,
    COPY_SLACK_MEMBERS,
    CopyCaps,
    reference_caps,
)
from xffl.workflows.extensions.copies import CopyRefused, check_listing


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
    # an update over the global's factor is refused before a byte is written, one within it
    # is listed for the copy
    with pytest.raises(CopyRefused, match=f"exceeds {caps.bytes} bytes"):
        check_listing(b"d 0 \0f %d model.safetensors\0" % (caps.bytes + 1), "update",
                      caps.bytes, caps.members)
    assert check_listing(b"d 0 \0f 4000 model.safetensors\0", "update", caps.bytes,
                         caps.members).bytes == 4000


def test_upstream_extracts_outside_the_destination_and_creates_links(tmp_path: Path) -> None:
    """The upstream defect xffl-ssh's checked copies fix (a site's listing with ``..`` or a
    link is refused in tests/workflows/extensions/test_copies.py)."""
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
