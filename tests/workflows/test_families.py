"""Every model family trains a round through a real run: checkpoints transformers wrote.

For Llama 3 (llama3 rope scaling, GQA), Qwen2 (q/k/v biases, tied embeddings), Mistral,
Gemma 2 (soft-capping, 1 + w norms) and Mixtral (a mixture of experts, data parallel), a tiny
random model written by ``save_pretrained`` is the job's ``model.init``; the run (``xffl
submit``) trains a round at a local site through StreamFlow, and ``xffl export`` of the global it
aggregated loads in ``AutoModelForCausalLM.from_pretrained`` (so a second round, which
would train from that global, adds no family-specific path: one round keeps the suite
short; so would a second site: the mean of two updates is taken tensor by tensor, by name,
whatever the family, and is tested as such in tests/aggregator). Submit, round and export
run in this process (CliRunner): a submit checks the checkpoint against its family in
transformers, whose import would cost each of five ``xffl`` processes ~2.5 CPU-seconds.
Mixtral's run is the quickstart's: its detached supervisor (a fresh interpreter that imports
what converting the checkpoint needs, ~4 CPU-s) runs the round while this process runs the
other four's as a cron tick does (``submit --no-start`` then ``xffl round``: the same
``execute`` of the supervisor module, the same plan and steps, with torch and transformers
already imported here). The site's profile is the local one with its ranks forked from one
warm interpreter that imported torch, the trainer and the five families' code once
(tests/workflows/warm_ranks.py, shared by the tests of this process): each rank runs the
product's trainer as ``python -m`` would, without a ~3 CPU-s import of its own.

Bound: the export holds the final global's tensors and config bytes, and xffl's model is
transformers' class of the family loaded from the global, so both compute the same ops on
the same bits in one process: the logits are equal (``torch.equal``); any wrong tensor or
dropped bias shows. Both read the global's config.json, so a field lost on the way in shows
in neither: round 0's config.json is compared with the job's (``model.init``'s) field by
field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.numpy import load_file
from transformers import AutoConfig, AutoModelForCausalLM
from typer.testing import CliRunner

from tests.workflows.warm_ranks import warm_profile
from xffl.aggregator.shards import MODEL_FILE
from xffl.cli.app import app
from xffl.core.layout import RunLayout
from xffl.jobs.follow import wait_for_run
from xffl.jobs.registry.store import Registry
from xffl.training.checkpoint import load_model

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {}),
    "gemma2": ("gemma2", {"head_dim": 8}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
DETACHED = "mixtral"  # the family whose run `xffl submit` starts (a supervisor of its own)
runner = CliRunner()


def _tail(log: Path) -> str:
    """The end of a run's supervisor log, to show why it failed."""
    return log.read_text(errors="replace")[-3000:] if log.is_file() else "(no log)"


def _checkpoint(folder: Path, model_type: str, extra: dict[str, Any]) -> Path:
    """A tiny random model of the family as transformers saves it (GQA: 4 heads over 2)."""
    config = AutoConfig.for_model(
        model_type, vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **extra)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _job(where: Path, family: str, init: Path, profile: str) -> Path:
    """The quickstart's shape, smaller: 1 round, 1 local site of one rank, 2 steps."""
    spec = {
        "name": f"family-{family}", "rounds": 1, "model": {"init": str(init)},
        "training": {"steps": 2, "batch_size": 4, "seq_len": 32, "lr": 0.003, "seed": 0},
        "aggregation": {"strategy": "fedavg", "weighting": "samples"},
        "sites": [{"name": name, "profile": profile, "ranks": 1,
                   "data": {"path": str(where / "data" / name), "synthetic": lang,
                            "synthetic_sequences": n}}
                  for name, lang, n in (("alpha", "alpha", 48),)],
    }
    job = where / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job


# what save_pretrained writes that no model is built from (xffl writes no version of its own)
NOT_THE_MODEL = {"transformers_version"}


def _same_config(init: Path, round0: Path, family: str) -> None:
    """Every field of the job's config.json is in round 0's, with the same value (xffl may
    add transformers' defaults of fields save_pretrained leaves out)."""
    theirs = json.loads((init / "config.json").read_text())
    ours = json.loads((round0 / "config.json").read_text())
    lost = sorted(set(theirs) - set(ours) - NOT_THE_MODEL)
    assert not lost, f"{family}: round 0's config.json lost {lost}"
    changed = {k: (theirs[k], ours[k]) for k in sorted(set(theirs) - NOT_THE_MODEL)
               if theirs[k] != ours[k]}
    assert not changed, f"{family}: round 0's config.json changed (job's, round 0's): {changed}"


@pytest.mark.slow
def test_every_family_trains_a_round_and_exports(tmp_path: Path) -> None:
    runs = {}
    for family, (model_type, extra) in sorted(FAMILIES.items(), key=lambda f: f[0] != DETACHED):
        where = tmp_path / family
        init = _checkpoint(where / "init", model_type, extra)
        profile = warm_profile(where / "site_profiles")
        submitted = runner.invoke(app, ["submit", str(_job(where, family, init, profile)),
                                        "--json", *([] if family == DETACHED else ["--no-start"])])
        assert submitted.exit_code == 0, (family, submitted.output)
        runs[family] = json.loads(submitted.stdout)["run_id"]
    for family, run_id in runs.items():  # the detached one's supervisor runs meanwhile
        if family != DETACHED:
            ticked = runner.invoke(app, ["round", run_id, "--json"])
            assert ticked.exit_code == 0, (family, ticked.output)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    for family, run_id in runs.items():
        final = wait_for_run(Registry(), run_id, 400)
        assert final.state == "completed", (family, final.message,
                                            _tail(RunLayout(Path(final.run_dir)).supervisor_log))
        run_dir = Path(final.run_dir)
        _same_config(tmp_path / family / "init", run_dir / "rounds" / "0" / "global", family)
        exported = tmp_path / family / "exported"
        done = runner.invoke(app, ["export", run_id, "-o", str(exported)])
        assert done.exit_code == 0, (family, done.output)
        theirs = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
        ours = load_model(run_dir / "rounds" / "1" / "global").eval()
        assert type(theirs) is type(ours)
        assert type(ours).__name__.lower().startswith(FAMILIES[family][0])
        with torch.no_grad():
            assert torch.equal(theirs(input_ids=ids, use_cache=False).logits, ours(ids)), family
        # a round of training moved every matrix away from the checkpoint it started from
        # (round 0 holds it under the model's own names: Mixtral's experts fused)
        start = load_file(str(run_dir / "rounds" / "0" / "global" / MODEL_FILE))
        final = load_file(str(run_dir / "rounds" / "1" / "global" / MODEL_FILE))
        assert start.keys() == final.keys()
        matrices = [n for n in start if start[n].ndim >= 2]
        assert [n for n in matrices if not (start[n] != final[n]).any()] == [], family
