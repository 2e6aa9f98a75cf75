"""A facility's words enter a reason, the registry and the terminal at a stated length.

The attack: two hostile sites send updates whose manifests hold 100 KB words (a ``run_id``,
a ``site``, a listed file name, a metric's name that is not a number, a folder entry). HEAD
quoted each whole in the rejection reason, which the admit step records as the site's reason
and as an ``admit`` event, and the failed round's quorum message holds both: the registry
grew by about 0.6 MB a round, and ``xffl status`` wrapped the reasons over thousands of
lines. Here the real admit step (workflows/steps/admit.py) judges them and the real
aggregate step records the rounds in a registered run's registry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from tests.aggregator.conftest import write_checkpoint
from tests.conftest import QUICKSTART
from xffl.aggregator.exchange import read_manifest
from xffl.cli.app import app
from xffl.core.layout import RunLayout, registration
from xffl.core.words import REASON_CHARS, WORD_CHARS, capped, quoted
from xffl.jobs.registry.states import SiteState
from xffl.jobs.registry.store import Registry
from xffl.jobs.spec.schema import JobSpec
from xffl.workflows.steps.admit import _record, admit
from xffl.workflows.steps.aggregate import QuorumNotMet, aggregate_round
from xffl.workflows.supervisor import _failure_message

runner = CliRunner()
WORD = "A" * 100_000  # 100 KB of one site's word
CONFIG = {"hidden_size": 8}


def _hostile(manifest: dict[str, Any], folder: Path, attack: str) -> None:
    """Make a well-formed update's manifest (or folder) carry WORD at ``attack``."""
    if attack == "run_id":
        manifest["run_id"] = WORD
    elif attack == "site":
        manifest["site"] = WORD
    elif attack == "file":
        manifest["files"][WORD] = "0" * 64
    elif attack == "metric":  # not a number: pydantic's error names the key
        manifest["metrics"][WORD] = "x"
    elif attack == "entry":  # an unlisted file in the folder (a name of 255 bytes at most)
        (folder / ("B" * 255)).write_text("")


ROUNDS = ("site", "file", "metric", "entry", "run_id")  # the last round's reasons end the run


def _update(tmp_path: Path, glob: Path, site: str, rnd: int, attack: str) -> Path:
    folder = write_checkpoint(tmp_path / "updates" / f"{site}-{rnd}", {"w": torch.ones(4)},
                              site=site, round=rnd, parent=read_manifest(glob).digest(),
                              run_id=read_manifest(glob).run_id, num_samples=4,
                              config=CONFIG)
    manifest = json.loads((folder / "manifest.json").read_text())
    _hostile(manifest, folder, attack)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_two_hostile_sites_with_100_kb_words(tmp_path: Path, xffl_home: Path) -> None:
    """Five rounds of two sites sending 100 KB words: each is a recorded rejection quoting
    at most WORD_CHARS of the word, the registry stays under 1 MB (HEAD: 1.9 MB) and ``xffl
    status`` and ``xffl runs`` under 100 lines."""
    job = tmp_path / "job.yaml"
    job.write_text(QUICKSTART.read_text())
    submitted = runner.invoke(app, ["submit", str(job), "--no-start", "--json"])
    assert submitted.exit_code == 0, submitted.output
    run_id, run_dir = (json.loads(submitted.stdout)[k] for k in ("run_id", "run_dir"))
    layout = RunLayout(Path(run_dir))
    reg = registration(layout)
    assert reg is not None
    registry = Registry(reg.registry)
    spec = JobSpec.of_run(layout.root)
    glob = write_checkpoint(tmp_path / "global", {"w": torch.zeros(4)}, kind="global",
                            site=None, round=0, run_id=run_id, config=CONFIG)
    sites = registry.get_run(run_id).sites
    for rnd, attack in enumerate(ROUNDS, start=1):
        registry.start_round(run_id, rnd, sites)
        verdicts = []
        for site in sites:
            update = _update(tmp_path, glob, site, rnd, attack)
            verdict, manifest = admit(layout, site, rnd, glob, update)
            assert (verdict.state, manifest) == (SiteState.REJECTED, None), verdict
            assert len(verdict.reason) < 4 * WORD_CHARS + 200, (attack, len(verdict.reason))
            _record(layout, verdict, update)
            verdicts.append(verdict)
        with pytest.raises(QuorumNotMet):  # the round fails for want of updates, recorded
            aggregate_round(layout, rnd, glob, verdicts, {}, spec, (registry, run_id))
    # the supervisor ends the run with the last quorum message, as after a real execution
    registry.set_state(run_id, "failed", _failure_message(
        registry, run_id, 0.0, [], RuntimeError("quorum"), layout))
    rounds = registry.rounds(run_id)
    assert [r.round for r in rounds] == list(range(1, len(ROUNDS) + 1))
    reasons = [s.reason for r in rounds for s in r.sites]
    assert all(s.state == SiteState.REJECTED for r in rounds for s in r.sites)
    assert any(f"{'A' * WORD_CHARS!r}... (100000 characters)" in r for r in reasons), reasons
    assert not any("A" * (WORD_CHARS + 1) in r for r in reasons)
    size = sum(p.stat().st_size for p in reg.registry.parent.glob(reg.registry.name + "*"))
    assert size < 1 << 20, size
    for argv in (["status", run_id, "--no-live"], ["runs"]):
        for terminal in (True, False):  # folded at 80 columns, or one line per row
            lines = _xffl(argv, terminal)
            assert len(lines) < 100, (argv, terminal, len(lines))
            assert "A" * (WORD_CHARS + 1) not in "".join(lines)


def _xffl(argv: list[str], terminal: bool) -> list[str]:
    """What ``xffl ARGV`` prints on an 80-column terminal (rich forced to draw for one), or
    into a pipe."""
    env = {**os.environ, "COLUMNS": "80", "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    env.pop("FORCE_COLOR", None)
    if terminal:
        env["FORCE_COLOR"] = "1"
    done = subprocess.run([str(Path(sys.executable).parent / "xffl"), *argv], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.splitlines()


def test_quoted_and_capped() -> None:
    assert quoted("alpha") == "'alpha'"
    assert quoted("a" * 65) == f"{'a' * 64!r}... (65 characters)"
    assert quoted("x\ny") == "'x\\ny'"  # repr: a newline cannot forge a line
    assert capped("short") == "short"
    long = capped("b" * 5000)
    assert len(long) == REASON_CHARS and long.endswith("... (5000 characters)")
