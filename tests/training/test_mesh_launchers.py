"""(dp, tp) meshes through the real entry point, under torchrun and under srun on a test cluster.

The same seed and data must give the same update whichever launcher started the ranks, and
meshes that differ only in tensor parallelism must agree (tp splits the math of one
replica; dp changes the global batch, so dp=1 and dp=2 are compared only among themselves).

Every launcher's rank processes are the real ones (srun's tasks, torchrun's forks), but their
Python is tests/workflows/warm_ranks.py's client (``XFFL_RANK_PYTHON``, as a container's line
would be): the rank's module runs in a fork of the shared server that imported torch and the
trainer once, instead of ~3.3 CPU-s of imports per rank.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.workflows.warm_ranks import rank_python
from xffl.aggregator.exchange import Manifest, verify_checkpoint
from xffl.training.config import DataSpec, ModelSpec, TrainingSpec, TrainJob
from xffl.training.data import ensure_synthetic
from xffl.training.launch import RANK_PYTHON_ENV, launch

# dp1-tp2 against the unsplit model: tests/training/test_parallelize.py (the same mesh code).
# torchrun starts the full mesh (its 4 ranks forked from one process) and the one-rank dp1
# mesh, srun the dp2 mesh without tensor parallelism (2 tasks: 2 ranks, not 4): the tp mesh
# under torchrun must match the dp2 mesh under srun (neither the launcher nor the
# tensor-parallel split changes the math of a replica)
MESHES = {"dp1-tp1": (1, 1), "dp2-tp1": (2, 1), "dp2-tp2": (4, 2)}
TORCHRUN_MESHES = ("dp1-tp1", "dp2-tp2")
SRUN_MESH = "dp2-tp1"

# Tolerances of two runs of the same 3 AdamW steps (lr 0.1, eps 1, grad_clip 1) whose fp32
# sums are ordered differently: tp splits the row-parallel projections' sums, and another
# launcher may run another number of threads (u = 2^-24). A gradient element sums the
# N <= 64 tokens' terms (S = sum|term| / N <= 0.57 here) and the dot products along its
# forward and backward path (C ~ 1200 terms; first order, layer gains ~ 1): the runs'
# gradients differ by dg <= 2 (N + C) u S <= 8.4e-5. The norm (1.5-2.3) exceeds
# grad_clip, so the clip factor c = 1/|g| (<= 0.65) differs too, by eps_c <= 8.5e-4
# relative (squares of <= 8192 elements: 8192 u / 2 per run, plus |dg|_2 / |g|). With
# eps = 1 (>> |g|; at eps = 1e-6 a gradient near 0 whose sign rounding flips moves its
# weight by 2 lr) a step moves by <= 2 lr / eps = 0.2 per unit of gradient change, so a
# step differs by <= 0.2 (c dg + eps_c max|c g|) + 2^-23 (|w| <= 1 rounded; max|c g|
# <= 0.18) and 3 steps by <= 9.2e-5: WEIGHT_ATOL 2e-4. Losses (per-token <= 5.8,
# logits' sums S_z <= 0.75): logits differ by <= 2 * 600 u S_z (600: the forward path),
# cross-entropy is 2-Lipschitz in them, the means of N tokens by <= 2 (N - 1) u * 5.8,
# and the weight gap (2-norm <= 0.2 (c |dg|_2 + eps_c * 1) per step) moves a loss by
# <= |grad| (<= 2.3) times it: <= 1.1e-3 at step 3: LOSS_ATOL 3e-3. Real errors are far
# larger: dp2 instead of dp1 (another global batch) moves the losses by up to 8e-2 and
# the weights by 9e-3, and a missing tp or dp reduction changes the gradients by ~|g|
# (the weights by ~1e-2).
WEIGHT_ATOL, LOSS_ATOL = 2e-4, 3e-3


def _job(data: Path, tp: int, **training: object) -> TrainJob:
    fields: dict[str, object] = {"steps": 3, "batch_size": 2, "seq_len": 16, "lr": 0.1,
                                 "adam_eps": 1.0, "seed": 3, "tensor_parallel": tp}
    spec = TrainingSpec.model_validate({**fields, **training})
    return TrainJob(run_id="run-test", site="site-a", model=ModelSpec(preset="tiny-test"),
                    training=spec, data=DataSpec(path=str(data)))


def _train(tmp: Path, name: str, launcher: str, ranks: int, job: TrainJob,
           model: Path) -> tuple[Manifest, dict[str, torch.Tensor]]:
    job_file = tmp / f"{name}-{launcher}.json"
    job_file.write_text(job.model_dump_json())
    out = tmp / f"{name}-{launcher}"
    args = ["--job", str(job_file), "--round", "1", "--model", str(model), "--out", str(out)]
    assert launch(ranks, launcher, args, out) == 0  # type: ignore[arg-type]
    return verify_checkpoint(out), load_file(out / "model.safetensors")


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=WEIGHT_ATOL, rtol=0,
                                   msg=f"{what}: {name}")


@pytest.mark.slow
def test_meshes_under_torchrun_and_srun(tmp_path: Path, global0: tuple[Path, Manifest],
                                        slurm_stack,  # type: ignore[no-untyped-def]
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    data = ensure_synthetic(tmp_path / "data", "alpha", 64, 16)
    model = global0[0]
    monkeypatch.setenv(RANK_PYTHON_ENV, str(rank_python()))  # every launcher's ranks warm
    results: dict[tuple[str, str], tuple[Manifest, dict[str, torch.Tensor]]] = {}
    for name in TORCHRUN_MESHES:
        ranks, tp = MESHES[name]
        results[name, "torchrun"] = _train(tmp_path, name, "torchrun", ranks, _job(data, tp),
                                           model)
    # srun on cluster alpha (2 CPUs for the 2 ranks; --overcommit lets them share one)
    monkeypatch.setenv("SLURM_CONF", slurm_stack.clusters["alpha"].slurm_conf)
    monkeypatch.setenv("SLURM_OVERCOMMIT", "1")
    monkeypatch.setenv("SLURM_TIMELIMIT", "5")
    # srun's ranks on the dp axis: SLURM's task ids become the ranks and their data rows; a
    # rank's place on both axes (dp and tp) is the same code whichever launcher numbered it,
    # run on the full mesh under torchrun
    results[SRUN_MESH, "srun"] = _train(tmp_path, SRUN_MESH, "srun", MESHES[SRUN_MESH][0],
                                        _job(data, MESHES[SRUN_MESH][1]), model)

    for (name, _launcher), (manifest, _) in results.items():
        ranks, tp = MESHES[name]
        assert (manifest.extra["world_size"], manifest.extra["tp"]) == (ranks, tp), name
        assert manifest.extra["dp"] == ranks // tp
        assert manifest.num_tokens == 3 * 2 * 16 * (ranks // tp)
    # neither the launcher nor tensor parallelism changes the math of one replica
    (m1, w1), (m2, w2) = results["dp2-tp2", "torchrun"], results[SRUN_MESH, "srun"]
    assert m1.extra["losses"] == pytest.approx(m2.extra["losses"], abs=LOSS_ATOL)
    _close(w1, w2, f"dp2-tp2 torchrun vs {SRUN_MESH} srun")
    # while more data-parallel ranks do (a bigger global batch): a check that the test can
    # fail, at the tolerances used above (the losses differ by up to 8e-2 >> LOSS_ATOL)
    m0, w0 = results["dp1-tp1", "torchrun"]
    assert m0.extra["losses"] != pytest.approx(m2.extra["losses"], abs=LOSS_ATOL)
    assert not all(torch.allclose(w0[k], w2[k], atol=WEIGHT_ATOL, rtol=0) for k in w0)


@pytest.mark.slow
def test_stops_before_the_slurm_time_limit(tmp_path: Path, global0: tuple[Path, Manifest],
                                           slurm_stack,  # type: ignore[no-untyped-def]
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1-minute SLURM job with a 50 s margin trains ~10 s, then writes its checkpoint.

    Its rank (srun's task) is a fork of the warm rank server (no imports of its own: srun's
    step, a fork and the tiny model's load took 1.0 s (``startup_seconds``) at a load of 8
    on 2 cores), so the 10 s window leaves 10x that start-up: a machine loaded enough to
    start no step in it fails the round, as it should. The window's CPU-s are its cores
    times 10 s: one rank of one thread (a second rank proved nothing more: two ranks under
    one SLURM deadline check it at the same step, and passed here with the ranks' agreement
    to stop, xffl.training.loop._agree_to_stop, removed).
    """
    data = ensure_synthetic(tmp_path / "data", "alpha", 64, 16)
    job = _job(data, 1, steps=10_000_000, time_margin=50)
    monkeypatch.setenv(RANK_PYTHON_ENV, str(rank_python()))
    monkeypatch.setenv("SLURM_CONF", slurm_stack.clusters["alpha"].slurm_conf)
    monkeypatch.setenv("SLURM_TIMELIMIT", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # one core computing for the window, not all
    name = f"xffl-limit-{time.monotonic_ns()}"
    monkeypatch.setenv("SLURM_JOB_NAME", name)
    manifest, _ = _train(tmp_path, "limit", "srun", 1, job, global0[0])
    assert manifest.extra["stopped_early"] is True
    assert 1 <= manifest.extra["steps"] < 10_000_000
    # SLURM's own record: a 1-minute job that ended COMPLETED, not TIMEOUT
    jobcomp = Path(slurm_stack.clusters["alpha"].jobcomp).read_text().splitlines()
    record = dict(f.split("=", 1) for line in jobcomp if f"Name={name} " in line
                  for f in line.split() if "=" in f)
    assert record["JobState"] == "COMPLETED" and record["TimeLimit"] == "1", record
