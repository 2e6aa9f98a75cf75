"""Two cron ticks (`xffl round`) of one 2-round job, two sites of one rank, serve two tests.

A site whose xffl changes after submit (reinstalled between rounds). Round 1: its xffl is
of another exchange format through and through, so its trainer refuses the coordinator's
global before training. Round 2: its xffl reads this format but writes another (a real
trainer's update whose manifest then says format 99, as a newer xffl's would): the update is
rejected at aggregation. Each time the registry's reason names both formats and both xffl
versions, and the round goes on with the other site (failure.min_sites 1).

The final model's held-out loss, part of the plan (tests/workflows/plan/test_final_steps.py):
the first tick runs round 1 and no final evaluation (the run is not over: it waits for the
next tick, as a cron tick leaves it, tests/jobs/test_schedule.py); in the second,
beta's evaluation of the final global dies at the site (a failpoint SIGKILLs it): the run
completes, alpha's loss is recorded as the final loss, and the run's message names beta.
The ranks of this format's xffl are forked from one warm interpreter
(tests/workflows/warm_ranks.py; the failpoint's SIGKILL is the rank's death all the same).
"""

from __future__ import annotations

import json
import math
import shlex
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from tests.site_profiles.other_xffl import other_xffl_python
from tests.workflows.warm_ranks import rank_python, warm_profile
from xffl.cli.app import app
from xffl.core.layout import RunLayout
from xffl.core.versions import FORMAT_VERSION, xffl_version
from xffl.jobs.registry.store import Registry

runner = CliRunner()

#: a site's Python that trains with the real one (its ranks forked from the warm server,
#: tests/workflows/warm_ranks.py), then writes its update's manifest as an xffl 9.9.9 of
#: exchange format 99 would (the manifest is not among the files it hashes)
NEWER_WRITER = """import json, os, subprocess, sys
from pathlib import Path
argv = sys.argv[1:]
code = subprocess.call([{real!r}, *argv], env={{**os.environ, "XFFL_RANK_PYTHON": {ranks!r}}})
manifest = Path(argv[argv.index("--out") + 1]) / "manifest.json" if "--out" in argv else None
if code == 0 and manifest is not None and manifest.is_file():
    data = json.loads(manifest.read_text())
    data.update(format_version=99, xffl_version="9.9.9")
    manifest.write_text(json.dumps(data))
sys.exit(code)
"""


@dataclass(frozen=True)
class Ticks:
    """The run after its two ticks: where it lives, what `xffl status --json` showed of each
    round's sites right after its tick, what `xffl round --json` printed for tick 1 and
    whether the final loss was on disk after it."""

    home: Path
    run_id: str
    layout: RunLayout
    sites: dict[int, dict[str, dict[str, Any]]]
    tick_1: dict[str, Any]
    final_after_tick_1: bool


