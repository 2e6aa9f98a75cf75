"""The model is transformers' AutoModelForCausalLM of the config's family: configs, presets,
round 0's seeded layout, and what xffl refuses (with the field and the fix)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from xffl.core.errors import InvalidInput
from xffl.training.arch import (
    PRESETS,
    ModelConfig,
    apply_overrides,
    build_config,
    check_tensor_parallel,
)
from xffl.training.config import ModelSpec
from xffl.training.model import (
    build_model,
    linear_modules,
    lm_loss,
    load_weights,
    model_layout,
    num_parameters,
    uniform_loss,
)
from xffl.training.seeded import seeded_tensor

TINY_FAMILIES = ["tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma2",
                 "tiny-mixtral"]


@pytest.mark.parametrize("preset", ["tiny", *TINY_FAMILIES])
def test_every_family_is_transformers_own_model(preset: str) -> None:
    """Names and shapes are those of the family's transformers class built independently;
    forward returns the logits of transformers' own forward, bit for bit."""
    config = PRESETS[preset]
    model = build_model(config, seed=0)
    theirs_config = AutoConfig.for_model(**config.fields)
    theirs = AutoModelForCausalLM.from_config(theirs_config, dtype=torch.float32)
    assert type(model) is type(theirs)
    ours = model.state_dict()
    assert {k: tuple(v.shape) for k, v in ours.items()} == {
        k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    theirs.load_state_dict(ours)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)
        assert torch.equal(logits, theirs(input_ids=ids, use_cache=False).logits)
    assert logits.shape == (2, 12, 256)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "tiny-gemma2"])
def test_seeded_init_is_the_layout_and_norms_follow_the_family(preset: str) -> None:
    """Round 0's values: every tensor is seeded_tensor(seed, its rule); the norm weights are
    the constants transformers' own init gives the family (ones for LLaMA and Qwen2, zeros
    for Gemma 2, whose norms scale by 1 + w), biases zeros, matrices N(0, 0.02)."""
    config = PRESETS[preset]
    model = build_model(config, seed=5)
    state = model.state_dict()
    default = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config.fields))
    reference = default.state_dict()
    layout = model_layout(config)
    assert [i.name for i in layout] == sorted(i.name for i in layout)
    for init in layout:
        assert torch.equal(state[init.name], seeded_tensor(5, init)), init.name
        if init.rule == "constant":
            assert torch.equal(state[init.name], reference[init.name]), init.name
        else:
            assert init.value == 0.02
    norms = {i.value for i in layout if i.name.endswith("norm.weight")}
    assert norms == ({0.0} if preset == "tiny-gemma2" else {1.0})
    if config.tie_word_embeddings:
        assert "lm_head.weight" not in {i.name for i in layout}
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # another seed, other matrices; the same seed, the same bits
    assert not torch.equal(build_model(config, seed=6).state_dict()["model.embed_tokens.weight"],
                           state["model.embed_tokens.weight"])
    assert torch.equal(build_model(config, seed=5).state_dict()["model.embed_tokens.weight"],
                       state["model.embed_tokens.weight"])


def test_presets_have_the_published_sizes() -> None:
    """The real models' parameter counts (their model cards), from the meta-device model."""
    published = {"llama2-7b": 6_738_415_616, "llama3.1-8b": 8_030_261_248,
                 "qwen2.5-7b": 7_615_616_512, "mistral-7b": 7_248_023_552}
    for name, count in published.items():
        assert sum(math.prod(i.shape) for i in model_layout(PRESETS[name])) == count, name
        assert num_parameters(PRESETS[name]) == count


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_config_json_round_trips_to_the_same_bytes(preset: str) -> None:
    text = PRESETS[preset].to_json()
    again = ModelConfig.from_hf_dict(json.loads(text))
    assert again.to_json() == text
    assert json.loads(text)["architectures"][0].endswith("ForCausalLM")


def test_build_config_presets_and_overrides() -> None:
    config = build_config(ModelSpec(preset="tiny", overrides={"num_hidden_layers": 3}))
    assert config.num_hidden_layers == 3 and config.hidden_size == 64
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        build_config(ModelSpec(preset="nope"))
    with pytest.raises(ValueError, match=r"unknown model override 'hiden_size'.*hidden_size"):
        apply_overrides(PRESETS["tiny"], {"hiden_size": 3})
    with pytest.raises(ValueError, match="must be an integer"):
        apply_overrides(PRESETS["tiny"], {"hidden_size": 3.5})
    with pytest.raises(ValueError, match="divisible by num_key_value_heads"):
        apply_overrides(PRESETS["tiny"], {"num_key_value_heads": 3})


def test_configs_transformers_cannot_build_are_refused() -> None:
    with pytest.raises(ValueError, match="model_type 'not-a-family' is not a model family"):
        ModelConfig.from_hf_dict({"model_type": "not-a-family"})
    with pytest.raises(ValueError, match="'clip' has no causal language model class"):
        ModelConfig.from_hf_dict({"model_type": "clip"})
    with pytest.raises(ValueError, match="model_type is missing"):
        ModelConfig.from_hf_dict({"hidden_size": 8})


def test_tensor_parallel_needs_a_plan_xffl_applies() -> None:
    check_tensor_parallel(PRESETS["tiny-qwen3"], 2)  # q/k norms: replicated, grads all-reduced
    with pytest.raises(InvalidInput,
                       match=r"'gpt2' has no tensor-parallel plan.*tensor_parallel: 1"):
        check_tensor_parallel(ModelConfig.from_hf_dict({"model_type": "gpt2"}), 2)
    with pytest.raises(InvalidInput, match=r"mixture-of-experts.*tensor_parallel: 1"):
        check_tensor_parallel(PRESETS["tiny-mixtral"], 2)
    with pytest.raises(InvalidInput, match="does not divide the model's num_key_value_heads"):
        check_tensor_parallel(PRESETS["tiny"], 4)
    with pytest.raises(InvalidInput, match="does not divide the site's 3 ranks"):
        check_tensor_parallel(PRESETS["tiny"], 2, ranks=3)
    check_tensor_parallel(ModelConfig.from_hf_dict({"model_type": "gpt2"}), 1)


def test_linear_modules_are_the_familys() -> None:
    names = linear_modules(PRESETS["tiny-qwen2"])
    assert "model.layers.1.self_attn.q_proj" in names and "lm_head" in names
    assert len(names) == 2 * 7 + 1


def test_untrained_loss_is_near_uniform_and_loss_uses_targets() -> None:
    model = build_model(PRESETS["tiny"], seed=0)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = lm_loss(model(ids[:, :-1]), ids[:, 1:])
    # N(0, 0.02) weights give logits of std ~0.02 * sqrt(64) * ... << 1: within 0.05 of log V
    assert abs(float(loss) - uniform_loss(256)) < 0.05


def test_load_weights_rejects_mismatch() -> None:
    model = build_model(PRESETS["tiny-test"], seed=0)
    state = model.state_dict()
    with pytest.raises(ValueError, match="missing"):
        load_weights(model, {k: v for k, v in state.items() if "layers.1" not in k})
    bad = dict(state)
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(3,\)"):
        load_weights(model, bad)
