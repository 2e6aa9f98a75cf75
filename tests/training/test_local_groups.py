"""training.local_groups on gloo: groups of ranks inside a site, averaged every K steps.

One 4-rank launch of ``tests.training.groups_worker`` trains every layout; the references
are plain FSDP2 over the 4 ranks (``every: 1``) and an independent numpy implementation of
local SGD and DiLoCo (:mod:`tests.training.local_sgd_reference`).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from tests.conftest import REPO
from tests.training.groups_worker import OPTIMIZERS, global_batches
from tests.training.local_sgd_reference import local_sgd
from tests.workflows.warm_ranks import rank_python, warm_env
from xffl.aggregator import metrics as metric
from xffl.aggregator.exchange import Manifest, verify_checkpoint
from xffl.aggregator.shards import MODEL_FILE
from xffl.core.errors import InvalidInput
from xffl.training.config import TrainingSpec, TrainJob
from xffl.training.group_spec import LocalGroupsSpec
from xffl.training.launch import launch
from xffl.training.local_groups import check

NPROC, STEPS, EVERY, GROUPS = 4, 7, 3, 2
LAYOUTS = ("fsdp,linear", "fsdp,linear,g2,k1", "hsdp2,linear,g2,k1", "ddp,adamw,g2,k3",
           "fsdp,adamw,g2,k3,moments", "ddp,adamw,g2,k3,nesterov", "ddp,adamw,g2,k3,masked",
           "tp2,linear", "tp2,linear,g2,k1")
Record = tuple[dict[str, torch.Tensor], dict[str, str]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 4-rank launch (the forked launcher xffl runs CPU ranks with) of every layout."""
    out = tmp_path_factory.mktemp("groups")
    cmd = [str(rank_python()), "-m", "xffl.training.forked", "--nproc-per-node", str(NPROC),
           "-m", "tests.training.groups_worker", str(out), str(STEPS), *LAYOUTS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _load(runs: Path, layout: str, rank: int) -> Record:
    path = runs / layout.replace(",", "-") / f"rank{rank}.safetensors"
    with safe_open(str(path), "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()  # noqa: SIM118


def _weights(record: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k.removeprefix("weight."): v.numpy() for k, v in record.items()
            if k.startswith("weight.")}


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "dims"), [("fsdp,linear,g2,k1", ("groups,dp,tp", "2,2,1")),
                                              ("hsdp2,linear,g2,k1",
                                               ("groups,replicate,shard", "2,1,2"))])