def _round(run_id: str, rnd: int) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Run the next round; what `xffl round --json` printed, and the sites' rows of round
    ``rnd`` in `xffl status --json`."""
    done = runner.invoke(app, ["round", run_id, "--json"])
    assert done.exit_code == 0, done.output
    shown = runner.invoke(app, ["status", run_id, "--json"])
    assert shown.exit_code == 0, shown.output
    status = json.loads(shown.stdout)
    row = next(r for r in status["rounds"] if r["round"] == rnd)
    return json.loads(done.stdout), {s["site"]: s for s in row["sites"]}


@pytest.fixture(scope="module")
def ticks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ticks]:
    """Submit the job (--no-start), then its two ticks, alpha's Python changed before each,
    beta's final evaluation made to die in the second (a home of its own). Beta's ranks, and
    alpha's once its Python reads this format (tick 2), are forked from one warm interpreter
    (tests/workflows/warm_ranks.py); tick 1's alpha runs its other xffl's own."""
    where = tmp_path_factory.mktemp("ticks")
    site = where / "alpha-site"
    site.mkdir()
    python = site / "python"  # at submit: this venv's xffl, which the version probe admits
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    profiles = where / "site_profiles"
    profiles.mkdir()
    (profiles / "alpha-python.yaml").write_text(yaml.safe_dump({
        "name": "alpha-python", "connector": {"type": "local"}, "python": str(python),
        "launcher": "none"}))
    warm_profile(profiles)
    spec = yaml.safe_load(QUICKSTART.read_text())  # the final evaluation on, as by default
    spec.update(name="otherformat", rounds=2, model={"preset": "tiny-test"},
                training={"steps": 2, "batch_size": 2, "seq_len": 16},
                failure={"min_sites": 1})
    for entry in spec["sites"]:
        entry.update(ranks=1, profile="warm-local")
        entry["data"].update(synthetic_sequences=32)
    spec["sites"][0]["profile"] = "alpha-python"
    job = where / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XFFL_HOME", str(where / "xffl-home"))
        mp.setenv("XDG_CONFIG_HOME", str(where / "config"))
        mp.chdir(where)  # no xffl.egg-info where the site's Python starts
        submitted = runner.invoke(app, ["submit", str(job), "--no-start", "--trust-entry-point",
                                        "--json"])
        assert submitted.exit_code == 0, submitted.output
        run_id = json.loads(submitted.stdout)["run_id"]
        layout = RunLayout(Path(json.loads(submitted.stdout)["run_dir"]))

        assert other_xffl_python(site) == python  # the site's xffl is now 9.9.9, format 99
        tick_1, first = _round(run_id, 1)
        final_after_tick_1 = layout.final_validation.exists()

        python.write_text(f"#!{sys.executable}\n" + NEWER_WRITER.format(
            real=sys.executable, ranks=str(rank_python())))
        mp.setenv("XFFL_FAILPOINT", "evaluate-models-beta")
        _, second = _round(run_id, 2)
    yield Ticks(where / "xffl-home", run_id, layout, {1: first, 2: second}, tick_1,
                final_after_tick_1)


@pytest.mark.slow
def test_an_update_of_another_format_is_rejected_at_aggregation(
        ticks: Ticks, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XFFL_HOME", str(ticks.home))
    both = (f"format version 2 (written by xffl {xffl_version()}), where this xffl 9.9.9 "
            "reads format version 99")
    sites = ticks.sites[1]
    assert sites["beta"]["state"] == "completed", sites
    assert sites["alpha"]["state"] == "failed", sites["alpha"]
    assert both in str(sites["alpha"]["reason"]), sites["alpha"]["reason"]

    sites = ticks.sites[2]
    assert sites["beta"]["state"] == "completed", sites
    assert sites["alpha"]["state"] == "rejected", sites["alpha"]
    assert (f"format version 99 (written by xffl 9.9.9), where this xffl {xffl_version()} "
            f"reads format version {FORMAT_VERSION}") in str(sites["alpha"]["reason"]), \
        sites["alpha"]["reason"]
    # the admitted update, written by beta's real trainer, names the xffl that wrote it
    beta = json.loads((ticks.layout.root / "rounds" / "2" / "updates" / "beta" /
                       "manifest.json").read_text())
    assert (beta["format_version"], beta["xffl_version"]) == (FORMAT_VERSION, xffl_version())


@pytest.mark.slow
def test_a_site_whose_final_evaluation_fails(ticks: Ticks,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XFFL_HOME", str(ticks.home))
    # one round of two: not over, the run waits for its next tick
    assert (ticks.tick_1["state"], ticks.tick_1["rounds_done"]) == ("waiting", 1), ticks.tick_1
    assert ticks.tick_1["message"].startswith("round 1 of 2 done"), ticks.tick_1
    assert not ticks.final_after_tick_1
    run = Registry().get_run(ticks.run_id)
    assert (run.state, run.rounds_done) == ("completed", 2), run.message
    assert "the final model's held-out loss is" in run.message
    assert "without site beta: the evaluation at the site failed" in run.message
    final = Registry().final_loss(ticks.run_id)
    assert final is not None and final.round == 2 and list(final.sites) == ["alpha"]
    assert final.val_loss == final.sites["alpha"] and math.isfinite(final.val_loss)
    layout = ticks.layout
    assert json.loads(layout.final_validation.read_text()) == asdict(final)
    assert json.loads(layout.final_attempts_file("beta").read_text())["gave_up"] is True
    # the rounds' own records are not the final evaluation's
    assert not layout.attempts_file(2, "beta").exists()
