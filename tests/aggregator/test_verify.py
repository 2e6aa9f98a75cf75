"""Tests of update admission: every kind of bad update is rejected with its site and reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from xffl.aggregator.exchange import read_manifest
from xffl.aggregator.shards import MODEL_FILE
from xffl.aggregator.verify import UpdateRejected, check_update, select_updates

SHAPES = {"w": (6, 4), "b": (4,)}


@pytest.fixture
def global_dir(tmp_path: Path, write_ckpt: Any) -> Path:
    """The parent global checkpoint of the round."""
    rng = np.random.default_rng(0)
    t = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    return write_ckpt(tmp_path / "global0", t, kind="global", site=None, round=0)


def _tensors(seed: int, **overrides: Any) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    t: dict[str, Any] = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    t.update(overrides)
    return t


def _flip_bit(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x10
    path.write_bytes(bytes(data))


def test_select_updates_rejects_each_bad_update_with_site_and_reason(
    make_update: Any, global_dir: Path
) -> None:
    parent = read_manifest(global_dir).digest()
    ok: dict[str, Any] = {"round": 1, "parent": parent}
    good = [make_update(s, _tensors(i), **ok) for i, s in enumerate(["site-b", "site-a"])]
    flipped = make_update("flipped", _tensors(3), **ok)
    _flip_bit(flipped / MODEL_FILE, 5)
    truncated = make_update("truncated", _tensors(4), **ok)
    data = (truncated / MODEL_FILE).read_bytes()
    (truncated / MODEL_FILE).write_bytes(data[:-16])
    shaped = make_update("shaped", _tensors(5, w=np.zeros((4, 6), np.float32)), **ok)
    nan_w = _tensors(6)
    nan_w["w"][2, 1] = np.nan
    nan = make_update("nan-site", nan_w, **ok)
    bf16 = make_update(
        "bf16-site",
        {
            "w": torch.full((6, 4), float("inf")).to(torch.bfloat16),
            "b": torch.zeros(4).to(torch.bfloat16),
        },
        **ok,
    )
    late = make_update("late", _tensors(7), round=2, parent=parent)
    stale = make_update("stale", _tensors(8), round=1, parent="0" * 64)
    glob = make_update("glob", _tensors(9), kind="global", **ok)
    no_manifest = make_update("gone", _tensors(10), **ok)
    (no_manifest / "manifest.json").unlink()
    dirs = [*good, flipped, truncated, shaped, nan, bf16, late, stale, glob, no_manifest]

    accepted, rejected = select_updates(
        dirs,
        expected_round=1,
        expected_parent=parent,
        reference_index=read_manifest(global_dir).tensors,
    )
    assert [m.site for _, m in accepted] == ["site-a", "site-b"]  # canonical order
    reasons = {site: reason for _, site, reason in rejected}
    assert set(reasons) == {
        "flipped",
        "truncated",
        "shaped",
        "nan-site",
        "bf16-site",
        "late",
        "stale",
        "glob",
        "gone",
    }
    assert "checksum mismatch for model.safetensors" in reasons["flipped"]
    assert "truncated" in reasons["truncated"]
    assert reasons["shaped"] == "tensor 'w' has shape [4, 6], the global model has [6, 4]"
    assert reasons["nan-site"] == "tensor 'w' holds non-finite values (NaN or Inf)"
    assert reasons["bf16-site"] == "tensor 'b' has dtype BF16, the global model has F32"
    assert reasons["late"] == "round 2, expected round 1"
    assert reasons["stale"].startswith("trained from global 000000000000, expected ")
    assert reasons["glob"] == "kind is 'global', expected 'update'"
    assert "no manifest.json" in reasons["gone"]
    assert {d for d, _, _ in rejected} == set(dirs[2:])


def test_check_update_message_names_site_and_reason(make_update: Any) -> None:
    bad = _tensors(1)
    bad["b"][0] = np.inf
    d = make_update("leonardo", bad, dirname="upd-0")
    with pytest.raises(UpdateRejected) as info:
        check_update(d)
    assert info.value.site == "leonardo"
    assert "update from site 'leonardo'" in str(info.value)
    assert "tensor 'b' holds non-finite values" in str(info.value)
    assert check_update(d, check_finite=False).site == "leonardo"


def test_bf16_nonfinite_values_are_found(make_update: Any) -> None:
    t = {"w": torch.randn(6, 4).to(torch.bfloat16)}
    t["w"][5, 3] = float("-inf")
    d = make_update("x", t)
    with pytest.raises(UpdateRejected, match="tensor 'w' holds non-finite"):
        check_update(d)


def test_bit_flip_in_header_or_config_is_caught(make_update: Any) -> None:
    d = make_update("x", _tensors(2))
    cfg = d / "config.json"
    cfg.write_text(cfg.read_text().replace("8", "9"))
    with pytest.raises(UpdateRejected, match=r"checksum mismatch for config\.json"):
        check_update(d)
    e = make_update("y", _tensors(2))
    data = bytearray((e / MODEL_FILE).read_bytes())
    data[9] ^= 0x01  # inside the JSON header
    (e / MODEL_FILE).write_bytes(bytes(data))
    with pytest.raises(UpdateRejected, match="site 'y'"):
        check_update(e)


def test_duplicates_and_layout_without_reference(make_update: Any) -> None:
    a = make_update("a", _tensors(1))
    a2 = make_update("a", _tensors(2), dirname="a-second")
    b = make_update("b", _tensors(3))
    c = make_update("c", {"w": np.zeros((6, 4), np.float32)})
    accepted, rejected = select_updates([c, a, b, a2])
    assert [m.site for _, m in accepted] == ["b"]
    reasons = sorted((site, reason.split(" (")[0]) for _, site, reason in rejected)
    assert reasons == [
        ("a", "more than one update from this site"),
        ("a", "more than one update from this site"),
        ("c", "tensor 'b' is missing"),
    ]


def test_wrong_run_id(make_update: Any) -> None:
    d = make_update("x", _tensors(1), run_id="other")
    with pytest.raises(UpdateRejected, match="run id 'other', expected 'run-1'"):
        check_update(d, expected_run_id="run-1")


def test_manifest_paths_must_stay_inside_the_update(make_update: Any) -> None:
    d = make_update("x", _tensors(1))
    text = (d / "manifest.json").read_text().replace('"config.json"', '"../config.json"')
    (d / "manifest.json").write_text(text)
    with pytest.raises(UpdateRejected, match="not a plain file name"):
        check_update(d)


def test_validation_numbers_only_from_a_site_the_job_gives_held_out_data() -> None:
    from xffl.aggregator.reported import check_validation
    from xffl.core.errors import CheckpointError

    numbers = {"val_loss": 2.0, "val_loss_update": 1.5, "val_samples": 8.0, "val_tokens": 40.0}
    check_validation(numbers, 8)  # within the budget: admitted
    check_validation({"loss": 1.0}, None)  # no validation numbers, none expected
    with pytest.raises(CheckpointError, match=r"gives the site no data\.validation"):
        check_validation(numbers, None)
    with pytest.raises(CheckpointError, match="val_samples is 8, not a whole number from 1 "
                                              "to the 7"):
        check_validation(numbers, 7)


def test_validation_tokens_within_what_the_sequences_hold() -> None:
    """``val_tokens`` weighs a site in the federated validation loss: a whole number from 0
    (held-out sequences of prompts only) to val_samples x seq_len (text data: every target),
    so at most the evaluation budget's sequences x seq_len, and never left out."""
    from xffl.aggregator.reported import check_validation
    from xffl.core.errors import CheckpointError

    losses = {"val_loss": 2.0, "val_loss_update": 1.5}
    for tokens in (0.0, 40.0, 8 * 16.0):  # none, some responses, every target of 8 x 16
        check_validation({**losses, "val_samples": 8.0, "val_tokens": tokens}, 8, 16)
    # fewer sequences claimed than the budget allows: the bound is what those hold (3 x 16),
    # not what the budget's 8 would
    check_validation({**losses, "val_samples": 3.0, "val_tokens": 3 * 16.0}, 8, 16)
    with pytest.raises(CheckpointError, match="val_tokens is 49, not a whole number from 0 to "
                                              "the 48 its 3 held-out sequences of 16 targets"):
        check_validation({**losses, "val_samples": 3.0, "val_tokens": 3 * 16 + 1.0}, 8, 16)
    for samples, tokens, expected in (
            (8.0, 8 * 16 + 1.0, "val_tokens is 129, not a whole number from 0 to the 128 its "
                                "8 held-out sequences of 16 targets hold"),
            (8.0, 1e9, "val_tokens is 1000000000, not a whole number from 0 to the 128"),
            (8.0, 2.5, "val_tokens is 2.5"), (8.0, -1.0, "val_tokens is -1")):
        with pytest.raises(CheckpointError, match=expected):
            check_validation({**losses, "val_samples": samples, "val_tokens": tokens}, 8, 16)
    with pytest.raises(CheckpointError, match="it reports 'val_loss' without 'val_tokens'"):
        check_validation({**losses, "val_samples": 8.0}, 8, 16)
