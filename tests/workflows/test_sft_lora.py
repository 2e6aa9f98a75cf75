"""Supervised fine-tuning as docs/sft.md walks it, run once as written: chat JSON lines,
`data prepare`, the sft-lora job (the template's three rounds of LoRA), `export --merge` and
transformers generating from the export folder alone; then what the run measured is
recomputed from the JSON lines."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from tests.conftest import REPO
from tests.workflows.warm_ranks import rank_python
from xffl.cli.app import app
from xffl.training.prepare_examples import SPLIT_SALT

runner = CliRunner()
PAGE = REPO / "docs" / "sft.md"
ROUNDS = (1, 2, 3)  # the template's rounds: the second and third train from aggregated adapters
# the page's run is paid once: every test that reads it runs in the same pytest-xdist worker
SFT_PAGE = pytest.mark.xdist_group("sft-page")

def _held_out(jsonl: Path, fraction: float) -> list[dict[str, Any]]:
    """The examples `xffl data prepare` holds out, by its documented rule: example i when
    the i-th draw of numpy's default_rng([salt, seed 0]) is below the fraction."""
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    draws = np.random.default_rng([SPLIT_SALT, 0]).random(len(records))
    return [r for r, d in zip(records, draws, strict=True) if d < fraction]


def _masked_sum(model: Any, tok: Any,
                examples: list[dict[str, Any]]) -> tuple[float, int, float]:
    """The sum of -log p over the response tokens, each example alone (no padding, no
    packing), the response found by rendering the prompt with the generation prompt
    (float64); their count; the mean over every target (the prompts' too)."""
    total, count, every, targets = 0.0, 0, 0.0, 0
    for ex in examples:
        prompt = ex["instruction"] + (f"\n\n{ex['input']}" if ex["input"] else "")
        messages = [{"role": "user", "content": prompt},
                    {"role": "assistant", "content": ex["output"]}]
        ids = torch.tensor(tok.apply_chat_template(messages, return_dict=False))
        start = len(tok.apply_chat_template(messages[:1], add_generation_prompt=True,
                                            return_dict=False))
        with torch.no_grad():
            logp = F.log_softmax(model(input_ids=ids[None, :-1]).logits[0].double(), dim=-1)
        nll = -logp[torch.arange(len(ids) - 1), ids[1:]]
        total += float(nll[start - 1:].sum())  # targets start..end: the response, its </s>
        count += len(ids) - start
        every, targets = every + float(nll.sum()), targets + len(nll)
    return total, count, every / targets


def blocks(markdown: str) -> list[tuple[str, str]]:
    """The page's bash and python blocks, in order, as (language, text)."""
    return re.findall(r"```(bash|python)\n(.*?)```", markdown, flags=re.S)


def test_the_page_has_the_walk_in_order() -> None:
    """Every step is a block the slow test below runs: init, the chats, prepare, validate,
    submit, export --merge, generate."""
    steps = [text.split()[0] + " " + text.split()[1] for _, text in blocks(PAGE.read_text())]
    assert steps == ["xffl init", "import json", "xffl data", "xffl validate",
                     "xffl export", "from transformers"], steps


@dataclass(frozen=True)
class PageRun:
    """What running docs/sft.md left: its folder, the init-prepared shards, the page's Python
    names, and the run's `xffl status --json`."""

    folder: Path
    init_shards: dict[str, bytes]
    scope: dict[str, Any]
    status: dict[str, Any]


@pytest.fixture(scope="module")
def sft_page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PageRun]:
    """Each xffl command of the page through the CLI (exit 0), each Python block executed, in
    the page's order, in a fresh folder with its own XFFL_HOME (the run's supervisor and ranks
    are their own processes)."""
    folder = tmp_path_factory.mktemp("sft-page")
    init_shards: dict[str, bytes] = {}
    scope: dict[str, Any] = {}
    old = Path.cwd()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XFFL_HOME", str(folder / "xffl-home"))
        mp.setenv("XDG_CONFIG_HOME", str(folder / "config"))
        # the local site's launcher forks its ranks from the warm rank server (no torch import
        # per launch: tests/workflows/warm_ranks.py); the run's supervisor inherits it
        mp.setenv("XFFL_RANK_PYTHON", str(rank_python()))
        os.chdir(folder)
        try:
            for language, text in blocks(PAGE.read_text()):
                if language == "python":
                    exec(compile(text, str(PAGE), "exec"), scope)  # the page's own code
                    continue
                for line in text.splitlines():
                    argv = shlex.split(line.split("#")[0])
                    if not argv:
                        continue
                    assert argv[0] == "xffl", line
                    if argv[1:3] == ["data", "prepare"] and not init_shards:
                        init_shards = {
                            f"{s}/{f}": (folder / "demo" / "data" / s / f).read_bytes()
                            for s in ("alpha", "beta")
                            for f in ("train.bin", "flags.bin", "validation/train.bin")}
                    done = runner.invoke(app, argv[1:])
                    assert done.exit_code == 0, (line, done.output)
            shown = runner.invoke(app, ["status", "last", "--json"])
            assert shown.exit_code == 0, shown.output
        finally:
            os.chdir(old)
    yield PageRun(folder, init_shards, scope, json.loads(shown.stdout))


