"""The transfer benchmark, small: every method moves the same bytes through the stack's sshd
(directly and through the delaying proxy), and its last lines are the script-readable ratios."""

from __future__ import annotations

import json
import re
import shutil
from typing import Any

import pytest

from tests.bench.scripts import load_bench


@pytest.mark.slow
def test_a_small_update_both_ways(slurm_stack: Any,  # type: ignore[no-untyped-def]
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Every method once per direction, each at one round trip beside scp (each copy is a
    process of its own, importing xffl: what the test costs): the baselines and xffl's fixed
    stream counts with the sshd port itself (0 ms), xffl's default (streams from the
    measured round trip) through the delaying proxy (10 ms), where it takes all its
    streams."""
    bench = load_bench("transfer")
    names = ("scp", "rsync", "asyncssh", "xffl 1", "xffl 2")
    assert bench.main(["--stack-dir", slurm_stack.dir, "--size-mib", "2", "--rtt", "0",
                       "--streams", "1", "2", "--methods", *names, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    methods = {(r["direction"], r["rtt_ms"], r["method"]) for r in rows}
    wanted = [m for m in (*names, "cp") if m != "rsync" or shutil.which("rsync")]
    # the bench leaves rsync out where it is not installed
    assert methods == {(d, 0, m) for d in ("back", "out") for m in wanted}, methods
    assert len({r["bytes"] for r in rows}) == 1
    lines = bench.summary(rows)
    ratio = re.compile(r"^copy-(back|out) rtt=0ms ([12]) streams?: \d+\.\d\dx scp, "
                       r"CPU \d+\.\d\dx scp's$")
    assert sum(bool(ratio.match(line)) for line in lines) == 4, lines
    for direction in ("back", "out"):
        assert any(re.match(rf"^copy-{direction} rtt=0ms asyncssh 1 channel: \d+\.\d\dx scp",
                            line) for line in lines), lines
        for method in wanted:  # the table: one line per method
            assert any(line.startswith(f"copy-{direction:<4} rtt= 0ms {method:<7} ")
                       for line in lines), (method, lines)
    # the default through the proxy, as main prints it: at most 4 streams, as many as the
    # measured round trip needs (10 ms: all)
    assert bench.main(["--stack-dir", slurm_stack.dir, "--size-mib", "2", "--rtt", "10",
                       "--no-cp", "--methods", "scp", "xffl"]) == 0
    out = capsys.readouterr().out
    default = re.compile(r"^copy-(back|out) rtt=(10)ms default \(([1-4]) of 4 streams\): "
                         r"\d+\.\d\dx scp, CPU \d+\.\d\dx scp's$")
    used = {(m[1], m[2]): int(m[3]) for m in map(default.match, out.splitlines()) if m}
    assert used == {("back", "10"): 4, ("out", "10"): 4}, out
    assert not re.search(r" cp ", out), out
