"""The loss mask is real: targets out of the loss move nothing, packed examples stay apart."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tests.training.test_prepare_examples import word_tokenizer
from xffl.aggregator.exchange import Manifest
from xffl.aggregator.metrics import VAL_TOKENS
from xffl.training.arch import build_config
from xffl.training.config import ModelSpec, TrainingSpec, TrainJob
from xffl.training.data import (
    IGNORE,
    LOSS,
    TOKENS_FILE,
    TokenShards,
    index_batches,
    positions,
    site_splits,
)
from xffl.training.evaluate import evaluate_net
from xffl.training.loop import make_scheduler, run_steps
from xffl.training.model import build_model
from xffl.training.optimizer import make_optimizer
from xffl.training.parallelize import ParallelModel
from xffl.training.prepare_examples import Options, prepare_examples
from xffl.training.trainer import train_round

CPU = torch.device("cpu")
SEQ_LEN = 8
WORDS = ["hello", "world", "a", "b", "c", "say", "reverse", "the", "words", "ok", "sure"]


def _model() -> torch.nn.Module:
    return build_model(build_config(ModelSpec(preset="tiny-test")), seed=1)


def test_positions_restart_at_every_example() -> None:
    starts = np.array([[True, False, False, True, False, True],
                       [False, False, True, False, False, False]])
    assert positions(starts).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]]


def test_packed_examples_do_not_see_each_other() -> None:
    """An example packed after another, its positions restarted, has the logits it has alone.

    Tolerance (fp32, u = 2^-24): both forwards do the same operations on the same numbers
    except that the packed one's attention also holds the earlier example's keys, with
    weight exp(-inf) = 0 exactly, and its kernels run on other shapes, so the sums are
    ordered differently: per layer, dot products of <= 64 terms and softmax sums of <= 16,
    each off by <= 2 (64 + 16) u S with S <= 4 (sums of |terms| here), two layers and the
    head (first order, gains ~1): <= 3 * 160 * 4 u = 1.1e-4: atol 2e-4. Without the restart
    (the earlier example visible) the logits move by > 1e-2 (asserted below).
    """
    gen = torch.Generator().manual_seed(7)
    first, second = torch.randint(0, 256, (7,), generator=gen), torch.randint(0, 256, (9,),
                                                                               generator=gen)
    packed = torch.cat([first, second])[None]
    starts = np.zeros((1, 16), dtype=bool)
    starts[0, [0, 7]] = True
    pos = torch.from_numpy(positions(starts))
    model = _model().eval()
    with torch.no_grad():
        together = model(packed, position_ids=pos)[0, 7:]
        alone = model(second[None])[0]
        unseparated = model(packed)[0, 7:]
    torch.testing.assert_close(together, alone, atol=2e-4, rtol=0)
    assert float((unseparated - alone).abs().max()) > 1e-2


def _chat_shards(tmp_path: Path) -> Path:
    """Packed chats whose windows of SEQ_LEN + 1 tokens end on prompt and response tokens."""
    rng = np.random.default_rng(3)
    records = []
    for _ in range(40):
        words = [str(w) for w in rng.choice(WORDS, size=int(rng.integers(1, 4)))]
        records.append({"messages": [{"role": "user", "content": " ".join(words)},
                                     {"role": "assistant", "content": " ".join(words[::-1])}]})
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "shards"
    prepare_examples([src], out, word_tokenizer(tmp_path / "tok"), None, Options(fmt="chat"))
    return out


def _first_step_loss(data: Path, windows: list[int]) -> float:
    """The loss of one training step on ``windows``, as the trainer's loop computes it."""
    shards = TokenShards(data, SEQ_LEN)
    idx = np.asarray(windows)
    pos = shards.positions(idx)
    batch = shards.batch(idx) if pos is None else (*shards.batch(idx), pos)
    model = _model()
    spec = TrainingSpec(batch_size=len(windows), seq_len=SEQ_LEN, lr=1e-3)
    opt = make_optimizer(model, spec)
    result = run_steps(ParallelModel(module=model, net=model), opt,
                       make_scheduler(opt, spec, 0, 1), iter([batch]), 1, spec, CPU,
                       masked=True)
    return float(result.losses[0])


