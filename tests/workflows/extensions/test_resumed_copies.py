"""A dropped copy resumes from the bytes that arrived, and only once their prefix is shown equal.

The site's side runs as real local processes (``sh -c``, the commands xffl-ssh sends over
SSH); its ``head`` (back) or ``dd`` (out) is the test's own on PATH, and stops early once, as
a dropped connection would. The prefix kept is then corrupted (locally after a download, at
the site after an upload) between the drop and the resume: a copy that kept it without its
SHA-256 check would end with the wrong bytes. The bytes are random, so that a resume from
the wrong offset cannot land on equal bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from streamflow.log_handler import logger

from tests.workflows.extensions.test_copies import _Proc
from xffl.workflows.extensions.copies import UPLOAD_SLACK_BYTES, Copier
from xffl.workflows.extensions.copy_paths import download, upload

SIZE = 300_000  # one piece back (below MIN_RANGE_BYTES): a single `head -c` from byte 0
FIRST = 123_457  # what the first `head` sends before it fails (no chunk boundary)
# out: more than UPLOAD_SLACK_BYTES must arrive for a resumed upload to keep anything
UP_SIZE = UPLOAD_SLACK_BYTES + (4 << 20)
UP_FIRST = UPLOAD_SLACK_BYTES + (2 << 20) + 12_345  # what the first `dd` writes there


def _copier(bin_dir: Path, recover: Callable[[], None]) -> Copier:
    """One stream, one retry, the site's commands run here with ``bin_dir`` first on PATH;
    ``recover()`` runs between the drop and the resume (where the prefix is corrupted)."""
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")

    @contextlib.asynccontextmanager
    async def open_process(command: str, upload: bool) -> AsyncIterator[_Proc]:
        pipe, null = asyncio.subprocess.PIPE, asyncio.subprocess.DEVNULL
        proc = await asyncio.create_subprocess_shell(
            command, stdin=pipe if upload else null, stdout=null if upload else pipe, env=env)
        try:
            yield _Proc(proc)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    async def on_drop() -> None:
        recover()

    return Copier(open_process, on_drop, streams=1, retries=1, retry_delay=0,
                  buffer_size=1 << 16, stall_s=60)


def _once(tmp_path: Path, name: str, first: str) -> Path:
    """A ``bin`` folder whose ``name`` runs ``first`` (sh) on its first call, then the real
    one (the first call is the copy's: nothing else runs ``name`` before it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker, real = tmp_path / f"{name}-dropped", shutil.which(name)
    (bin_dir / name).write_text(
        f"#!/bin/sh\nif [ ! -e {marker} ]; then touch {marker}\n{first}\nfi\n"
        f'exec {real} "$@"\n')
    (bin_dir / name).chmod(0o700)
    return bin_dir


def _flip(path: Path, offset: int) -> None:
    """Change one byte of ``path`` in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _resumed_from(records: list[logging.LogRecord]) -> list[str]:
    """What the copier logged about the resumed pieces (``... from N``)."""
    return [r.getMessage().rsplit(" ", 1)[1] for r in records if "RESUMING" in r.getMessage()]


@pytest.fixture
def said(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """StreamFlow's log records of the test (xffl-ssh logs through StreamFlow's logger)."""
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="streamflow"):
            yield caplog
    finally:
        logger.removeHandler(caplog.handler)


def _site_file(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    site = tmp_path / "site"
    site.mkdir()
    data = os.urandom(size)
    (site / "model.safetensors").write_bytes(data)
    return site, data


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_download_resumes_after_a_head_that_stopped_early(
        tmp_path: Path, said: pytest.LogCaptureFixture, corrupt: bool) -> None:
    """The first ``head -c`` sends FIRST true bytes and fails (a dropped channel): the copy
    resumes at byte FIRST (``tail -c +FIRST+1``). With the local prefix corrupted before
    the resume, its SHA-256 differs from the site's and the piece starts again from 0."""
    site, data = _site_file(tmp_path, SIZE)
    real_head = shutil.which("head")
    bin_dir = _once(tmp_path, "head", f'for f; do :; done\n{real_head} -c {FIRST} -- "$f"\n'
                                      "exit 1")
    back = tmp_path / "back"
    copier = _copier(bin_dir, lambda: _flip(back / "model.safetensors", 1000) if corrupt
                     else None)
    asyncio.run(download(copier, str(site), str(back), 1 << 30, 100))
    assert copier.progress.attempts == 2
    got = (back / "model.safetensors").read_bytes()
    wrong = [i for i in range(SIZE) if got[i] != data[i]]
    assert not wrong, f"{len(wrong)} wrong bytes, the first at {wrong[0]}"
    resumed = _resumed_from(said.records)
    assert resumed == [f"{0 if corrupt else FIRST}"], resumed


@pytest.mark.parametrize("corrupt", [False, True])
def test_an_upload_resumes_after_a_dd_that_stopped_early(
        tmp_path: Path, said: pytest.LogCaptureFixture, corrupt: bool) -> None:
    """The first ``dd`` writes UP_FIRST true bytes at the site and fails: the copy keeps
    what arrived less UPLOAD_SLACK_BYTES (bytes in flight when the link dropped), once its
    SHA-256 matches the site's. With the site's prefix corrupted before the resume, the
    piece starts again from 0."""
    src = tmp_path / "model.safetensors"
    data = os.urandom(UP_SIZE)
    src.write_bytes(data)
    real_head = shutil.which("head")
    bin_dir = _once(tmp_path, "dd", f'{real_head} -c {UP_FIRST} | {shutil.which("dd")} "$@"\n'
                                    "exit 1")
    there = tmp_path / "site" / "model.safetensors"
    copier = _copier(bin_dir, lambda: _flip(there, 1000) if corrupt else None)
    asyncio.run(upload(copier, str(src), str(there)))
    assert copier.progress.attempts == 2
    got = there.read_bytes()
    assert len(got) == UP_SIZE
    wrong = [i for i in range(UP_SIZE) if got[i] != data[i]]
    assert not wrong, f"{len(wrong)} wrong bytes, the first at {wrong[0]}"
    (resumed,) = _resumed_from(said.records)
    if corrupt:
        assert resumed == "0"
    else:  # what was sent when the dd failed (about UP_FIRST: a pipe's worth and a
        # chunk either way), less the slack: something kept, never more than the site holds
        assert 0 < int(resumed) <= UP_FIRST, resumed
