"""A site cannot speak for another: an update whose manifest names another site is rejected
where it arrives, by the coordinator's own name for the step (the admit step of
``workflows/steps/admit.py``), not later by the aggregator's duplicate-site refusal.

The hostile corpus (tests/security/hostile_site.py, ``_edit(site="honest")``) runs the same
attack through a real round; this test holds the admission check itself to it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.aggregator.conftest import write_checkpoint
from xffl.aggregator.exchange import read_manifest
from xffl.aggregator.engine import run_strategy
from xffl.core.errors import CheckpointError
from xffl.core.layout import RunLayout
from xffl.jobs.registry.states import SiteState
from xffl.workflows.steps.admit import admit

CONFIG = {"hidden_size": 8}


def _global(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "global", {"w": torch.ones(4)}, kind="global",
                            site=None, round=0, config=CONFIG)


def _update(tmp_path: Path, glob: Path, folder: str, site: str | None) -> Path:
    """A well-formed update of round 1 whose manifest says it comes from ``site``."""
    return write_checkpoint(tmp_path / folder, {"w": torch.full((4,), 2.0)}, site=site,
                            round=1, parent=read_manifest(glob).digest(), num_samples=4,
                            config=CONFIG)


@pytest.mark.parametrize("claimed", ["honest", "Alpha", "alpha ", "alpha\u200b", "beta"])
def test_an_update_that_names_another_site_is_rejected_at_admission(tmp_path: Path,
                                                                   claimed: str) -> None:
    """alpha's step receives an update that says it is ``claimed``'s (another site of the
    job, or a name that only looks like alpha's): rejected with the reason, and nothing of
    it goes on to the aggregation; alpha's own update, the same bytes but its name, passes."""
    glob = _global(tmp_path)
    layout = RunLayout(tmp_path / "run")
    forged = _update(tmp_path, glob, "forged", claimed)
    verdict, manifest = admit(layout, "alpha", 1, glob, forged)
    assert (verdict.state, manifest, verdict.site) == (SiteState.REJECTED, None, "alpha")
    assert verdict.reason == (f"the update says it comes from site {claimed!r}, "
                              "not 'alpha'"), verdict.reason
    own = _update(tmp_path, glob, "own", "alpha")
    verdict, manifest = admit(layout, "alpha", 1, glob, own)
    assert verdict.state == SiteState.COMPLETED and manifest is not None, verdict.reason


def test_an_update_that_names_no_site_is_rejected(tmp_path: Path) -> None:
    glob = _global(tmp_path)
    verdict, manifest = admit(RunLayout(tmp_path / "run"), "alpha", 1, glob,
                              _update(tmp_path, glob, "anonymous", None))
    assert (verdict.state, manifest) == (SiteState.REJECTED, None)
    assert verdict.reason == "the manifest names no site"


def test_the_aggregator_refuses_two_updates_of_one_site(tmp_path: Path) -> None:
    """The backstop behind admission: an aggregation handed two updates that name the same
    site refuses to average them (one site never counts twice)."""
    glob = _global(tmp_path)
    ups = [_update(tmp_path, glob, "honest", "honest"), _update(tmp_path, glob, "eve", "honest")]
    with pytest.raises(CheckpointError, match="more than one update from site"):
        run_strategy("fedavg", ups, glob, tmp_path / "out")
    assert not (tmp_path / "out").exists()
