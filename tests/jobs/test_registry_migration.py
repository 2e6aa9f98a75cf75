"""The registry of an older xffl is brought up to the current schema when it is opened."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from xffl.jobs.registry.records import RoundRecord, SiteRound
from xffl.jobs.registry.schema import SCHEMA
from xffl.jobs.registry.store import Registry


def test_a_registry_of_an_older_xffl_gets_the_hardware_columns(tmp_path: Path) -> None:
    """A registry written before the hardware numbers (site_rounds without their columns)
    is migrated when opened: its rows read back with None, new rows keep the numbers."""
    path = tmp_path / "registry.db"
    old = SCHEMA.replace(", device TEXT, gpus INTEGER, tokens_per_s_per_gpu REAL, tflops "
                         "REAL,\n    mfu REAL, peak_memory_gib REAL, save_seconds REAL", "")
    assert old != SCHEMA
    with sqlite3.connect(path) as db:
        db.executescript(old)
        db.execute("INSERT INTO site_rounds (run_id, round, site, state) VALUES "
                   "('r', 1, 'old', 'completed')")
        db.execute("INSERT INTO rounds (run_id, round, state) VALUES ('r', 1, 'completed')")
    registry = Registry(path)
    registry.create_run("r", "r", tmp_path / "job.yaml", tmp_path, 2, ["old", "new"])
    registry.finish_round("r", RoundRecord(round=2, state="completed", sites=[SiteRound(
        site="new", state="completed", device="cpu", gpus=0, tokens_per_s_per_gpu=12.5,
        tflops=1e-3, peak_memory_gib=0.5, save_seconds=0.25)]))
    rows = {(r.round, s.site): s for r in registry.rounds("r") for s in r.sites}
    assert rows[(2, "new")].device == "cpu" and rows[(2, "new")].save_seconds == 0.25
    assert rows[(2, "new")].mfu is None and rows[(2, "new")].gpus == 0
    assert (rows[(1, "old")].device, rows[(1, "old")].tflops) == (None, None)
