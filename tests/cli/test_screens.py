"""Screens at 80 columns and in pipes: nothing cut, one record per line (`cli/tables.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xffl.jobs.records import RoundRecord, SiteRound
from xffl.jobs.registry import Registry

XFFL = str(Path(sys.executable).parent / "xffl")
RUN = "a-rather-long-experiment-name-20261125-101010-beef"
# values a cut would shorten: the state, a 9-digit token count, 6 decimals of loss, the id
SITES = [SiteRound(site="leonardo-boost", state="completed", num_samples=1_234_567,
                   num_tokens=987_654_321, loss=3.354575, train_seconds=5123.4,
                   device="NVIDIA H100 80GB HBM3", gpus=4, tokens_per_s_per_gpu=3412.6,
                   tflops=405.53, mfu=0.41004, peak_memory_gib=61.234, save_seconds=12.5),
         SiteRound(site="karolina", state="failed", reason="round timeout after 7200 s: "
                   "SLURM job 4242 scancelled", attempts=2)]


@pytest.fixture
def finished_run(xffl_home: Path, tmp_path: Path) -> str:
    registry = Registry()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    registry.create_run(RUN, "a-rather-long-experiment-name", tmp_path / "job.yaml", run_dir, 1,
                        [s.site for s in SITES])
    registry.start_round(RUN, 1, [s.site for s in SITES])
    registry.finish_round(RUN, RoundRecord(round=1, state="completed", started=time.time(),
                                           ended=time.time(), aggregate_seconds=12.25,
                                           num_samples=1_234_567, loss=3.354575, sites=SITES))
    registry.set_state(RUN, "completed", "1 rounds completed on a quorum of one site")
    return RUN


def _xffl(*argv: str, terminal: bool) -> list[str]:
    env = {**os.environ, "COLUMNS": "80", "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    if terminal:
        env["FORCE_COLOR"] = "1"  # rich draws for a terminal, 80 columns wide
    else:
        env.pop("FORCE_COLOR", None)
    done = subprocess.run([XFFL, *argv], capture_output=True, text=True, timeout=120, env=env,
                          check=True)
    return done.stdout.splitlines()


@pytest.mark.parametrize("argv", [("status", "last", "--no-live"), ("runs",), ("profiles", "list")])
def test_a_pipe_gets_one_plain_record_per_line(finished_run: str, argv: tuple[str, ...]) -> None:
    lines = _xffl(*argv, terminal=False)
    text = "\n".join(lines)
    assert "…" not in text and "\x1b" not in text and "━" not in text and "─" not in text
    rows = [line.split("\t") for line in lines if "\t" in line]
    assert rows and len({len(r) for r in rows}) == 1  # a header and rows of the same width
    if argv[0] == "status":
        assert rows[0][:3] == ["round", "site", "state"]
        by_site = {r[1]: r for r in rows[1:]}
        assert by_site["leonardo-boost"][:6] == ["1", "leonardo-boost", "completed", "1234567",
                                                 "987654321", "3.3546"]
        assert by_site["karolina"][:3] == ["1", "karolina", "failed after 2 attempts (round "
                                           "timeout after 7200 s: SLURM job 4242 scancelled)"]
        assert by_site["global"][:6] == ["1", "global", "completed", "1234567", "-", "3.3546"]
        # the hardware: device, GPUs, tokens/s per GPU, TFLOP/s, MFU, peak GiB, save s
        assert rows[0][14:] == ["device", "GPUs", "tok/s per GPU", "TFLOP/s", "MFU",
                                "peak GiB", "save s"]
        assert by_site["leonardo-boost"][14:] == ["NVIDIA H100 80GB HBM3", "4", "3413",
                                                  "405.5", "41.0%", "61.23", "12.5"]
        assert by_site["karolina"][14:] == by_site["global"][14:] == ["-"] * 7
    if argv[0] == "runs":
        assert rows[1][:3] == [RUN, "completed", "1/1"]
    if argv[0] == "sites":
        names = [r[0] for r in rows[1:]]
        assert "local" in names and all(r[-1].endswith(".yaml") for r in rows[1:])


@pytest.mark.parametrize("argv", [("status", "last", "--no-live"), ("runs",)])
def test_a_terminal_of_80_columns_cuts_nothing(finished_run: str, argv: tuple[str, ...]) -> None:
    import re

    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in _xffl(*argv, terminal=True)]
    text = "\n".join(lines)
    assert "…" not in text  # boxes that fit, else plain rows (the terminal wraps them)
    for whole in (RUN, "completed", "1234567", "3.3546") if argv[0] == "status" \
            else (RUN, "completed"):
        assert whole in text, (whole, text)


def _on_a_pty(*argv: str) -> list[str]:
    """What ``xffl ARGV`` shows on an 80-column pseudo-terminal, escapes removed."""
    import pty
    import re

    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": "80", "LINES": "24", "TERM": "xterm"}
    for name in ("FORCE_COLOR", "NO_COLOR"):
        env.pop(name, None)
    try:
        proc = subprocess.Popen([XFFL, *argv], stdin=follower, stdout=follower, stderr=follower,
                                env=env, close_fds=True)
        os.close(follower)
        chunks = []
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, b"".join(chunks)
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=60) == 0, b"".join(chunks)
    finally:
        os.close(leader)
    text = b"".join(chunks).decode()
    return [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line) for line in text.split("\r\n")]


@pytest.mark.parametrize("argv", [("status", "last", "--no-live"), ("runs",)])
def test_an_80_column_terminal_gets_the_compact_table(finished_run: str,
                                                      argv: tuple[str, ...]) -> None:
    """COLUMNS=80 on a real pty: a boxed table of the main columns, no line over 80, nothing
    cut (issue 31 item 10; HEAD printed tab-separated rows wider than the terminal)."""
    lines = _on_a_pty(*argv)
    text = "\n".join(lines)
    assert max(len(line) for line in lines) <= 80, text
    assert "\t" not in text and "…" not in text and "─" in text  # a table, not plain rows
    for whole in (RUN, "completed") + (("1234567", "3.3546", "5123.4") if argv[0] == "status"
                                       else ("1/1",)):
        assert whole in text, (whole, text)


def test_tsv_is_the_rows_alone(finished_run: str) -> None:
    """`xffl status --tsv | cut -f2,6` (and `xffl runs --tsv`): one record per line, no title,
    header or footer line for cut to pass through."""
    status = _xffl("status", "--no-live", "--tsv", terminal=False)
    assert sorted(line.split("\t")[1] for line in status) == ["global", "karolina",
                                                              "leonardo-boost"]
    assert all(len(line.split("\t")) == 21 for line in status)
    assert [line.split("\t")[:3] for line in _xffl("runs", "--tsv", terminal=False)] == [
        [RUN, "completed", "1/1"]]
