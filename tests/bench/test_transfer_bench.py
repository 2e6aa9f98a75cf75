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
    bench = load_bench("transfer")
    argv = ["--stack-dir", slurm_stack.dir, "--size-mib", "2", "--rtt", "0", "10",
            "--streams", "1", "2", "--methods", "scp", "xffl", "xffl 1", "xffl 2"]
    assert bench.main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    methods = {(r["direction"], r["rtt_ms"], r["method"]) for r in rows}
    for direction in ("back", "out"):
        for rtt in (0, 10):
            assert {(direction, rtt, m) for m in ("scp", "xffl", "xffl 1", "xffl 2")} <= methods
    assert len({r["bytes"] for r in rows}) == 1
    lines = bench.summary(rows)
    ratio = re.compile(r"^copy-(back|out) rtt=(0|10)ms ([12]) streams?: \d+\.\d\dx scp, "
                       r"CPU \d+\.\d\dx scp's$")
    assert sum(bool(ratio.match(line)) for line in lines) == 8, lines
    # the default: at most 4 streams, as many as the measured round trip needs (10 ms: all)
    default = re.compile(r"^copy-(back|out) rtt=(0|10)ms default \(([1-4]) of 4 streams\): "
                         r"\d+\.\d\dx scp, CPU \d+\.\d\dx scp's$")
    used = {(m[1], m[2]): int(m[3]) for m in map(default.match, lines) if m}
    assert len(used) == 4 and used[("back", "10")] == used[("out", "10")] == 4, lines
    # the other baselines, once (their code paths, not their numbers, are under test here)
    assert bench.main(["--stack-dir", slurm_stack.dir, "--size-mib", "2", "--rtt", "0",
                       "--methods", "scp", "rsync", "asyncssh"]) == 0
    out = capsys.readouterr().out
    for direction in ("back", "out"):
        assert re.search(rf"^copy-{direction} rtt=0ms asyncssh 1 channel: \d+\.\d\dx scp",
                         out, re.M), out
        assert re.search(rf"^copy-{direction:<4} rtt= 0ms cp ", out, re.M), out
        if shutil.which("rsync"):  # the bench leaves rsync out where it is not installed
            assert re.search(rf"^copy-{direction:<4} rtt= 0ms rsync ", out, re.M), out
