"""The provenance crate describes checkpoints and profiles; it copies neither.

The attack surface: `xffl provenance` zips what StreamFlow's run crate embeds. HEAD embedded
every file up to 1 MiB, so a small model's global and every site's update travelled in the
crate (a crate is made to be shared; updates can leak training data), and the embedded CWL
tools carried the profiles' ``env`` values (tokens, site paths). The quickstart's crate is
read back: no checkpoint file is in it, and every env variable keeps its name only.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import FinishedRun
from xffl.cli.app import app
from xffl.workflows.provenance import REDACTED, XFFL, redact_env

runner = CliRunner()


def test_the_crate_holds_no_checkpoint_and_no_env_value(
        quickstart_run: FinishedRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XFFL_HOME", str(quickstart_run.home))
    crate = tmp_path / "run.crate.zip"
    made = runner.invoke(app, ["provenance", quickstart_run.run_id, "-o", str(crate)])
    assert made.exit_code == 0, made.output
    with zipfile.ZipFile(crate) as zf:
        members = {i.filename: zf.read(i) for i in zf.infolist()}
    meta = json.loads(members["ro-crate-metadata.json"])
    names = {e["@id"]: " ".join(a) if isinstance(a := e.get("alternateName") or "", list)
             else str(a) for e in meta["@graph"]}
    embedded = {m: names.get(m) or m for m in members}
    # the run's checkpoints are described (their files are in the metadata) ...
    described = [n for n in names.values() if n.endswith("model.safetensors")]
    assert described, "the metadata names no checkpoint file"
    # ... but none of a checkpoint folder's files is in the zip, whatever its size
    for member, name in embedded.items():
        assert not name.endswith(("model.safetensors", "manifest.json")), member
        assert b'"data_offsets"' not in members[member][:1 << 16], member  # nor under a hash
    tools = [m for m in members if m.startswith("train_") and m.endswith(".cwl")]
    assert tools
    for tool in tools:
        env = yaml.safe_load(members[tool])["requirements"]["EnvVarRequirement"]["envDef"]
        assert env and set(env.values()) == {REDACTED}, env  # names kept, values left out
        entity = next(e for e in meta["@graph"] if e["@id"] == tool)
        assert entity["sha1"] == hashlib.sha1(members[tool], usedforsecurity=False).hexdigest()
    # each update carries its site's validation numbers, each global the federated loss
    # of the global its round started from, as the registry has them
    graph = {e["@id"]: e for e in meta["@graph"]}
    shown = json.loads(runner.invoke(app, ["status", quickstart_run.run_id, "--json"]).stdout)
    for rnd in shown["rounds"]:
        glob = graph[f"#xffl-global-r{rnd['round']}"]
        assert glob[f"{XFFL}incoming_val_loss"] == rnd["val_loss"]
        assert glob[f"{XFFL}val_tokens"] == rnd["val_tokens"]
        for site in rnd["sites"]:
            update = graph[f"#xffl-update-r{rnd['round']}-{site['site']}"]
            assert (update[f"{XFFL}val_loss"], update[f"{XFFL}val_tokens"]) == (
                site["val_loss"], site["val_tokens"])


def test_redact_env_both_cwl_forms() -> None:
    mapping = {"class": "CommandLineTool", "requirements": {"EnvVarRequirement": {
        "envDef": {"HF_TOKEN": "hf_s3cr3t", "DATA": "/scratch/alice"}}}}
    listed = {"class": "CommandLineTool", "hints": [{"class": "EnvVarRequirement", "envDef": [
        {"envName": "HF_TOKEN", "envValue": "hf_s3cr3t"}]}]}
    for doc in (mapping, listed):
        out = redact_env(yaml.safe_dump(doc).encode())
        assert b"s3cr3t" not in out and b"alice" not in out and b"HF_TOKEN" in out
    plain = yaml.safe_dump({"class": "Workflow", "steps": []}).encode()
    assert redact_env(plain) == plain