@pytest.mark.slow
@SFT_PAGE
def test_the_sft_page_runs_from_chat_lines_to_generation(sft_page: PageRun) -> None:
    """The page ran (the fixture); the chat-prepared shards are the tokens and flags `xffl
    init` prepared from the same examples as instructions (the page says so); the merged
    export's tokenizer renders a conversation to the very ids the job's tokenizer does (its
    chat template came along); the export loads in AutoModelForCausalLM and generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = sft_page.folder / "demo" / "data"
    assert sft_page.init_shards
    for name, content in sft_page.init_shards.items():
        assert (data / name).read_bytes() == content, name

    merged = sft_page.folder / "demo" / "merged"
    source = AutoTokenizer.from_pretrained(str(data / "tokenizer"))
    exported = AutoTokenizer.from_pretrained(str(merged))
    chat = [{"role": "user", "content": "copy the words and count them\n\nban kol"},
            {"role": "assistant", "content": "ban kol two"}, {"role": "user", "content": "mit"}]
    for prompt in (True, False):
        assert exported.apply_chat_template(chat, add_generation_prompt=prompt,
                                            return_dict=False) == \
            source.apply_chat_template(chat, add_generation_prompt=prompt, return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(str(merged))
    scope = sft_page.scope
    assert type(scope["model"]) is type(model)
    generated = scope["out"][0, scope["prompt"]["input_ids"].shape[1]:]
    assert 1 <= len(generated) <= 8 and int(generated.max()) < len(source)
    assert isinstance(scope["reply"], str)


@pytest.mark.slow
@SFT_PAGE
def test_sft_lora_template_learns_and_its_adapter_generates(sft_page: PageRun) -> None:
    """The page's run, the template's three rounds: the federated validation loss falls
    every round and is, each round, the masked mean over every held-out response token of
    both sites, pooled, recomputed here from the JSON lines; the final adapter loads in peft
    on the base and generates.

    Tolerance of the recomputation: xffl evaluates in fp32 (batches of padded windows), this
    test in float64, one example at a time; the padding follows each example, so under
    causal attention it changes none of its logits, and only fp32 rounding differs. A
    worst-case bound (2 n u S per linear, u = 2^-24, n <= 172 terms, S = sum |x| |W| <= 490
    with the base's weights of std 0.3) is ~0.1 over the 11 linears on the path, too loose
    to test anything; rounding errors of independent sums grow as sqrt(n) u S (3.8e-4 per
    linear, on logits below 9) and enter a site's mean of ~200 targets (216 and 174) with
    signs of their own: 1e-3 holds with a wide margin (measured: 4e-7 a site, 3e-7 pooled).
    The pooled mean is a convex combination of the sites' means, so its error is no larger
    than theirs. Counting the prompts' targets too moves a site's mean by > 0.1 (asserted).
    Each site's val_tokens must be the response tokens counted here, exactly, and the
    federated number the sites' reported means weighted by them, exactly up to float64 sums
    (1e-12); weighting them by their held-out examples instead, as Flower's
    weighted_loss_avg does with example counts, moves it by 6e-3 to 2e-2 here (their 42
    and 30 examples; asserted > 1e-4).
    """
    from peft import PeftModel
    from transformers import AutoTokenizer, LlamaForCausalLM

    status = sft_page.status
    assert status["state"] == "completed", status
    run = Path(status["run_dir"]) / "rounds"
    data = sft_page.folder / "demo" / "data"
    federated = [json.loads((run / str(r) / "validation.json").read_text()) for r in ROUNDS]
    losses = [v["val_loss"] for v in federated]
    assert all(a > b for a, b in itertools.pairwise(losses)), losses

    tok = AutoTokenizer.from_pretrained(str(data / "tokenizer"))
    held = {site: _held_out(data / f"{site}.jsonl", 0.1) for site in ("alpha", "beta")}
    for r, record in zip(ROUNDS, federated, strict=True):
        base = LlamaForCausalLM.from_pretrained(str(run / "0" / "base"), dtype=torch.float64)
        model = PeftModel.from_pretrained(base, str(run / str(r - 1) / "global")).eval()
        model = model.double()
        sums = {site: _masked_sum(model, tok, ex) for site, ex in held.items()}
        pooled = sum(t for t, _, _ in sums.values()) / sum(c for _, c, _ in sums.values())
        assert abs(record["val_loss"] - pooled) <= 1e-3, (r, record, pooled)
        reported, tokens = record["sites"], record["site_tokens"]
        for site, (total, count, every) in sums.items():
            assert tokens[site] == count, (r, site, record)  # the response tokens, exactly
            assert abs(reported[site] - total / count) <= 1e-3, (r, site, record)
            assert abs(every - total / count) > 0.1  # what an unmasked evaluation would report
        n = {site: len(ex) for site, ex in held.items()}
        assert record["val_samples"] == sum(n.values())
        assert record["val_tokens"] == sum(tokens.values())
        by_tokens = sum(reported[s] * tokens[s] for s in n) / sum(tokens.values())
        assert abs(record["val_loss"] - by_tokens) <= 1e-12, (r, record, by_tokens)
        by_examples = sum(reported[s] * n[s] for s in n) / sum(n.values())
        assert abs(by_examples - by_tokens) > 1e-4  # the weights tell the two apart
        # xffl status shows what the run directory holds
        shown = next(x for x in status["rounds"] if x["round"] == r)
        assert (shown["val_loss"], shown["val_tokens"]) == (record["val_loss"],
                                                            record["val_tokens"])
        assert {s["site"]: s["val_tokens"] for s in shown["sites"]} == tokens

    # the final adapter, the last round's global (the loop above read each round's start),
    # on the base in float64: the page's merged export must compute the same logits, and so
    # generate the same greedy reply
    base = LlamaForCausalLM.from_pretrained(str(run / "0" / "base"), dtype=torch.float64)
    model = PeftModel.from_pretrained(base, str(run / str(ROUNDS[-1]) / "global")).eval()
    _same_reply(sft_page, model.double())


# |merged fp32 logits - base+adapter float64 logits|: the merge rounds W + s B A once to fp32
# (2^-24 relative each weight) and the merged model runs in fp32; as in the bound of
# test_sft_lora_template_learns_and_its_adapter_generates, rounding errors of independent
# sums grow as sqrt(n) u S, 3.8e-4 per linear on these logits, and the 11 linears on the
# path add at most 11 x 3.8e-4 = 4.2e-3 (measured: 2.8e-6). A merge that misses the
# adapter's scale (lora_alpha / r = 2 here) moved them by 9.3, and changed the reply.
MERGED_BOUND = 5e-3


def _same_reply(sft_page: PageRun, model: Any) -> None:
    """The page's reply (the merged export, fp32, greedy) is the greedy reply of the final
    adapter on the base (float64), token by token while the float64 model's choice is
    decided (its top two logits more than twice MERGED_BOUND apart: then the merged model,
    within MERGED_BOUND of it, makes the same choice), and its logits within MERGED_BOUND."""
    from transformers import AutoModelForCausalLM

    scope = sft_page.scope
    out, start = scope["out"][0], scope["prompt"]["input_ids"].shape[1]
    merged = AutoModelForCausalLM.from_pretrained(str(sft_page.folder / "demo" / "merged"))
    with torch.no_grad():
        ours = model(input_ids=out[None, :-1]).logits[0]
        theirs = merged.eval()(input_ids=out[None, :-1]).logits[0].double()
    gap = float((ours - theirs).abs().max())
    assert gap <= MERGED_BOUND, gap
    steps = ours[start - 1:]  # the logits that chose each generated token
    top2 = steps.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1] > 2 * MERGED_BOUND).tolist()
    n = decided.index(False) if False in decided else len(decided)
    # the reply's first token at least is decided (measured: the reply is 2 tokens, a word
    # and </s>, with margins 0.98 and 0.11; the logits 2.8e-6 apart)
    assert n >= 1, (decided, top2)
    assert out[start:start + n].tolist() == steps[:n].argmax(dim=-1).tolist(), \
        (out[start:].tolist(), steps.argmax(dim=-1).tolist())
    assert scope["reply"] == scope["tok"].decode(out[start:], skip_special_tokens=True)
