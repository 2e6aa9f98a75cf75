"""The CLI latency benchmark runs every command it times (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cli_latency" / "run.py"


def test_every_timed_command_runs() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "-n", "1", "--json"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    names = [row["command"] for row in result["rows"]]
    assert {"xffl --help", "xffl status last", "xffl runs", "xffl logs last",
            "xffl profiles list", "xffl validate quickstart"} <= set(names)
    assert all(row["median_s"] > 0 for row in result["rows"])
    assert set(result["within_target"]) == {"xffl --help", "xffl status last"}
