"""training.local_groups on the real two-cluster stack: a 1-round job whose site alpha runs 4
ranks in 2 groups under SLURM; the round's update is the mean of the groups' models the
site kept before its last sync, and `xffl status` shows the syncs' bytes. (One round: a
later round's groups start from the global as the first's do, and the kept models' folder
names the round.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors import safe_open
from typer.testing import CliRunner

from tests.workflows.test_failure_slurm import _job, _sites, _status
from xffl.aggregator.shards import MODEL_FILE
from xffl.cli.app import app
from xffl.core.layout import RunLayout
from xffl.jobs.follow import wait_for_run
from xffl.jobs.registry.store import Registry

runner = CliRunner()


def _mean_of_groups(kept: list[Path], update: Path) -> None:
    """Every tensor of ``update`` is bitwise the mean of the 2 kept groups' (fp32: their sum
    is rounded once and halved exactly, as the sync's all-reduce and division do)."""
    with safe_open(str(kept[0]), "pt") as a, safe_open(str(kept[1]), "pt") as b, \
            safe_open(str(update / MODEL_FILE), "pt") as got:
        names = set(got.keys())
        assert names and names <= set(a.keys())
        assert max(float((a.get_tensor(k) - b.get_tensor(k)).abs().max()) for k in names) > 0
        for name in names:
            assert torch.equal(got.get_tensor(name),
                               (a.get_tensor(name) + b.get_tensor(name)) / 2), name


@pytest.mark.slow
def test_a_slurm_site_in_two_groups(tmp_path: Path, slurm_stack: Any,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """alpha: 4 ranks in 2 groups of DDP(2), averaging every 2 of 3 steps (after step 2 and
    at the round's end), keeping the groups' models; beta: 2 ranks in 2 groups of 1."""
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    job = _job(tmp_path, slurm_stack, "groups", rounds=1, steps=3, min_sites=2)
    spec = yaml.safe_load(job.read_text())
    spec["training"]["local_groups"] = {"groups": 2, "every": 2, "keep": True}
    ranks = {"alpha": 4, "beta": 2}
    for site in spec["sites"]:
        site["ranks"] = ranks[site["name"]]
    # the stack's nodes have 2 CPUs: alpha's 4 ranks share them (sbatch --overcommit, which
    # srun inherits through SLURM_OVERCOMMIT)
    profile = tmp_path / "site_profiles" / f"{spec['sites'][0]['profile']}.yaml"
    written = yaml.safe_load(profile.read_text())
    written["slurm"]["extra"] = ["--overcommit"]
    profile.write_text(yaml.safe_dump(written))
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = runner.invoke(app, ["submit", str(job), "--json"])
    assert result.exit_code == 0, result.output
    run_id = str(json.loads(result.stdout)["run_id"])
    final = wait_for_run(Registry(), run_id, 900)
    assert final.state == "completed", final.message
    layout = RunLayout(Path(final.run_dir))
    work = Path(slurm_stack.clusters["alpha"].work_dir)
    status = _status(run_id)
    kept = sorted(work.glob(f"**/kept/{run_id}/groups/r1/group-*.safetensors"))
    assert [p.name for p in kept] == ["group-0.safetensors", "group-1.safetensors"], kept
    _mean_of_groups(kept, layout.kept_update(1, "alpha"))
    alpha = _sites(status, 1)["alpha"]
    # 2 syncs of every (2) steps' bytes each
    assert alpha["group_bytes_round"] == 2 * 2 * alpha["group_bytes_per_step"] > 0, alpha
