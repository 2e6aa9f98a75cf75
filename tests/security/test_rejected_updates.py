"""A hostile site's rejected updates do not pile up on the coordinator's disk.

Each round the site sends back an update that admission rejects (it names another site),
as large as the copy caps let it be; StreamFlow has copied it into the run's work folders
(``streamflow/work``), where the admit step (its real entry point) finds it. After six such
rounds the run keeps the newest ``KEEP_COUNT`` that fit in ``KEEP_GLOBALS`` globals, nothing
of it is left in the work folders, and every round's reason is still in its verdict (what
``xffl status`` shows). A ``local`` site's own update folder is never moved or removed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from tests.aggregator.conftest import write_checkpoint
from tests.conftest import QUICKSTART
from xffl.core.layout import RunLayout
from xffl.jobs.spec.schema import JobSpec
from xffl.workflows.steps import admit
from xffl.workflows.steps.rejected import KEEP_COUNT, KEEP_GLOBALS, kept_rejected, tree_bytes
from xffl.workflows.steps.verdict import VERDICT_FILE

CONFIG = {"hidden_size": 8, "rope_theta": 10000.0, "tie_word_embeddings": False}


def _run(tmp_path: Path) -> tuple[RunLayout, Path]:
    layout = RunLayout(tmp_path / "run")
    layout.root.mkdir()
    spec = JobSpec.model_validate(yaml.safe_load(QUICKSTART.read_text()))
    layout.job_json.write_text(spec.model_dump_json())
    glob = write_checkpoint(layout.global_dir(0), {"w": torch.ones(4096)}, kind="global",
                            site=None, round=0, config=CONFIG)
    return layout, glob


def _hostile_update(where: Path, padding: int) -> Path:
    """What a hostile site sends in place of an update: a manifest that names another site
    and nothing else it lists, and ``padding`` bytes beside it (rejected)."""
    where.mkdir(parents=True)
    (where / "manifest.json").write_text(json.dumps({"site": "other", "files": {}}))
    (where / "padding.bin").write_bytes(b"\0" * padding)
    return where


def _admit(layout: RunLayout, rnd: int, glob: Path, update: Path, job_dir: Path,
           monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    job_dir.mkdir(parents=True)
    monkeypatch.chdir(job_dir)
    assert admit.main(["--run-dir", str(layout.root), "--site", "hostile", "--round",
                       str(rnd), "--previous", str(glob), "--update", str(update)]) == 0
    verdict: dict[str, object] = json.loads((job_dir / VERDICT_FILE).read_text())
    return verdict


def test_rejected_updates_are_kept_within_a_count_and_a_size(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout, glob = _run(tmp_path)
    budget = KEEP_GLOBALS * tree_bytes(glob)
    for rnd in range(1, 7):
        # rounds 1-5: small (their count is what is capped); round 6's alone is over the bytes
        padding = int(budget) + 1 if rnd == 6 else 1000
        where = _hostile_update(layout.coordinator_workdir / f"copy{rnd}" / "update", padding)
        verdict = _admit(layout, rnd, glob, where, tmp_path / "jobs" / str(rnd), monkeypatch)
        assert verdict["state"] == "rejected" and verdict["reason"]
        assert not where.exists()  # moved out of StreamFlow's work folders
    kept = kept_rejected(layout)
    # the KEEP_COUNT newest that fit: round 6 is over the bytes alone, round 1 over the count
    assert [int(p.parent.parent.name) for p in kept] == [5, 4, 3, 2][:KEEP_COUNT]
    assert sum(tree_bytes(p) for p in kept) <= budget
    assert not any(layout.coordinator_workdir.rglob("padding.bin"))
    assert not layout.rejected_update(1, "hostile").exists()
    assert not layout.rejected_update(6, "hostile").exists()
    # every round's reason is still there for `xffl status`
    for rnd in range(1, 7):
        verdict = json.loads((tmp_path / "jobs" / str(rnd) / VERDICT_FILE).read_text())
        assert verdict["state"] == "rejected"


def test_a_local_sites_own_update_is_left_alone(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    layout, glob = _run(tmp_path)
    own = _hostile_update(tmp_path / "site-workdir" / "update", 10)
    link = layout.coordinator_workdir / "copy" / "update"  # StreamFlow's link to it
    link.parent.mkdir(parents=True)
    os.symlink(own, link)
    for where, job in ((own, "a"), (link, "b")):
        verdict = _admit(layout, 1, glob, where, tmp_path / "jobs" / job, monkeypatch)
        assert verdict["state"] == "rejected"
    assert (own / "padding.bin").exists() and link.is_symlink()
    assert kept_rejected(layout) == []
