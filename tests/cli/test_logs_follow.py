"""`xffl logs -f`: a site's step lines while it still trains, from a real local run."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from xffl.cli.app import app
from xffl.jobs.registry.store import Registry

runner = CliRunner()
XFFL = str(Path(sys.executable).parent / "xffl")


def _lines(proc: subprocess.Popen[str], until: float) -> list[str]:
    """The lines ``proc`` prints before its end or ``until`` (a monotonic time)."""
    assert proc.stdout is not None
    out: list[str] = []
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < until:
            if not sel.select(timeout=max(0.0, until - time.monotonic())):
                break
            line = proc.stdout.readline()
            if not line:
                break
            out.append(line.rstrip("\n"))
            if sum(x.startswith("step ") for x in out) >= 3:
                break
    return out


@pytest.mark.slow
def test_logs_follow_shows_step_lines_while_the_site_trains(
        tmp_path: Path, xffl_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A site with far more steps than it gets to: `xffl logs --site alpha -f` prints its step
    lines (step, loss, tokens/s, ETA) while the round is still running and alpha has sent
    nothing back; after `xffl cancel` it ends by itself (issue 31 item 9; HEAD printed
    nothing until the round's end and had no -f)."""
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["evaluation"] = {"final": False}  # test_final_evaluation
    spec.update(name="follow", rounds=1)
    spec["training"].update(steps=100000, batch_size=2, seq_len=32)
    # alpha alone: a second site would only train at full speed, unread, until the cancel
    spec["sites"] = spec["sites"][:1]
    for site in spec["sites"]:
        site.update(ranks=1)
        site["data"]["synthetic_sequences"] = 64
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("XFFL_STEP_LOG_SECONDS", "0.2")  # the trainer's cadence, inherited
    submitted = runner.invoke(app, ["submit", str(job), "--json"])
    assert submitted.exit_code == 0, submitted.output
    run_id = json.loads(submitted.stdout)["run_id"]
    follow = subprocess.Popen([XFFL, "logs", run_id, "--site", "alpha", "-f", "--timeout",
                               "240"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=os.environ)
    try:
        lines = _lines(follow, time.monotonic() + 180)
        steps = [line.split() for line in lines if line.startswith("step ")]
        assert len(steps) == 3, lines
        run = Registry().get_run(run_id)
        assert run.state == "running" and run.rounds_done == 0  # alpha is still training
        assert not (Path(run.run_dir) / "rounds" / "1" / "updates").exists()
        assert lines[0] == "== alpha round 1 attempt 1 =="
        for words in steps:  # step N/100000 loss L tokens/s T eta H:MM:SS tokens/s/gpu R mfu -
            assert words[0] == "step" and words[1].endswith("/100000")
            assert words[2] == "loss" and float(words[3]) > 0
            assert words[4] == "tokens/s" and float(words[5]) > 0 and words[6] == "eta"
            assert words[8] == "tokens/s/gpu" and float(words[9]) > 0
            assert words[10:] == ["mfu", "-"]  # a CPU: no peak declared, no MFU
        done = [int(w[1].split("/")[0]) for w in steps]
        assert done == sorted(done) and done[0] == 1
    finally:
        cancelled = runner.invoke(app, ["cancel", run_id])
        try:
            _, err = follow.communicate(timeout=120)
        finally:
            follow.kill()
    assert cancelled.exit_code == 0, cancelled.output
    # the run ended: so did following it, exit 1 as `xffl watch` for a cancelled run
    assert follow.returncode == 1, err
