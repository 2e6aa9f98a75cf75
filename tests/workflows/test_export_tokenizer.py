"""`xffl export` of a whole model writes the job's tokenizer and chat template beside it:
transformers loads, renders and generates from the folder alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import QUICKSTART
from xffl.core.errors import InvalidInput
from xffl.core.layout import RunLayout
from xffl.jobs.spec.schema import JobSpec
from xffl.training.checkpoint import init_global
from xffl.training.sft_demo import write_tokenizer
from xffl.workflows.export import export_global, tokenizer_source

CHAT = [{"role": "user", "content": "reverse the words\n\nban kol"}]


def _run(tmp_path: Path, **model: str) -> RunLayout:
    """A run directory of the quickstart's job (its model's fields set to ``model``) with its
    round-0 global: what export reads."""
    doc = yaml.safe_load(QUICKSTART.read_text())
    doc["model"].update(model)
    layout = RunLayout(tmp_path / "run")
    layout.job_json.parent.mkdir(parents=True)
    spec = JobSpec.model_validate(doc)
    layout.job_json.write_text(spec.model_dump_json())
    init_global("run-test", spec.model, 0, layout.global_dir(0))
    return layout


def test_a_whole_model_export_carries_the_tokenizer(tmp_path: Path) -> None:
    """model.tokenizer's tokenizer and chat template come along: the export's renders the
    same ids as the source, and its model generates with them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok_dir = write_tokenizer(tmp_path / "tok")
    layout = _run(tmp_path, tokenizer=str(tok_dir))
    assert tokenizer_source(layout) == tok_dir
    out = tmp_path / "export"
    files = export_global(layout, 0, out, tokenizer=tokenizer_source(layout))
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(files)
    source, exported = AutoTokenizer.from_pretrained(str(tok_dir)), \
        AutoTokenizer.from_pretrained(str(out))
    ids = exported.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    assert ids == source.apply_chat_template(CHAT, add_generation_prompt=True,
                                             return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    with torch.no_grad():
        new = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False,
                             pad_token_id=exported.pad_token_id)[0, len(ids):]
    assert 1 <= len(new) <= 3


def test_without_a_tokenizer_the_export_is_the_model_alone(tmp_path: Path) -> None:
    """A preset job without model.tokenizer: nothing to write; a tokenizer folder that is
    gone is refused before anything is written."""
    layout = _run(tmp_path)
    assert tokenizer_source(layout) is None
    files = export_global(layout, 0, tmp_path / "plain")
    assert files == ["config.json", "model.safetensors"]
    with pytest.raises(InvalidInput, match=r"tokenizer folder .* is gone"):
        export_global(layout, 0, tmp_path / "gone", tokenizer=tmp_path / "nowhere")
    assert not (tmp_path / "gone").exists()
    assert json.loads(layout.job_json.read_text())["model"]["tokenizer"] is None
