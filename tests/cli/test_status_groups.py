"""`xffl status` with training.local_groups: the syncs' bytes from the update's manifest to
the registry and the table (columns shown only in a run whose sites report them)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from xffl.aggregator import metrics as metric
from xffl.aggregator.exchange import Manifest
from xffl.aggregator.reported import check_hardware, hardware_of
from xffl.cli.app import app
from xffl.core.errors import CheckpointError
from xffl.jobs.registry.records import RoundRecord, SiteRound
from xffl.jobs.registry.store import Registry

RUN = "groups-20261128-101010-beef"


def _status(sites: list[SiteRound], tmp_path: Path) -> list[list[str]]:
    registry = Registry()
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    registry.create_run(RUN, "groups", tmp_path / "job.yaml", run_dir, 1, [s.site for s in sites])
    registry.start_round(RUN, 1, [s.site for s in sites])
    registry.finish_round(RUN, RoundRecord(round=1, state="completed", started=time.time(),
                                           ended=time.time(), num_samples=8, loss=3.0,
                                           sites=sites))
    out = CliRunner().invoke(app, ["status", RUN, "--no-live"])
    assert out.exit_code == 0, out.output
    return [line.split("\t") for line in out.stdout.splitlines() if "\t" in line]


def test_status_shows_the_groups_bytes(xffl_home: Path, tmp_path: Path) -> None:
    """A site's bytes per step and per round in MB; a site without groups shows -."""
    manifest = Manifest(kind="update", run_id=RUN, round=1, site="alpha", num_samples=8,
                        num_tokens=64, parent="0" * 64, metrics={
                            metric.LOSS: 3.0, metric.GROUP_SYNCS: 3.0,
                            metric.GROUP_SYNC_BYTES: 2048.0,
                            metric.GROUP_BYTES_PER_STEP: 2048.0 / 3,
                            metric.GROUP_BYTES_ROUND: 6144.0})
    check_hardware(manifest)
    seen = hardware_of(manifest)
    assert (seen["group_bytes_per_step"], seen["group_bytes_round"]) == (2048.0 / 3, 6144.0)
    rows = _status([SiteRound(site="alpha", state="completed", num_samples=8,
                              group_bytes_per_step=seen["group_bytes_per_step"],
                              group_bytes_round=seen["group_bytes_round"]),
                    SiteRound(site="beta", state="completed", num_samples=8)], tmp_path)
    assert rows[0][-2:] == ["groups MB/step", "groups MB/round"]
    by_site = {r[1]: r for r in rows[1:]}
    assert by_site["alpha"][-2:] == ["0.000683", "0.00614"]
    assert by_site["beta"][-2:] == ["-", "-"]
    assert len({len(r) for r in rows}) == 1


def test_status_without_groups_has_no_groups_columns(xffl_home: Path, tmp_path: Path) -> None:
    rows = _status([SiteRound(site="alpha", state="completed", num_samples=8)], tmp_path)
    assert rows[0][-1] == "save s"


def test_a_negative_sync_byte_count_is_refused() -> None:
    manifest = Manifest(kind="update", run_id=RUN, round=1, site="alpha", num_samples=8,
                        num_tokens=64, parent="0" * 64,
                        metrics={metric.LOSS: 3.0, metric.GROUP_BYTES_ROUND: -1.0})
    with pytest.raises(CheckpointError, match="never negative"):
        check_hardware(manifest)
