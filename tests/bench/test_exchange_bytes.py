"""The exchange-bytes benchmark: its computed sizes against independent counts, its measured
ones against the run's files."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from torch import nn

from tests.bench.scripts import load_bench
from tests.conftest import FinishedRun


def _bench() -> ModuleType:
    return load_bench("exchange_bytes")


def test_llama2_7b_sizes_and_the_targets(capsys: pytest.CaptureFixture[str]) -> None:
    assert _bench().main(["--no-run", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["computed"]
    # Meta's published parameter count of Llama-2-7b (the model card's 6.74 B, exactly)
    assert got["parameters"] == 6_738_415_616
    rows = {r["exchange"]: r["bytes"] for r in got["rows"]}
    assert rows["fp32 weights"] == 4 * 6_738_415_616 and rows["bf16 delta"] == 2 * 6_738_415_616
    # by hand: 32 layers x 4 square 4096 projections x r (4096 + 4096), 4 bytes each
    assert rows["LoRA r=16 attention"] == 32 * 4 * 16 * 8192 * 4
    # the targets: LoRA on attention <= 0.5 % of the bf16 model; a bf16 delta <= 50 %
    assert rows["LoRA r=16 attention"] <= 0.005 * got["bf16_full_bytes"]
    assert rows["bf16 delta"] <= 0.5 * rows["fp32 weights"]


@pytest.mark.parametrize("preset", ["llama2-7b", "llama3.1-8b"])
def test_quantized_delta_rows_meet_the_targets(preset: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """int8 <= 0.27x and nf4 <= 0.14x of fp32 weights, scales included (issue 34)."""
    assert _bench().main(["--no-run", "--json", "--preset", preset]) == 0
    got = json.loads(capsys.readouterr().out)["computed"]
    rows = {r["exchange"]: r["bytes"] for r in got["rows"]}
    n, fp32 = got["parameters"], rows["fp32 weights"]
    # by hand: every tensor of these models is a multiple of 128 elements, so the codes are
    # n bytes (int8) or n/2 (nf4) and the scales 4 bytes per 128 elements
    assert rows["int8 delta (block 128)"] == n + 4 * n // 128
    assert rows["nf4 delta (block 128)"] == n // 2 + 4 * n // 128
    assert rows["int8 delta (block 128)"] <= 0.27 * fp32
    assert rows["nf4 delta (block 128)"] <= 0.14 * fp32


def test_lora_shapes_are_the_models_linear_layers() -> None:
    """The bench's (out, in) per projection equal the model's nn.Linear weights (GQA
    included: k and v are narrower than q)."""
    from xffl.training.arch import PRESETS
    from xffl.training.model import meta_model

    bench = _bench()
    config = PRESETS["tiny"]
    model = meta_model(config)
    counted = {t: 0 for t in bench.ALL_LINEAR}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and leaf in counted:
            out_features, in_features = module.weight.shape
            counted[leaf] += 8 * (out_features + in_features)
    assert bench.lora_parameters(config, 8, bench.ALL_LINEAR) == sum(counted.values())
    assert bench.lora_parameters(config, 8, bench.ATTENTION) == \
        sum(counted[t] for t in bench.ATTENTION)
    assert config.num_key_value_heads < config.num_attention_heads


def test_measured_bytes_of_the_quickstart(quickstart_run: FinishedRun,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("XFFL_HOME", str(quickstart_run.home))
    assert _bench().main(["--run", quickstart_run.run_id, "--json"]) == 0
    (got,) = json.loads(capsys.readouterr().out)["measured"]
    assert got["exchange"] == "weights/fp32"
    run_dir = Path(quickstart_run.status["run_dir"])
    assert [(r["round"], r["site"]) for r in got["rows"]] == [
        (n, s) for n in (1, 2, 3) for s in ("alpha", "beta")]
    for row in got["rows"]:  # what came back is the update the coordinator keeps
        update = run_dir / "rounds" / str(row["round"]) / "updates" / row["site"]
        assert row["sent_bytes"] == sum(f.stat().st_size for f in update.iterdir())
        # the update's files hold every tensor in fp32, then a header and two small jsons
        assert got["tiny_fp32_tensor_bytes"] < row["sent_bytes"]
