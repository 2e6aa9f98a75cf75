"""A real 2-round run in which one site sends its config as other bytes of the same JSON value.

Site "eve" trains honestly, then rewrites its update's ``config.json`` (a LoRA update's
``adapter_config.json``) with every integer as a float and the right checksum
(tests/security/json_equal_site.py): equal to the global's config as a JSON value, so it is
admitted, but not loadable by transformers (``"num_hidden_layers": 2.0``) or peft (``"r":
4.0``). "eve" sorts before "honest": were the first update's bytes written as the global's
(as before the coordinator wrote its own), the round-1 global would carry eve's floats, the
honest site would fail to load it in round 2 and the run would fail. The run must instead
write every global's config from the coordinator's own bytes, let the honest site train
round 2, and export a model transformers (and peft) load.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from typer.testing import CliRunner

from tests.workflows.runs import admitted, reused
from xffl.aggregator.exchange import read_manifest
from xffl.aggregator.shards import ADAPTER_CONFIG_FILE, CONFIG_FILE
from xffl.cli.app import app

runner = CliRunner()
SCRIPT = Path(__file__).with_name("json_equal_site.py")
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _spec(name: str, lora: bool) -> dict[str, Any]:
    sites = [{"name": name, "profile": profile, "ranks": 1,
              "data": {"path": f"data/{name}", "synthetic": synthetic,
                       "synthetic_sequences": 32}}
             for name, profile, synthetic in (("eve", "jsoneq", "alpha"),
                                              ("honest", "local", "beta"))]
    spec: dict[str, Any] = {
        "name": name, "rounds": 2, "model": {"preset": "tiny-test"},
        "training": {"steps": 2, "batch_size": 2, "seq_len": 16, "lr": 0.01},
        "sites": sites}
    if lora:  # freeze_a, with adapters sent as bf16
        spec["training"]["lora"] = LORA
        spec["aggregation"] = {"strategy": "fedavg", "lora": "freeze_a"}
        spec["exchange"] = {"update": "weights", "dtype": "bf16"}
    return spec


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["model", "lora"])
def test_a_json_equal_config_never_becomes_the_globals(tmp_path: Path, xffl_home: Path,
                                                        lora: bool) -> None:
    profiles = tmp_path / "site_profiles"
    profiles.mkdir()
    wrapper = tmp_path / "jsoneq-python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {SCRIPT} \"$@\"\n")
    wrapper.chmod(0o755)
    (profiles / "jsoneq.yaml").write_text(yaml.safe_dump(
        {"name": "jsoneq", "python": str(wrapper), "launcher": "torchrun"}))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_spec("jsoneq-lora" if lora else "jsoneq", lora),
                                  sort_keys=False))

    result = runner.invoke(app, ["submit", str(job), "--wait", "--json", "--timeout", "300"])
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    assert status["state"] == "completed", status["message"]
    run_id, rounds = status["run_id"], Path(status["run_dir"]) / "rounds"
    name = ADAPTER_CONFIG_FILE if lora else CONFIG_FILE
    own = (rounds / "0" / "global" / name).read_bytes()
    for r in (1, 2):
        # eve's update was admitted with its floats (the attack happened, and was not a
        # rejection), and the global's config is the coordinator's bytes all the same
        sent = (rounds / str(r) / "updates" / "eve" / name).read_bytes()
        assert sent != own and json.loads(sent) == json.loads(own)
        assert "4.0" in sent.decode() if lora else '"num_hidden_layers": 2.0' in sent.decode()
        assert (rounds / str(r) / "global" / name).read_bytes() == own, r
        assert {s["site"]: s["state"] for s in status["rounds"][r - 1]["sites"]} == {
            "eve": "completed", "honest": "completed"}, status["rounds"][r - 1]
    # the honest site trained round 2 from round 1's global (not a kept update handed back)
    assert len(admitted(status, 2, "honest")) == 1 and not reused(status["run_dir"], 2)
    assert read_manifest(rounds / "2" / "updates" / "honest").parent == \
        read_manifest(rounds / "1" / "global").digest()

    out = tmp_path / "export"
    result = runner.invoke(app, ["export", run_id, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / name).read_bytes() == own
    import transformers

    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    if lora:
        from peft import PeftModel

        base = transformers.AutoModelForCausalLM.from_pretrained(str(rounds / "0" / "base"))
        model = PeftModel.from_pretrained(base, str(out))
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    with torch.no_grad():
        logits = model.eval()(input_ids=tokens).logits
    assert logits.shape[:2] == (2, 16) and torch.isfinite(logits).all()
