"""Error feedback of a quantized exchange: the residual is carried into the next round at the
site, what the coordinator receives sums to the true deltas within one quantization step, and
the residual never leaves the site."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from tests.aggregator.conftest import write_checkpoint
from xffl.aggregator.codec import NF4_HALF_GAP
from xffl.aggregator.decode import DecodedReader, encoded_index
from xffl.aggregator.exchange import MANIFEST_FILE, read_manifest
from xffl.aggregator.exchange_spec import ExchangeSpec
from xffl.aggregator.shards import MODEL_FILE, open_model
from xffl.training.encode import encode_update
from xffl.training.feedback import FOLDER

ROUNDS = 8
SHAPES = {"w": (4, 16), "b": (16,)}


def _deltas(rnd: int) -> dict[str, np.ndarray]:
    """Each round: one element of 1.0 per block of 16 (the block's absmax), and small ones
    that nf4 rounds to 0 on their own (0.03-0.035 is below half NF4's first level, 0.0398)."""
    rng = np.random.default_rng(rnd)
    out = {}
    for name, shape in SHAPES.items():
        d = (0.03 + 0.005 * rng.random(shape)).astype(np.float32).reshape(-1)
        d[::16] = 1.0
        out[name] = d.reshape(shape)
    return out


def _sent_and_received(tmp_path: Path, exchange: ExchangeSpec, tag: str
                       ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], Path, Path]:
    """Run ROUNDS rounds of one site from a fixed global: (sum of true deltas, sum of what
    the coordinator decoded, the last update sent, the site's state folder)."""
    base = {k: np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s)
            for k, s in SHAPES.items()}
    glob = write_checkpoint(tmp_path / tag / "global",
                            {k: torch.from_numpy(v) for k, v in base.items()},
                            kind="global", site=None, round=0)
    state_dir = tmp_path / tag / "site-state"
    true = {k: np.zeros(s) for k, s in SHAPES.items()}
    got = {k: np.zeros(s) for k, s in SHAPES.items()}
    sent = tmp_path
    for rnd in range(1, ROUNDS + 1):
        deltas = _deltas(rnd)
        weights = {k: torch.from_numpy(base[k] + deltas[k]) for k in SHAPES}
        for k in SHAPES:  # the delta the site truly made, as float32 arithmetic gives it
            true[k] += (base[k] + deltas[k]).astype(np.float64) - base[k]
        encoded = encode_update(weights, glob, exchange, state_dir, rnd)
        sent = write_checkpoint(tmp_path / tag / f"r{rnd}", encoded, round=rnd)
        codec = exchange.codec
        with DecodedReader(open_model(sent), open_model(glob), delta=True, codec=codec) as r:
            for k in SHAPES:  # the coordinator's decoding, minus the global it added it to
                numel = int(np.prod(SHAPES[k]))
                raw = r.dequantized(k, 0, numel)  # float64, before rounding to the global
                got[k] += raw.reshape(SHAPES[k])
    return true, got, sent, state_dir


def test_residual_is_carried_and_never_sent(tmp_path: Path) -> None:
    exchange = ExchangeSpec.parse("delta/nf4/16")
    assert exchange.feedback  # on by default for 4 bits
    true, got, sent, state_dir = _sent_and_received(tmp_path, exchange, "ef")
    with safe_open(str(state_dir / FOLDER / f"r{ROUNDS}.safetensors"), "np") as f:
        last = {k: f.get_tensor(k).astype(np.float64) for k in SHAPES}
    for k in SHAPES:
        # With feedback, sum_t received_t = sum_t delta_t - r_T exactly in real arithmetic
        # (r_t = v_t - received_t, v_t = delta_t + r_(t-1)), so the gap is the last residual:
        # at most NF4_HALF_GAP times its block's absmax, 1.0 (the 1.0 element is coded
        # exactly, so it carries no residual; the others stay below 0.035 + 0.139 < 1).
        gap = got[k] - true[k]
        assert np.abs(gap).max() <= NF4_HALF_GAP * 1.0 + 1e-6, k
        # And the gap is the residual the site kept, to float32 rounding: per round t the
        # site rounds to float32 (relative error at most 2^-24 each) its delta d_t (|d_t| <=
        # 1), v_t = d_t + r_(t-1) (|v_t| <= 1 + 0.139) and the residual r_t = v_t - received_t
        # (|r_t| <= 0.139); the coordinator decodes the same codes and scales to the same
        # float64 received_t, and float64 sums add ~2^-53. Summing the three roundings over
        # the rounds: |gap + r_T| <= ROUNDS * (1 + 1.139 + 0.139) * 2^-24 < ROUNDS * 2.5 *
        # 2^-24 (1.2e-6). A residual kept in float16 (2^-11 relative: up to 6.8e-5 at 0.139
        # each round) misses it by an order of magnitude and more.
        drift = np.abs(gap + last[k]).max()
        assert drift <= ROUNDS * 2.5 * 2.0**-24, (k, drift)
    # without feedback the small elements are lost every round: 8 x 0.03 at least, more
    # than the bound above
    exchange_off = ExchangeSpec.parse("delta/nf4/16").model_copy(
        update={"error_feedback": False})
    true_off, got_off, _, state_off = _sent_and_received(tmp_path, exchange_off, "off")
    lost = max(np.abs(got_off[k] - true_off[k]).max() for k in SHAPES)
    assert lost >= ROUNDS * 0.03 > NF4_HALF_GAP
    assert not (state_off / FOLDER).exists()
    # the site's state: only the last round's residual and the one carried into it
    kept = sorted(p.name for p in (state_dir / FOLDER).iterdir())
    assert kept == [f"r{ROUNDS - 1}.safetensors", f"r{ROUNDS}.safetensors"]
    # what was sent: the manifest's files, holding codes and scales only
    manifest = read_manifest(sent)
    assert sorted(p.name for p in sent.iterdir()) == sorted([MANIFEST_FILE, *manifest.files])
    glob_index = read_manifest(tmp_path / "ef" / "global").tensors
    assert manifest.tensors == encoded_index(glob_index, "U8", exchange.codec)
    payload = (sent / MODEL_FILE).read_bytes()
    with safe_open(str(state_dir / FOLDER / f"r{ROUNDS}.safetensors"), "np") as f:
        for k in f.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
            residual = f.get_tensor(k)
            assert np.abs(residual).max() > 0  # there is something to leak
            assert residual.tobytes() not in payload


def test_a_round_run_again_sends_the_same_update(tmp_path: Path) -> None:
    """A retried round reads the residual its first try read, not the one it wrote."""
    exchange = ExchangeSpec.parse("delta/fp4/16")
    base = {k: torch.zeros(s) for k, s in SHAPES.items()}
    glob = write_checkpoint(tmp_path / "global", base, kind="global", site=None, round=0)
    state_dir = tmp_path / "state"
    first = {}
    for rnd in (1, 2, 2):
        weights = {k: torch.from_numpy(_deltas(rnd)[k]) for k in SHAPES}
        encoded = encode_update(weights, glob, exchange, state_dir, rnd)
        if rnd in first:
            assert all(torch.equal(encoded[k], first[rnd][k]) for k in encoded)
        first[rnd] = {k: v.clone() for k, v in encoded.items()}
