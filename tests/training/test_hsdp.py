"""HSDP (training.data_parallel: hsdp) on gloo: a 2 x 2 (replicate, shard) mesh == FSDP2 over 4,
and with tensor parallelism a 2 x 2 x 2 (replicate, shard, tp) mesh == FSDP2 over 4 x tp 2."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.conftest import REPO
from tests.workflows.warm_ranks import rank_python, warm_env
from xffl.aggregator.exchange import Manifest, verify_checkpoint
from xffl.aggregator.shards import MODEL_FILE
from xffl.core.errors import InvalidInput
from xffl.training.arch import build_config
from xffl.training.config import ModelSpec, TrainingSpec, TrainJob
from xffl.training.launch import launch
from xffl.training.memory_model import model_parts, site_layout, state_terms
from xffl.training.parallelize import data_parallel_mode, hsdp_mesh

NPROC = 4
NPROC_TP = 8
TP_SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()  # noqa: SIM118


def _launch(cmd: list[str]) -> None:
    """Run one forked launch; a launch that hangs fails in 5 minutes (such a launch takes
    ~20-30 s at load 2-4) with what its ranks printed, not at pytest's 10-minute timeout."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False,
                              cwd=REPO)
    except subprocess.TimeoutExpired as exc:
        printed = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) \
            else str(exc.stderr or "")
        pytest.fail(f"the launch did not end in 300 s; its stderr ended with:\n{printed[-3000:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 4-rank launch (the forked launcher xffl runs CPU ranks with): FSDP2(4), HSDP 2x2."""
    out = tmp_path_factory.mktemp("hsdp")
    cmd = [str(rank_python()), "-m", "xffl.training.forked", "--nproc-per-node", str(NPROC),
           "-m", "tests.training.hsdp_worker", str(out), "fsdp", "hsdp:2"]
    _launch(cmd)
    return out


@pytest.fixture(scope="module")
def layouts_tp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 8-rank launch: FSDP2(4) x TP 2 built from the seed, then HSDP (2 x 2) x TP 2 loaded
    from a round-0 checkpoint of the same seed as a site loads it (and its update gathered as
    a site saves it, which the worker checks against the parameters)."""
    out = tmp_path_factory.mktemp("hsdp-tp")
    cmd = [str(rank_python()), "-m", "xffl.training.forked", "--nproc-per-node", str(NPROC_TP),
           "-m", "tests.training.hsdp_worker", str(out), "fsdp/2", "hsdp:2/2+sharded"]
    _launch(cmd)
    return out


@pytest.mark.slow
def test_hsdp_2x2_is_fsdp2_over_4(layouts: Path) -> None:
    """HSDP's mesh and shards, and its losses and weights after 3 steps == FSDP2(4)'s.

    Bounds (u = 2^-24, fp32; STEPS = 3, lr = 0.1 constant, AdamW eps = 1, no clipping).
    Both layouts all-gather the same full weights (a gather copies bits) and every rank
    runs the same rows through the same kernels, so step 1's forward, its losses and each
    rank's local gradient g_k are bitwise equal. Only the gradient mean differs: FSDP2(4)
    reduce-scatters the 4 g_k in one order, HSDP reduce-scatters pairs in each shard group
    and all-reduces the two results across the replicas, another order; the divisions (by
    4, or 2 and 2) are by powers of two, exact. A sum of 4 terms in any order is within
    3u sum|g_k| of the exact one, so the means differ by <= 2 * 3u * G = 6.8e-8, with G =
    max|g_k| <= 0.19 (this model and data, steps 1-3, measured). AdamW's step at eps = 1,
    lr m_hat / (sqrt(v_hat) + 1), moves by <= 2 lr per unit change of a gradient it
    averages (m_hat is a convex combination of them, and the sqrt(v_hat) term adds at most
    as much): 2 * 0.1 * 6.8e-8 = 1.4e-8 a step; w - step, rounded to fp32, may then land on
    the neighbouring float, 1 ulp <= 2^-23 = 1.19e-7 (|w| <= 1, the norms' weights). Over 3
    steps: 3 * (1.19e-7 + 1.4e-8) = 4.0e-7; atol 5e-7, whose 1e-7 of margin takes the
    second-order term (steps 2-3's gradients at weights 4e-7 apart). Losses: step 1's
    are equal; later ones are the same rows through weights <= 5e-7 apart, so they move by
    <= |grad L_rank|_1 * 5e-7 + 2 ulp(L) (fp32 rounding of L < 8: 2 * 4.8e-7), with
    |grad L_rank|_1 <= 99 (a rank's 2 sequences, measured): 5.1e-5: atol 6e-5.

    The bugs these catch (made once on purpose): replicating without averaging (FSDP2 on
    the shard dimension only, the two replicas never reduce together) moves the weights by
    9.5e-3 and the losses by 1.9e-3 to 5.0e-3 per rank; sharding over all 4 ranks with no
    replication holds 1/4 of the parameters per rank, not 1/2, on a (4,) mesh.
    """
    for rank in range(NPROC):
        ref, ref_meta = _load(layouts / "fsdp" / f"rank{rank}.safetensors")
        got, meta = _load(layouts / "hsdp-2" / f"rank{rank}.safetensors")
        assert (ref_meta["dims"], ref_meta["shape"]) == ("dp,tp", "4,1")
        # the 2-D mesh: 2 replicas of shard groups of 2 consecutive ranks
        assert (meta["dims"], meta["shape"]) == ("replicate,shard", "2,2"), meta
        assert meta["placements"] == "(Replicate(), Shard(dim=0))", meta
        assert (meta["dp_rank"], meta["dp_size"]) == (str(rank), "4")  # rows as under FSDP2
        total = local = 0
        for name in (k.removeprefix("shape.") for k in got if k.startswith("shape.")):
            shape, shard = got[f"shape.{name}"].tolist(), got[f"local.{name}"]
            assert shape[0] % 2 == 0, name  # tiny-test: every dim 0 splits evenly
            assert list(shard.shape) == [shape[0] // 2, *shape[1:]], name
            total += int(torch.tensor(shape).prod())
            local += shard.numel()
        assert local * 2 == total, (local, total)  # each rank holds half the parameters
        assert torch.equal(got["losses"][0], ref["losses"][0])  # step 1: bitwise (docstring)
        assert (got["losses"] - ref["losses"]).abs().max() <= 6e-5
        weights = [k for k in ref if k.startswith("weight.")]
        assert weights and sorted(weights) == sorted(k for k in got if k.startswith("weight."))
        worst = max(float((got[k] - ref[k]).abs().max()) for k in weights)
        assert worst <= 5e-7, worst


@pytest.mark.slow
def test_hsdp_with_tensor_parallel_is_a_3d_mesh(layouts_tp: Path) -> None:
    """HSDP 2 x 2 with tensor_parallel 2 on 8 ranks, loaded from a checkpoint as a site loads
    it: the 3-D (replicate, shard, tp) mesh, tp innermost, the checkpoint's tensors put
    together from its slices bit for bit, and its losses and weights after 3 steps == FSDP2
    over 4 dp ranks x tp 2 built from the same seed.

    Bounds: the derivation of :func:`test_hsdp_2x2_is_fsdp2_over_4` holds term by term. Both
    layouts split every layer over the same tp pairs (ranks 2d, 2d + 1) and all-gather the
    same full tp-local shards, so step 1's forward, its tp all-reduces and every dp rank's
    local gradient g_k are bitwise equal; only the mean over the 4 dp ranks is summed in
    another order (one reduce-scatter of 4, or pairs then an all-reduce of 2): <= 6.8e-8,
    the same model, data and steps (max|g_k| <= 0.19). Weights: atol 5e-7; losses 6e-5.

    The bugs this catches (made once on purpose): the mesh laid out (tp, replicate, shard),
    tp outermost, puts ranks r and r + 4 in one tensor-parallel group while the data follow
    rank // tp, so a tp pair splits a layer over two different batches: the losses then
    differ from step 1 on, by 3.3e-3 to 1.1e-2 per rank, and the weights by 9.5e-3 (besides
    the mesh's names and groups, which the first asserts check); a load that puts a slice's
    rows in the wrong order (each rank's shard of every tensor reversed along dim 0)
    differs from the checkpoint by up to 0.12 and moves step 1's loss (5.5409 to 5.5423).
    """
    seeded, _ = _load(layouts_tp / "hsdp-2-2+sharded" / "global0" / MODEL_FILE)  # what it loaded
    for rank in range(NPROC_TP):
        ref, ref_meta = _load(layouts_tp / "fsdp-2" / f"rank{rank}.safetensors")
        got, meta = _load(layouts_tp / "hsdp-2-2+sharded" / f"rank{rank}.safetensors")
        assert (ref_meta["dims"], ref_meta["shape"]) == ("dp,tp", "4,2")
        assert (meta["dims"], meta["shape"]) == ("replicate,shard,tp", "2,2,2"), meta
        # tp innermost: a tp group is 2 consecutive ranks, a shard group (its 2 dp ranks x
        # tp 2) the 4 consecutive ranks of one node of 4 GPUs; the replicas 4 ranks apart
        t, base = rank % 2, rank - rank % 2
        assert meta["group.tp"] == f"{base},{base + 1}", meta
        assert meta["group.shard"] == f"{rank // 4 * 4 + t},{rank // 4 * 4 + 2 + t}", meta
        assert meta["group.replicate"] == f"{rank % 4},{rank % 4 + 4}", meta
        assert (meta["dp_rank"], meta["dp_size"], meta["tp_size"]) == (str(rank // 2), "4",
                                                                        "2")
        for name in (k.removeprefix("shape.") for k in got if k.startswith("shape.")):
            total = int(torch.tensor(got[f"shape.{name}"].tolist()).prod())
            local, placement = got[f"local.{name}"].numel(), meta[f"placement.{name}"]
            assert placement.startswith("(Replicate(), "), (name, placement)
            # a tp-split weight: 1/(shard x tp) of it; the rest (norms, embedding, head,
            # replicated over tp): 1/shard
            split = 2 * 2 if name.split(".")[-2] in TP_SPLIT else 2
            assert local * split == total, (name, local, total, placement)
        # the site's own load: the slices put together are the checkpoint's tensors (round 0
        # of the seed the FSDP2 reference was built from), bit for bit
        # (a copy of fp32 values; with the placements checked above, every slice in place)
        loaded = {k.removeprefix("loaded."): v for k, v in got.items() if k.startswith("loaded.")}
        assert sorted(loaded) == sorted(seeded)
        off = max(float((loaded[k] - seeded[k]).abs().max()) for k in seeded)
        assert all(torch.equal(loaded[k], seeded[k]) for k in seeded), (rank, off)
        assert torch.equal(got["losses"][0], ref["losses"][0])  # step 1: bitwise
        assert (got["losses"] - ref["losses"]).abs().max() <= 6e-5
        weights = [k for k in ref if k.startswith("weight.")]
        assert weights and sorted(weights) == sorted(k for k in got if k.startswith("weight."))
        worst = max(float((got[k] - ref[k]).abs().max()) for k in weights)
        assert worst <= 5e-7, worst


def test_hsdp_needs_a_shard_group() -> None:
    """The spec's own checks, and the runtime's, of what HSDP combines with."""
    spec = TrainingSpec(data_parallel="hsdp", shard_group=2)
    assert spec.shard_group == 2
    with pytest.raises(ValueError, match="data_parallel hsdp needs shard_group"):
        TrainingSpec(data_parallel="hsdp")
    with pytest.raises(ValueError, match="shard_group applies to data_parallel: hsdp only"):
        TrainingSpec(data_parallel="fsdp", shard_group=2)
    assert TrainingSpec(data_parallel="hsdp", shard_group=2, tensor_parallel=2).shard_group == 2
    assert data_parallel_mode("hsdp", 1) == "fsdp"  # FSDP2's wrapper, on a 2-D mesh
    assert data_parallel_mode("hsdp", 2) == "fsdp"  # and on the 3-D one with tp
    with pytest.raises(InvalidInput, match="shard_group 4 times tensor_parallel 2 must divide"):
        hsdp_mesh(torch.device("cpu"), 12, 4, 2)  # checked before any group is made


def test_the_memory_model_shards_hsdp_over_a_group() -> None:
    """xffl validate's estimate: HSDP 2 x 2 keeps the sharded states of FSDP2 over 2 ranks
    (its shard group), not over the 4 ranks of the site."""
    parts = model_parts(build_config(ModelSpec(preset="llama3.1-8b")))
    hsdp = TrainingSpec(data_parallel="hsdp", shard_group=2)
    layout = site_layout(hsdp, 4, parts)
    assert (layout.mode, layout.dp, layout.shard) == ("fsdp", 4, 2)
    by_group = state_terms(parts, layout)
    assert by_group == state_terms(parts, site_layout(TrainingSpec(data_parallel="fsdp"), 2,
                                                      parts))
    assert by_group != state_terms(parts, site_layout(TrainingSpec(data_parallel="fsdp"), 4,
                                                      parts))
    # with tensor parallelism: HSDP 2 x 2 x tp 2 on 8 ranks keeps FSDP2(2) x tp 2's states
    hsdp_tp = site_layout(hsdp.model_copy(update={"tensor_parallel": 2}), 8, parts)
    assert (hsdp_tp.dp, hsdp_tp.tp, hsdp_tp.shard) == (4, 2, 2)
    fsdp_tp = TrainingSpec(data_parallel="fsdp", tensor_parallel=2)
    assert state_terms(parts, hsdp_tp) == state_terms(parts, site_layout(fsdp_tp, 4, parts))


@pytest.mark.slow
def test_an_hsdp_round_through_the_launcher(tmp_path: Path, global0: tuple[Path, Manifest],
                                            make_job: Callable[..., TrainJob]) -> None:
    """The site trainer end to end at 4 ranks under HSDP 2 x 2: the global loaded into the
    2-D mesh's slices, 2 steps, the update gathered from (Replicate, Shard) parameters and
    written by rank 0; it verifies, counts 4 data-parallel ranks and moved every tensor's
    checkpoint away from nothing (the same names and shapes as the global)."""
    job = make_job(tmp_path / "data", steps=2)
    job = job.model_copy(update={"training": job.training.model_copy(
        update={"data_parallel": "hsdp", "shard_group": 2})})
    (tmp_path / "job.json").write_text(job.model_dump_json())
    out = tmp_path / "update"
    args = ["--job", str(tmp_path / "job.json"), "--round", "1", "--model", str(global0[0]),
            "--out", str(out)]
    assert launch(NPROC, "torchrun", args, out, env=warm_env()) == 0
    manifest = verify_checkpoint(out)
    assert manifest.extra["dp"] == NPROC
    with safe_open(str(out / MODEL_FILE), "pt") as got, \
            safe_open(str(global0[0] / MODEL_FILE), "pt") as base:
        assert sorted(got.keys()) == sorted(base.keys())
        moved = [k for k in got.keys()  # noqa: SIM118
                 if not torch.equal(got.get_tensor(k), base.get_tensor(k))]
    assert moved, "the update equals the global: nothing trained"
