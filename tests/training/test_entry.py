"""Models from a user's entry point: init, a training round, aggregation, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from xffl.aggregator.exchange import verify_checkpoint
from xffl.aggregator.fedavg import aggregate
from xffl.core.errors import InvalidInput
from xffl.training.arch import build_config
from xffl.training.checkpoint import init_global
from xffl.training.config import DataSpec, ModelSpec, TrainingSpec, TrainJob
from xffl.training.data import ensure_synthetic
from xffl.training.entry import build
from xffl.training.parallelize import parallelize
from xffl.training.trainer import evaluate, train_round

ENTRY = "tests.training.custom_model:build"
SPEC = ModelSpec(preset="tiny-test", entry_point=ENTRY)


def _job(data: Path, site: str, **training: object) -> TrainJob:
    fields: dict[str, object] = {"steps": 8, "batch_size": 4, "seq_len": 16, "lr": 1e-2}
    return TrainJob(run_id="run-test", site=site, model=SPEC,
                    training=TrainingSpec.model_validate({**fields, **training}),
                    data=DataSpec(path=str(data)))


def test_a_round_trains_and_aggregates_the_users_model(tmp_path: Path) -> None:
    g0 = tmp_path / "g0"
    manifest = init_global("run-test", SPEC, 5, g0)
    assert manifest.extra["entry_point"] == ENTRY
    weights = load_file(g0 / "model.safetensors")
    assert set(weights) == {"embed.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight",
                            "mlp.2.bias", "head.weight"}
    assert manifest.extra["num_parameters"] == sum(t.numel() for t in weights.values())
    again = init_global("run-test", SPEC, 5, tmp_path / "again")  # seeded: same bytes
    assert again.files["model.safetensors"] == manifest.files["model.safetensors"]

    updates = []
    for site, language in (("a", "alpha"), ("b", "beta")):
        data = ensure_synthetic(tmp_path / site, language, 64, 16)
        update = train_round(_job(data, site), 1, g0, data, tmp_path / f"u-{site}")
        assert update.extra["losses"][-1] < update.extra["losses"][0]
        updates.append(tmp_path / f"u-{site}")
    glob = aggregate(updates, tmp_path / "g1")
    assert verify_checkpoint(tmp_path / "g1") == glob
    data = tmp_path / "a"
    assert evaluate(tmp_path / "g1", data, 16, 4, entry_point=ENTRY) < evaluate(
        g0, data, 16, 4, entry_point=ENTRY)


def test_users_model_has_no_tensor_parallel_plan() -> None:
    model = build(build_config(SPEC), ENTRY)
    with pytest.raises(InvalidInput, match="tensor_parallel > 1 needs a transformers model"):
        parallelize(model, 2, torch.device("cpu"))


@pytest.mark.parametrize(
    ("entry", "message"),
    [("tests.training.no_such_module:build", "cannot import tests.training.no_such_module"),
     ("tests.training.custom_model:missing", "has no function missing"),
     ("tests.training.custom_model:not_a_module", "returned dict, not a torch.nn.Module")],
)
def test_broken_entry_points(tmp_path: Path, entry: str, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        init_global("run-test", ModelSpec(preset="tiny-test", entry_point=entry), 0,
                    tmp_path / "g0")
    assert not (tmp_path / "g0").exists()


def test_entry_point_form_is_validated() -> None:
    with pytest.raises(ValidationError, match=r"is not an entry point; write package\.module"):
        ModelSpec(entry_point="os.system('x')")