def test_every_step_is_plain_data_parallelism(runs: Path, layout: str,
                                              dims: tuple[str, str]) -> None:
    """2 groups of 2 ranks (FSDP2, or HSDP 1 x 2, inside each) averaging after every step ==
    FSDP2 over 4.

    The optimizer is made linear: AdamW at eps = 2^60 with lr = 0.1 * 2^60 (float64). Its
    step is lr / (1 - 0.9^t) * exp_avg / (sqrt(v_hat) + eps), and sqrt(v_hat) <= 0.25 (the
    gradients' max, 0.249 here) is absorbed by 2^60 (below half its ulp, 128), so the step
    is 0.1 * m_hat exactly: SGD with momentum. With a linear step, averaging the groups'
    weights after each step equals one step on the average of their gradients, and each
    group's momentum is the EMA of its own gradients, whose mean is the EMA of the mean:
    plain data parallelism, in exact arithmetic. (AdamW's usual eps makes the step
    nonlinear in the gradient, and then K = 1 is not plain DP: that is not a bug.)

    Bound (float64, u = 2^-53 = 1.1e-16). Step 1's rank gradients are bitwise equal in both
    runs (same weights, rows, kernels). The mean over 4 ranks (one reduce-scatter, / 4) and
    over 2 then 2 groups (/ 2, / 2) add the same 4 terms in other orders: <= 3u * 4 * 0.25 =
    3.3e-16 apart (divisions by 2 and 4 are exact). The step multiplies by 0.1 and adds to
    |w| <= 3.2: <= 0.1 * 3.3e-16 + 2 ulp(3.2) (8.9e-16) = 9e-16 per step. A weight error
    at the start grows by at most 1.1x over the 7 steps (measured with the numpy
    reference: +-1e-9 on every weight moves the end by <= 1.1e-9, losses too), so after 7
    steps: 7 * 1.1 * 9e-16 = 7e-15; atol 1e-14. Losses: rank means of the same rows at
    weights <= 1e-14 apart: <= 1.1 * 1e-14 + 2 ulp(2.8) (8.9e-16): atol 2e-14.

    The bug this catches (made once on purpose): averaging every 2 steps instead of every
    step moves the weights by 9.7e-5 (and the losses by 6.7e-4 in the numpy reference).
    """
    for rank in range(NPROC):
        ref, ref_meta = _load(runs, "fsdp,linear", rank)
        got, meta = _load(runs, layout, rank)
        assert (ref_meta["dims"], ref_meta["shape"]) == ("dp,tp", "4,1")
        assert (meta["dims"], meta["shape"]) == dims, meta
        assert (int(meta["dp_rank"]), int(meta["group"])) == (rank, rank // 2)
        # FSDP2 inside a group of 2: half of every parameter, the same half as the rank at
        # the same place in the other group (the averaged local tensors are the same slice)
        other, _ = _load(runs, layout, (rank + 2) % NPROC)
        for name in ("embed.weight", "head.weight"):
            assert got[f"local.{name}"].shape == (8, 8)
            assert torch.equal(got[f"local.{name}"], other[f"local.{name}"])
        worst = max(float(np.abs(_weights(got)[k] - w).max())
                    for k, w in _weights(ref).items())
        assert worst <= 1e-14, worst
        assert float((got["losses"] - ref["losses"]).abs().max()) <= 2e-14
        assert json.loads(meta["metrics"])[metric.GROUP_SYNCS] == STEPS


@pytest.mark.slow
def test_tensor_parallel_inside_groups(runs: Path) -> None:
    """2 groups of tensor parallel 2 (FSDP2 dp 1 x tp 2 each, the tiny-test transformers
    model, float32) averaging after every step == FSDP2 dp 2 x tp 2 over the 4 ranks.

    With the linear optimizer of :func:`test_every_step_is_plain_data_parallelism`, equal
    in exact arithmetic. Bound (fp32, |w| <= 1.01, ulp 2.4e-7): step 1's rank gradients are
    bitwise equal (the same tensor-parallel pair computes the same rows through the same
    collectives); plain rounds w - 0.1 * (g0 + g1) / 2 twice, the groups round w - 0.1 g_a
    and their mean, so each step adds <= 2 ulp = 4.8e-7; 7 steps: 3.4e-6, and the carried
    errors move later gradients (0.1 * Lipschitz * 3.4e-6 a step, assumed below 1e-7 for
    this model at these weights): atol 5e-6. Losses: a rank's loss moves by <= |grad L|_1
    * 5e-6 with |grad L|_1 <= 198 (twice the 99 tests/training/test_hsdp.py measured for 2
    sequences of this model; 4 here): atol 1e-3.

    The bug this catches (made once on purpose): averaging every 2 steps instead of every
    step moves the weights by 1.0e-2 and the losses by 2.3e-2; never averaging (only at
    the end of 3 steps) by 5.1e-3 and 3.2e-2.
    """
    for rank in range(NPROC):
        ref, ref_meta = _load(runs, "tp2,linear", rank)
        got, meta = _load(runs, "tp2,linear,g2,k1", rank)
        assert (ref_meta["dims"], ref_meta["shape"]) == ("dp,tp", "2,2")
        assert (meta["dims"], meta["shape"]) == ("groups,dp,tp", "2,1,2"), meta
        assert (int(meta["dp_rank"]), int(meta["group"])) == (rank // 2, rank // 2)
        other, _ = _load(runs, "tp2,linear,g2,k1", (rank + 2) % NPROC)
        q = "local.model.layers.0.self_attn.q_proj.weight"
        assert got[q].shape == (16, 32) and torch.equal(got[q], other[q])  # the same slice
        weights = [k for k in ref if k.startswith("weight.")]
        worst = max(float((got[k] - ref[k]).abs().max()) for k in weights)
        assert worst <= 5e-6, worst
        assert float((got["losses"] - ref["losses"]).abs().max()) <= 1e-3


def _reference(record: dict[str, torch.Tensor], masked: bool = False, **options: object
               ) -> tuple[list[np.ndarray], np.ndarray]:
    init = [record["init.embed.weight"].numpy(), record["init.head.weight"].numpy()]
    rows = [[(x[4 * a:4 * a + 4].numpy(), y[4 * a:4 * a + 4].numpy()) for a in range(GROUPS)]
            for x, y in global_batches(STEPS, masked)]  # group a: dp ranks 2a, 2a+1
    opt = OPTIMIZERS["adamw"]
    return local_sgd(init, rows, EVERY, opt["lr"], opt["adam_eps"], **options)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "options"), [
    ("ddp,adamw,g2,k3", {}),
    ("fsdp,adamw,g2,k3,moments", {"moments": True}),
    ("ddp,adamw,g2,k3,nesterov", {"nesterov": (0.7, 0.9)}),
    ("ddp,adamw,g2,k3,masked", {"masked": True}),
])
def test_every_k_is_local_sgd(runs: Path, layout: str, options: dict[str, object]) -> None:
    """2 groups averaging every 3 of 7 steps (at 3, 6 and the round's end) == numpy.

    The reference: the model's forward and backward and torch's AdamW written in float64
    numpy, per group on its rows, with the average (and AdamW's moments, or DiLoCo's
    outer Nesterov step: outer lr 0.7, momentum 0.9) after steps 3, 6 and 7. It shares no
    code with xffl or torch (not even the gradients), so the groups' data, the loss scale
    inside a group, when the syncs happen and what they average are all checked. The
    model is the smallest xffl's loop trains (an embedding and a head, in float64, its
    own loss: :class:`tests.training.groups_worker.Bigram`). ``masked``: group 0 has 12
    targets in the loss a step and group 1 has 32, so each group's gradient must be the mean
    over its own targets (xffl's loop counts them per group).

    Bound (float64, u = 1.1e-16, AdamW lr 0.05, eps 0.01). A gradient entry sums <= 32
    tokens' d * h with |d| <= 1/32 (softmax minus one-hot over the group's 32 targets),
    |h| <= 3.2: <= 32u * 6.4 = 2.3e-14 from the order of the sum, plus the softmax's
    rounding (<= 20u relative on d: 1.4e-14): 4e-14. AdamW's step moves by <= 2 lr/eps =
    10 per unit of a gradient's change (as in tests/training/test_hsdp.py), so <= 4e-13,
    plus 2 ulp(3.2) = 9e-16 when added to w; a sync's mean of 2 is exact but for 1 ulp.
    An error at the start grows by <= 3.2x over the run (measured with the reference:
    +-1e-9 on every weight moves the end by <= 2.1e-9, moments 1.8e-9, Nesterov
    3.2e-9), so 7 steps: 7 * 3.2 * 4.1e-13 = 9.2e-12; atol 1e-11. Losses: <= 1.3x the
    weights' error (measured the same way) plus 2 ulp: atol 2e-11.

    The bugs this catches (made once on purpose): averaging every 4 steps instead of 3
    moves the weights by 5.8e-3 (moments 1.3e-2, Nesterov 0.11); leaving out the round's
    last sync (after step 7) by 2.4e-2 (1.5e-2, 0.15); group 1 reading group 0's rows (its
    dp ranks numbered inside the group, not in the site) by 0.22; scaling a group's loss
    by the site's count of targets, not the group's (masked), by 2.3e-2.
    """
    want, losses = _reference(_load(runs, layout, 0)[0], **options)
    for rank in range(NPROC):
        weights = _weights(_load(runs, layout, rank)[0])
        worst = max(float(np.abs(weights[k] - w).max())
                    for k, w in zip(("embed.weight", "head.weight"), want, strict=True))
        assert worst <= 1e-11, (rank, worst)
    # a group's loss: the mean of its 2 ranks' (each its rows' sum over the group's count)
    step_losses = [_load(runs, layout, r)[0]["losses"].numpy() for r in range(NPROC)]
    for group in range(GROUPS):
        mean = (step_losses[2 * group] + step_losses[2 * group + 1]) / 2
        assert float(np.abs(mean - losses[:, group]).max()) <= 2e-11


