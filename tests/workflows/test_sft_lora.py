"""`xffl init -t sft-lora` runs: instruction tuning with LoRA on this machine, two of its
three rounds (the second trains from an aggregated adapter, as the third would)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from xffl.cli.app import app
from xffl.training.prepare_examples import SPLIT_SALT

runner = CliRunner()
ROUNDS = (1, 2)


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


@pytest.mark.slow
def test_sft_lora_template_learns_and_its_adapter_generates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two rounds of the template; the federated validation loss falls every round and is,
    each round, the masked mean over every held-out response token of both sites, pooled,
    recomputed here from the JSON lines; the final adapter loads in peft on the base and
    generates.

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

    # the template's commands as a user types them in the folder (XFFL_HOME: the test's
    # own), here in this process: the run's supervisor and ranks are their own processes
    monkeypatch.chdir(tmp_path)

    def xffl(*argv: str) -> str:
        done = runner.invoke(app, list(argv))
        assert done.exit_code == 0, (argv, done.output)
        return done.stdout

    xffl("init", "-t", "sft-lora", "demo")
    job = tmp_path / "demo" / "job.yaml"
    text = job.read_text()
    assert "\nrounds: 3\n" in text
    job.write_text(text.replace("\nrounds: 3\n", f"\nrounds: {len(ROUNDS)}\n"))
    status = json.loads(xffl("submit", "demo/job.yaml", "--wait", "--json", "--timeout", "400"))
    assert status["state"] == "completed", status
    run = Path(status["run_dir"]) / "rounds"
    data = tmp_path / "demo" / "data"
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

    # the final adapter, the last round's global (the loop above read each round's start)
    base = LlamaForCausalLM.from_pretrained(str(run / "0" / "base"), dtype=torch.float64)
    model = PeftModel.from_pretrained(base, str(run / str(ROUNDS[-1]) / "global")).eval()
    model = model.double()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "reverse the words\n\nban kol mit"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=6, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    new = out[0, prompt["input_ids"].shape[1]:]
    assert 1 <= len(new) <= 6 and int(new.max()) < len(tok)
    assert tok.decode(new, skip_special_tokens=True).strip() != ""
