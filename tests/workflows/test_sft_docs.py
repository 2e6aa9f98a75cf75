"""docs/sft.md runs as written: chat JSON lines, `data prepare`, the sft-lora job, `export
--merge`, and transformers generating from the export folder alone."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.conftest import REPO
from xffl.cli.app import app

runner = CliRunner()
PAGE = REPO / "docs" / "sft.md"


def blocks(markdown: str) -> list[tuple[str, str]]:
    """The page's bash and python blocks, in order, as (language, text)."""
    return re.findall(r"```(bash|python)\n(.*?)```", markdown, flags=re.S)


def test_the_page_has_the_walk_in_order() -> None:
    """Every step is a block the slow test below runs: init, the chats, prepare, validate,
    submit, export --merge, generate."""
    steps = [text.split()[0] + " " + text.split()[1] for _, text in blocks(PAGE.read_text())]
    assert steps == ["xffl init", "import json", "xffl data", "xffl validate",
                     "xffl export", "from transformers"], steps


@pytest.mark.slow
def test_the_sft_page_runs_from_chat_lines_to_generation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each xffl command of the page through the CLI (exit 0), each Python block executed,
    in the page's order, in a fresh folder. Then: the chat-prepared shards are the tokens
    and flags `xffl init` prepared from the same examples as instructions (the page says
    so); the merged export's tokenizer renders a conversation to the very ids the job's
    tokenizer does (its chat template came along); the export loads in
    AutoModelForCausalLM and generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.chdir(tmp_path)
    init_shards: dict[str, bytes] = {}
    scope: dict[str, Any] = {}
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
                init_shards = {f"{s}/{f}": (tmp_path / "demo" / "data" / s / f).read_bytes()
                               for s in ("alpha", "beta")
                               for f in ("train.bin", "flags.bin", "validation/train.bin")}
            done = runner.invoke(app, argv[1:])
            assert done.exit_code == 0, (line, done.output)
    data = tmp_path / "demo" / "data"
    for name, content in init_shards.items():
        assert (data / name).read_bytes() == content, name

    merged = tmp_path / "demo" / "merged"
    source = AutoTokenizer.from_pretrained(str(data / "tokenizer"))
    exported = AutoTokenizer.from_pretrained(str(merged))
    chat = [{"role": "user", "content": "copy the words and count them\n\nban kol"},
            {"role": "assistant", "content": "ban kol two"}, {"role": "user", "content": "mit"}]
    for prompt in (True, False):
        assert exported.apply_chat_template(chat, add_generation_prompt=prompt,
                                            return_dict=False) == \
            source.apply_chat_template(chat, add_generation_prompt=prompt, return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(str(merged))
    assert type(scope["model"]) is type(model)
    generated = scope["out"][0, scope["prompt"]["input_ids"].shape[1]:]
    assert 1 <= len(generated) <= 8 and int(generated.max()) < len(source)
    assert isinstance(scope["reply"], str)
