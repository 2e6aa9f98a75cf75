"""bench/inside_site at a tiny shape: the cost model against a hand computation, the tables."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest

from tests.bench.scripts import load_bench
from tests.workflows.warm_ranks import rank_python


def _bench() -> ModuleType:
    return load_bench("inside_site")


def test_the_step_table_is_the_ring_model_by_hand() -> None:
    """2 nodes x 2 GPUs, 1 B parameters in one FSDP2 unit (layers 0), no latency, intra 100
    GB/s, inter 10 GB/s a node, bf16 gathers (2 B), fp32 reductions (4 B). By hand:

    - FSDP2 over 4 ranks across the nodes: two all-gathers of 2e9 B and a reduce-scatter of
      4e9 B, each moving 3/4 of its bytes at 10 GB/s: 3/4 * 8e9 / 1e10 = 0.6 s;
    - HSDP, shard group = a node: the same inside the node, 1/2 * 8e9 / 1e11 = 0.04 s, plus
      the all-reduce of each GPU's 1/2 of the fp32 gradient (2e9 B) across the 2 replicas,
      2 GPUs of a node sharing 10 GB/s (5 GB/s each): 2 * 1/2 * 2e9 / 5e9 = 0.4 s;
    - groups of a node: 0.04 s per step, and the fp32 weights' average, the same all-reduce
      as HSDP's gradient (0.4 s), every K steps: 0.4 / K.
    Compute: 6 * 1e9 * 1000 tokens / (1e14 * 0.5) = 0.12 s, below each mode's collectives.

    The bug this catches (made once on purpose): the cross-node all-reduce of the whole
    gradient, not of each GPU's 1/shard of it, gives HSDP 0.84 s, not 0.44 s.
    """
    cost = _bench().cost
    model = cost.Model(params=1e9, layers=0)
    machine = cost.Machine(nodes=2, gpus_per_node=2, intra=100 * cost.GB, inter=10 * cost.GB,
                           peak=1e14, alpha_intra=0.0, alpha_inter=0.0)
    work = cost.Work(tokens=1000, mfu=0.5)
    fsdp, hsdp, *groups = cost.step_table(model, machine, work, 1, (1, 8, 64))
    assert [s.mode for s in (fsdp, hsdp)] == ["fsdp", "hsdp (shard 1 node)"]
    # fp64 sums of a few terms of size ~1: within 1e-12 of the hand values
    assert math.isclose(fsdp.compute, 0.12, abs_tol=1e-12)
    assert math.isclose(fsdp.comm, 0.6, abs_tol=1e-12) and fsdp.time == fsdp.comm
    assert math.isclose(hsdp.comm, 0.44, abs_tol=1e-12)
    for k, step in zip((1, 8, 64), groups, strict=True):
        assert step.mode == f"groups of 1 node, K={k}"
        assert math.isclose(step.comm, 0.04, abs_tol=1e-12)
        assert math.isclose(step.average, 0.4 / k, abs_tol=1e-12)
        assert math.isclose(step.time, 0.12 + 0.4 / k, abs_tol=1e-12)
    # 16 B a parameter over the ranks that shard it: 4 under FSDP2, a node's 2 otherwise
    assert math.isclose(fsdp.states_gib, 16e9 / 4 / 2**30)
    assert math.isclose(hsdp.states_gib, 16e9 / 2 / 2**30)
    with pytest.raises(ValueError, match="--group-nodes 3 does not divide --nodes 2"):
        cost.step_table(model, machine, work, 3)


def test_the_step_table_prints_ratios_against_fsdp(capsys: pytest.CaptureFixture[str]) -> None:
    """The command at a tiny shape, as a table and as JSON: FSDP2 first with ratio 1, the
    Leonardo profile's 4 GPUs a node by default."""
    bench = _bench()
    assert bench.main(["--no-loss", "--nodes", "2", "--params", "1e8", "--layers", "2"]) == 0
    table = capsys.readouterr().out
    assert "a cost model, not a measurement" in table and "2 nodes x 4 GPUs" in table
    assert bench.main(["--no-loss", "--nodes", "2", "--params", "1e8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["steps"]
    assert [r["mode"] for r in rows][:2] == ["fsdp", "hsdp (shard 1 node)"]
    assert rows[0]["vs_fsdp"] == 1.0 and len(rows) == 5
    assert all(math.isclose(r["vs_fsdp"], r["step_s"] / rows[0]["step_s"]) for r in rows)
    assert result["inputs"]["gpus_per_node"] == 4 and result["inputs"]["inter"] == 50e9


@pytest.mark.slow
def test_the_loss_table_runs_every_kind_of_mode(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Real site rounds (4 CPU ranks, forked from the warm rank server), 3 steps each, one of
    each kind of mode (FSDP2, HSDP, federated groups: the groups' K=8 and K=64 rows are the
    K=1 row's code with another number): each trains from the same global, and its update's
    held-out loss is below the global's."""
    monkeypatch.setenv("XFFL_RANK_PYTHON", str(rank_python()))
    losses = load_bench("inside_site", "losses.py")
    kinds = ("fsdp", "hsdp 2 x 2", "groups 2, K=1")
    assert set(kinds) <= set(losses.MODES) and {"groups 2, K=8", "groups 2, K=64"} <= set(
        losses.MODES)
    table = losses.loss_table(tmp_path, 3, modes={k: losses.MODES[k] for k in kinds})
    assert list(table) == list(kinds)
    starts = {r["val_loss_start"] for r in table.values()}
    assert len(starts) == 1, starts  # one global, one held-out share
    for name, row in table.items():
        assert row["val_loss"] < row["val_loss_start"], (name, row)