@pytest.mark.slow
def test_the_syncs_bytes(runs: Path) -> None:
    """What a rank all-reduces: its local parameters per sync (and AdamW's two moments with
    average_moments), per step (/ every) and per round (3 syncs: after 3, 6, 7 steps)."""
    params = 2 * 16 * 8 * 8  # embed and head, 16 x 8 float64, whole under DDP
    for layout, per_sync in (("ddp,adamw,g2,k3", params),
                             ("fsdp,adamw,g2,k3,moments", 3 * params // 2)):  # FSDP2: halves
        got = json.loads(_load(runs, layout, 1)[1]["metrics"])
        assert got == {metric.GROUP_SYNCS: 3, metric.GROUP_SYNC_BYTES: per_sync,
                       metric.GROUP_BYTES_PER_STEP: per_sync / EVERY,
                       metric.GROUP_BYTES_ROUND: 3 * per_sync}


def test_the_spec_and_what_groups_combine_with() -> None:
    """The spec's own checks and the trainer's check of a site's ranks."""
    spec = TrainingSpec(local_groups=LocalGroupsSpec(groups=2, every=4))
    assert check(spec, 4) == 2 and check(spec, 1) == 1 and check(TrainingSpec(), 8) == 1
    for bad, message in (({"groups": 1, "every": 2}, "one group is plain data parallelism"),
                         ({"groups": 2, "every": 0}, "every is 0"),
                         ({"groups": 2, "every": 2, "outer_momentum": 1.0}, "outer_momentum"),
                         ({"groups": 2, "every": 2, "outer_lr": 0.0}, "outer_lr is 0.0"),
                         ({"groups": 2, "every": 2, "outer": "nesterov",
                           "average_moments": True}, "average_moments applies")):
        with pytest.raises(ValueError, match=message):
            LocalGroupsSpec.model_validate(bad)
    with pytest.raises(InvalidInput, match="does not divide the site's 6 ranks"):
        check(TrainingSpec(local_groups=LocalGroupsSpec(groups=4, every=1)), 6)
    with pytest.raises(InvalidInput, match=r"training\.checkpoint does not combine"):
        check(TrainingSpec(local_groups=LocalGroupsSpec(groups=2, every=1),
                           checkpoint={"every": 2}), 4)  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_groups_round_through_the_launcher(tmp_path: Path, global0: tuple[Path, Manifest],
                                             make_job: Callable[..., TrainJob]) -> None:
    """The site trainer end to end at 4 ranks in 2 groups of FSDP2(2), averaging every 2 of
    3 steps: the global loaded into the groups' slices, the update written by rank 0 with
    the syncs' metrics (2 syncs: after step 2 and at the end), the step lines saying what
    the syncs send, and the update is the mean of the groups' models kept before the last
    sync (``keep``).

    Bound: the kept models are fp32 and the update is their fp32 all-reduced sum halved
    (exact: a sum of 2 is rounded once, / 2 is exact), so it is the fp32 rounding of the
    exact mean, as is the mean computed here: bitwise equal.
    """
    job = make_job(tmp_path / "data", steps=3)
    job = job.model_copy(update={"training": job.training.model_copy(update={
        "data_parallel": "fsdp",
        "local_groups": LocalGroupsSpec(groups=2, every=2, keep=True)})})
    (tmp_path / "job.json").write_text(job.model_dump_json())
    out = tmp_path / "update"
    args = ["--job", str(tmp_path / "job.json"), "--round", "1", "--model", str(global0[0]),
            "--out", str(out)]
    assert launch(NPROC, "torchrun", args, out, keep=tmp_path / "state", env=warm_env()) == 0
    manifest = verify_checkpoint(out)
    kept = [tmp_path / "state" / "groups" / "r1" / f"group-{g}.safetensors" for g in (0, 1)]
    with safe_open(str(kept[0]), "pt") as a, safe_open(str(kept[1]), "pt") as b, \
            safe_open(str(out / MODEL_FILE), "pt") as update:
        names = set(update.keys())
        assert names and names <= set(a.keys())
        apart = max(float((a.get_tensor(k) - b.get_tensor(k)).abs().max()) for k in names)
        assert apart > 1e-4, apart  # the groups trained on different rows since step 2
        for name in names:
            assert torch.equal(update.get_tensor(name),
                               (a.get_tensor(name) + b.get_tensor(name)) / 2), name
    assert manifest.extra["dp"] == NPROC
    assert manifest.metrics[metric.GROUP_SYNCS] == 2
    assert manifest.metrics[metric.GROUP_BYTES_ROUND] == \
        2 * manifest.metrics[metric.GROUP_SYNC_BYTES] > 0
    lines = (tmp_path / "steps.log").read_text().splitlines()
    sync = manifest.metrics[metric.GROUP_SYNC_BYTES] / 1e6
    note = f" groups 2 every 2 sync MB {sync:.3g} MB/step {sync / 2:.3g} MB/round {sync * 2:.3g}"
    assert lines and all(line.endswith(note) for line in lines), (note, lines)


def test_validate_shows_the_groups_layout(xffl_home: Path, tmp_path: Path) -> None:
    """xffl validate's layout column: each group's mesh, prefixed by the groups."""
    from typer.testing import CliRunner

    from xffl.cli.app import app

    job = tmp_path / "job.yaml"
    job.write_text("name: good\nrounds: 2\ntraining:\n  data_parallel: fsdp\n"
                   "  local_groups: {groups: 2, every: 8}\nsites:\n  - name: alpha\n"
                   "    profile: local\n    ranks: 4\n    data: {path: data/alpha}\n")
    out = CliRunner().invoke(app, ["validate", str(job), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["sites"][0]["layout"] == "2 groups of fsdp dp 2 x tp 1"


def test_the_memory_model_shards_inside_a_group() -> None:
    """xffl validate's estimate: 2 groups of FSDP2 at 8 ranks keep FSDP2-over-4's states."""
    from xffl.training.arch import build_config
    from xffl.training.config import ModelSpec
    from xffl.training.memory_model import model_parts, site_layout, state_terms

    parts = model_parts(build_config(ModelSpec(preset="llama3.1-8b")))
    fsdp = TrainingSpec(data_parallel="fsdp")
    grouped = fsdp.model_copy(update={"local_groups": LocalGroupsSpec(groups=2, every=8)})
    assert site_layout(grouped, 8, parts).dp == 4
    assert state_terms(parts, site_layout(grouped, 8, parts)) == \
        state_terms(parts, site_layout(fsdp, 4, parts)) != \
        state_terms(parts, site_layout(fsdp, 8, parts))
