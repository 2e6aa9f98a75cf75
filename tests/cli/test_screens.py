"""Screens at 80 columns and in pipes: nothing cut, one record per line (`cli/tables.py`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xffl.jobs.registry.records import RoundRecord, SiteRound
from xffl.jobs.registry.store import Registry

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


def _on_a_pty(*argv: str, columns: int = 80) -> list[str]:
    """What ``xffl ARGV`` shows on a pseudo-terminal ``columns`` wide, escapes removed."""
    import pty
    import re

    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "24", "TERM": "xterm"}
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


def _failed_runs() -> list[str]:
    """Three runs beside the long-named one: two failed ones whose messages are the
    supervisor's own, each ending in its resume hint (one with a site's path in it), and one
    still running; their ids, the long one first."""
    from xffl.jobs.status import orphan_message

    registry = Registry()
    ids = [RUN, "sft-lora-20261127-093512-7c1e", "llama3-8b-two-facilities-20261128-080000-0d0d",
           "quickstart-20261128-101010-aa55"]
    path = "/leonardo_work/EUHPC_A02_045/xffl/sites/beta/prepared/beta/flags.bin"
    messages = {ids[1]: f"round 1: 1 valid update(s), the job needs 2 (failure.min_sites) "
                        f"(beta: attempt 1: xffl.training (rank 0): {path}: meta.json promises "
                        f"4096 flags (one byte a token); prepare the data again.); `xffl resume "
                        f"{ids[1]}` continues from the last completed round",
                ids[2]: orphan_message(ids[2])}
    for run_id in ids[1:]:
        registry.create_run(run_id, run_id.rsplit("-", 3)[0], Path("job.yaml"), Path("/tmp"), 3,
                            ["alpha", "beta"])
        registry.set_state(run_id, "failed" if run_id in messages else "running",
                           messages.get(run_id, "supervisor started"))
    return ids


@pytest.mark.parametrize("columns", [80, 100])
@pytest.mark.parametrize("command", ["runs", "ls"])
def test_runs_prints_every_id_and_resume_hint_whole(finished_run: str, columns: int,
                                                    command: str) -> None:
    """Issue 44 item 7: rich shrank the id column below its values and cropped every line at
    the terminal's width (at 100 columns `broken-20261128-1005` lost `51-`); a word of a
    message is never split either, so the resume hint's id is there to copy."""
    import re

    ids = _failed_runs()
    lines = _on_a_pty(command, columns=columns)
    text = "\n".join(lines)
    assert max(len(line) for line in lines) <= columns, text
    for run_id in ids:
        assert run_id in lines[0] + "".join(f"\n{line}" for line in lines), (run_id, text)
    for run_id in ids[1:3]:  # `xffl resume ID`: a fold may come between the words only
        assert re.search(rf"`xffl resume\s+{re.escape(run_id)}`", text), (run_id, text)
    assert "…" not in text


def test_ls_is_runs_and_hidden_from_the_help(finished_run: str) -> None:
    assert _xffl("ls", terminal=False) == _xffl("runs", terminal=False)
    assert not any(line.split()[:1] == ["ls"] for line in _xffl("--help", terminal=False))


def test_an_80_column_status_names_the_columns_it_hid(finished_run: str) -> None:
    """Issue 44 (Low): the compact table says what it left out and where to see it."""
    text = " ".join(_on_a_pty("status", "last", "--no-live"))
    note = "14 columns hidden to fit 80 columns: tokens, queue s, start s, xfer s, other s, " \
           "agg s, MB in/out, device, GPUs, tok/s per GPU, TFLOP/s, MFU, peak GiB, save s"
    assert note in re.sub(r"\s+", " ", text), text


def test_the_status_title_says_the_rounds_once(finished_run: str) -> None:
    """Issue 44 (Low): `completed — 1/1 rounds — 1 rounds completed ...` said it twice."""
    registry = Registry()
    registry.set_state(RUN, "completed", "1 rounds completed")
    assert _xffl("status", "--no-live", terminal=False)[0] == \
        f"run {RUN}: completed — 1 rounds completed"
    registry.set_state(RUN, "failed", "the workflow ended after round 0, not 1")
    assert _xffl("status", "--no-live", terminal=False)[0] == \
        f"run {RUN}: failed — 1/1 rounds — the workflow ended after round 0, not 1"


def test_an_80_column_profile_list_keeps_each_host_whole(xffl_home: Path) -> None:
    """A host name folds nowhere (it is no path): the scheduler column makes room for it."""
    lines = _on_a_pty("profiles", "list")
    text = "\n".join(lines)
    assert max(len(line) for line in lines) <= 80 and "─" in text, text
    assert "login.leonardo.cineca.it:22" in text, text
    assert "1 column hidden to fit 80 columns: scheduler" in text, text