def test_targets_out_of_the_loss_move_nothing(tmp_path: Path) -> None:
    """A window's last token is a target only (no input of its window): changing it where it
    is a prompt token leaves the batch's loss bit for bit; where it is a response token, the
    loss moves."""
    data = _chat_shards(tmp_path)
    width = SEQ_LEN + 1
    flags = np.fromfile(data / "flags.bin", dtype=np.uint8)
    count = len(flags) // width
    last = flags[width - 1::width][:count] & LOSS != 0
    prompt_end, response_end = int(np.flatnonzero(~last)[0]), int(np.flatnonzero(last)[0])
    windows = [prompt_end, response_end]
    before = _first_step_loss(data, windows)
    tokens = np.fromfile(data / TOKENS_FILE, dtype=np.uint16)

    def changed(window: int) -> float:
        edited = tokens.copy()
        at = (window + 1) * width - 1
        edited[at] = (edited[at] + 1) % 14  # another token of the tokenizer's 14
        edited.tofile(data / TOKENS_FILE)
        try:
            return _first_step_loss(data, windows)
        finally:
            tokens.tofile(data / TOKENS_FILE)

    assert changed(prompt_end) == before
    assert abs(changed(response_end) - before) > 1e-3


def test_evaluation_is_the_mean_over_the_targets_in_the_loss(tmp_path: Path) -> None:
    """evaluate_net == sum of -log p(target) over the LOSS targets / their count, computed
    here window by window in float64 from the files.

    Tolerance: the evaluator's fp32 forward against a float64 one: logits off by <= 2 n u S
    (n <= 3 * 160 terms along the path as above, S <= 4) = 2.3e-4 relative... absolute 1.2e-4,
    and a cross-entropy is 2-Lipschitz in its logits: the means differ by <= 2.4e-4: atol
    5e-4. Counting every target instead (the prompts too) moves the mean by > 0.01.
    """
    data = _chat_shards(tmp_path)
    shards = TokenShards(data, SEQ_LEN)
    model = _model()
    got = evaluate_net(model, shards, len(shards), 4, CPU, "fp32")
    width = SEQ_LEN + 1
    tokens = np.fromfile(data / TOKENS_FILE, dtype=np.uint16).astype(np.int64)
    flags = np.fromfile(data / "flags.bin", dtype=np.uint8)
    wide = model.double().eval()
    total, count, everything = 0.0, 0, []
    with torch.no_grad():
        for w in range(len(shards)):
            row = torch.from_numpy(tokens[w * width:(w + 1) * width])
            starts = (flags[w * width:(w + 1) * width - 1] & 2 != 0)[None]
            logp = F.log_softmax(wide(row[None, :-1], position_ids=torch.from_numpy(
                positions(starts)))[0], dim=-1)
            nll = -logp[torch.arange(SEQ_LEN), row[1:]]
            keep = torch.from_numpy(flags[w * width + 1:(w + 1) * width] & LOSS != 0)
            total += float(nll[keep].sum())
            count += int(keep.sum())
            everything.append(nll)
    assert got.tokens == count
    assert abs(got.loss - total / count) <= 5e-4
    assert abs(float(torch.cat(everything).mean()) - total / count) > 1e-2


def test_a_rounds_token_counts_are_the_targets_in_the_loss(
        tmp_path: Path, global0: tuple[Path, Manifest]) -> None:
    """num_tokens (the FedAvg weight under weighting: tokens) is the number of targets in the
    loss of the windows the round dealt; val_tokens those of the held-out windows."""
    data = _chat_shards(tmp_path)
    spec = TrainingSpec(steps=3, batch_size=2, seq_len=SEQ_LEN)
    job = TrainJob(run_id="run-test", site="site-a", model=ModelSpec(preset="tiny-test"),
                   training=spec, data={"path": str(data),  # type: ignore[arg-type]
                                        "validation": {"fraction": 0.2}})
    manifest = train_round(job, 1, global0[0], data, tmp_path / "update")
    train, held = site_splits(data, job.data, SEQ_LEN)
    dealt = index_batches(len(train), 2, 0, 1, spec.seed, 1)
    expected = sum(int((train.batch(next(dealt))[1] != IGNORE).sum()) for _ in range(3))
    assert manifest.num_tokens == expected < 3 * 2 * SEQ_LEN
    assert held is not None
    count = int((held.batch(np.arange(len(held)))[1] != IGNORE).sum())
    assert manifest.metrics[VAL_TOKENS] == count < len(held) * SEQ_LEN


def test_a_simulated_part_keeps_its_loss_mask(tmp_path: Path) -> None:
    """`xffl simulate`'s parts of a masked dataset carry their slice of flags.bin."""
    from xffl.workflows.simulate_sites import ensure_partition

    data = _chat_shards(tmp_path)
    ensure_partition(data, tmp_path / "part", 1, 2, SEQ_LEN)
    whole, part = TokenShards(data, SEQ_LEN), TokenShards(tmp_path / "part", SEQ_LEN)
    half = len(whole) // 2
    assert len(part) == len(whole) - half
    rows = np.arange(len(part))
    for got, want in zip(part.batch(rows), whole.batch(rows + half), strict=True):
        assert torch.equal(got, want)
