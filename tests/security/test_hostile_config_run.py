"""A real 1-round LoRA run whose one site sends its adapter_config.json as other bytes of the
same JSON value.

Site "eve" trains honestly, then rewrites its update's ``adapter_config.json`` with every
integer as a float (``"r": 4.0``) and the right checksum (tests/security/json_equal_site.py):
equal to the global's as a JSON value, so it is admitted, but not loadable by peft. Eve's is
the round's only update, so it is both the first and the last: were either's bytes written
as the global's (as before the coordinator wrote its own), the global would carry eve's
floats, and no site could load it for round 2 (an honest second site, sorted after eve,
caught only the first; it cost a second trainer). The run must write the global's config
from the coordinator's own bytes (round 0's, which peft loads: the export below), and
export an adapter peft loads. One round is enough: every round's global is written by the
same aggregate step, and a round 2 would load exactly the bytes checked here (a real round 2
from a global written by the coordinator: the FedAdam run of tests/workflows/test_wiring.py).
The whole-model case (``config.json`` with ``2.0`` for ``2``, which transformers cannot
load) is folded into that FedAdam run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from typer.testing import CliRunner

from tests.security.json_equal_site import write_profile
from xffl.aggregator.shards import ADAPTER_CONFIG_FILE
from xffl.cli.app import app

runner = CliRunner()
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _spec() -> dict[str, Any]:
    sites = [{"name": "eve", "profile": "jsoneq", "ranks": 1,
              "data": {"path": "data/eve", "synthetic": "alpha", "synthetic_sequences": 32}}]
    return {"name": "jsoneq-lora", "rounds": 1, "model": {"preset": "tiny-test"},
            "training": {"steps": 2, "batch_size": 2, "seq_len": 16, "lr": 0.01, "lora": LORA},
            # freeze_a, with the adapters sent as bf16
            "aggregation": {"strategy": "fedavg", "lora": "freeze_a"},
            "exchange": {"update": "weights", "dtype": "bf16"}, "sites": sites}


@pytest.mark.slow
def test_a_json_equal_adapter_config_never_becomes_the_globals(tmp_path: Path,
                                                               xffl_home: Path) -> None:
    profiles = tmp_path / "site_profiles"
    profiles.mkdir()
    write_profile(profiles)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_spec(), sort_keys=False))

    result = runner.invoke(app, ["submit", str(job), "--wait", "--json", "--timeout", "300"])
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    assert status["state"] == "completed", status["message"]
    run_id, rounds = status["run_id"], Path(status["run_dir"]) / "rounds"
    name = ADAPTER_CONFIG_FILE
    own = (rounds / "0" / "global" / name).read_bytes()
    # eve's update was admitted with its floats (the attack happened, and was not a
    # rejection), and the global's config is the coordinator's bytes all the same
    sent = (rounds / "1" / "updates" / "eve" / name).read_bytes()
    assert sent != own and json.loads(sent) == json.loads(own)
    assert '"r": 4.0' in sent.decode()
    assert (rounds / "1" / "global" / name).read_bytes() == own
    assert {s["site"]: s["state"] for s in status["rounds"][0]["sites"]} == {
        "eve": "completed"}, status["rounds"][0]

    out = tmp_path / "export"
    result = runner.invoke(app, ["export", run_id, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / name).read_bytes() == own
    import transformers
    from peft import PeftModel

    def base() -> torch.nn.Module:
        return transformers.AutoModelForCausalLM.from_pretrained(str(rounds / "0" / "base"))
    # what eve sent is what peft cannot load: had its bytes become the global's, the export
    # would be refused the same way
    with pytest.raises(TypeError, match="tuple of ints"):
        PeftModel.from_pretrained(base(), str(rounds / "1" / "updates" / "eve"))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model = PeftModel.from_pretrained(base(), str(out)).eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    assert logits.shape[:2] == (2, 16) and torch.isfinite(logits).all()
