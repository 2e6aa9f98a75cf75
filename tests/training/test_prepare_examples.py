"""`xffl data prepare` of instruction and chat examples: the model's template, the mask, inputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from xffl.cli.app import app
from xffl.core.errors import InvalidInput
from xffl.training.data import LOSS, START, TokenShards, load_flags, load_tokens, read_meta
from xffl.training.prepare_examples import SPLIT_SALT, Options, prepare_examples
from xffl.training.render import ALPACA_PROMPT

runner = CliRunner()
WORDS = ["hello", "world", "a", "b", "c", "say", "reverse", "the", "words", "ok", "sure"]
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHATS = [
    [{"role": "user", "content": "say hello world"},
     {"role": "assistant", "content": "hello world"}],
    [{"role": "system", "content": "reverse the words"}, {"role": "user", "content": "a b c"},
     {"role": "assistant", "content": "c b a"}, {"role": "user", "content": "b a"},
     {"role": "assistant", "content": "a b ok"}],
    [{"role": "user", "content": "sure"}, {"role": "assistant", "content": "ok sure"}],
]
INSTRUCTIONS = [{"instruction": "say hello", "input": "a b", "output": "hello a b"},
                {"instruction": "reverse the words", "input": "", "output": "ok"},
                {"instruction": "say the words", "output": "the words"}]  # no input field


def word_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer (split at whitespace) with a Zephyr-style chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = [*SPECIALS, "<|system|>", "<|user|>", "<|assistant|>", *WORDS]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", bos_token="<s>")
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> "
                         "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
    tok.save_pretrained(str(folder))
    return folder


def bpe_tokenizer(folder: Path) -> Path:
    """A byte-level BPE tokenizer trained here, with a ChatML template (system first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([" ".join(WORDS) * 3, "system user assistant\n"], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                  pad_token="<|im_end|>")
    tok.chat_template = (
        "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou help.<|im_end|>\n"
        "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% endif %}")
    tok.save_pretrained(str(folder))
    return folder


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _expected_mask(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    """Response tokens by another rule: token counts of rendered prefixes (whole tokens)."""
    ids = tok.apply_chat_template(messages, return_dict=False)
    mask = [0] * len(ids)
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            start = len(tok.apply_chat_template(messages[:k], add_generation_prompt=True,
                                                return_dict=False)) if k else 0
            end = len(tok.apply_chat_template(messages[:k + 1], return_dict=False))
            mask[start:end] = [1] * (end - start)
    return mask


@pytest.mark.parametrize("make", [word_tokenizer, bpe_tokenizer])
def test_chat_and_instruction_ids_are_the_templates(tmp_path: Path, make: Any) -> None:
    """Stored ids == tokenizer.apply_chat_template(...), example after example, for two
    tokenizers of different templates; LOSS marks exactly the assistant turns' tokens (their
    end-of-turn included), START each example's first token."""
    from transformers import AutoTokenizer

    folder = make(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(folder))
    conversations = {
        "chat": CHATS,
        "instruction": [[{"role": "user", "content": r["instruction"] + (
            f"\n\n{r['input']}" if r.get("input") else "")},
            {"role": "assistant", "content": r["output"]}] for r in INSTRUCTIONS],
    }
    for fmt, records in (("chat", [{"messages": m} for m in CHATS]),
                         ("instruction", INSTRUCTIONS)):
        out = tmp_path / fmt
        prepare_examples([_jsonl(tmp_path / f"{fmt}.jsonl", records)], out, folder, None,
                         Options(fmt=fmt))  # type: ignore[arg-type]
        ids, flags = load_tokens(out), load_flags(out, read_meta(out)["num_tokens"])
        assert flags is not None
        expected_ids: list[int] = []
        expected_flags: list[int] = []
        for messages in conversations[fmt]:
            one = tok.apply_chat_template(messages, return_dict=False)
            mask = _expected_mask(tok, messages)
            expected_ids += one
            expected_flags += [START] + [LOSS * m for m in mask[1:]]
        assert ids.tolist() == expected_ids, fmt
        assert flags.tolist() == expected_flags, fmt
        assert read_meta(out)["loss_tokens"] == sum(f == LOSS for f in expected_flags) > 0
        assert (out / "tokenizer" / "tokenizer.json").is_file()


def test_instruction_without_a_template_is_alpacas_prompt(tmp_path: Path) -> None:
    """A tokenizer.json has no template: Alpaca's prompt, then the response and --eos, which
    alone are in the loss."""
    from tokenizers import Tokenizer

    tok_file = word_tokenizer(tmp_path / "tok") / "tokenizer.json"
    prepare_examples([_jsonl(tmp_path / "i.jsonl", INSTRUCTIONS[:1])], tmp_path / "out",
                     tok_file, "</s>", Options(fmt="instruction"))
    backend = Tokenizer.from_file(str(tok_file))
    prompt = ALPACA_PROMPT.format(instruction="say hello", input="a b")
    ids = backend.encode(prompt + "hello a b</s>", add_special_tokens=False).ids
    response = backend.encode("hello a b</s>", add_special_tokens=False).ids
    assert load_tokens(tmp_path / "out").tolist() == ids
    flags = load_flags(tmp_path / "out", len(ids))
    assert flags is not None
    assert flags.tolist() == [START] + [0] * (len(ids) - len(response) - 1) + [LOSS] * 4
    whole = prepare_examples([tmp_path / "i.jsonl"], tmp_path / "all", tok_file, "</s>",
                             Options(fmt="instruction", train_on="prompt+response"))
    assert whole["loss_tokens"] == len(ids) - 1  # all but the first (nothing predicts it)


def _write_all_kinds(tmp_path: Path, records: list[dict[str, Any]]) -> list[Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = _jsonl(tmp_path / "x.jsonl", records)
    array = tmp_path / "x.json"
    array.write_text(json.dumps(records, indent=1))
    table = pa.Table.from_pylist(records)
    pq.write_table(table, tmp_path / "x.parquet", row_group_size=2)
    csv = tmp_path / "x.csv"
    csv.write_text("instruction,input,output\n" + "".join(
        f'"{r["instruction"]}","{r["input"]}","{r["output"]}"\n' for r in records))
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "x-ds"))
    return [jsonl, array, tmp_path / "x.parquet", csv, tmp_path / "x-ds"]


def test_every_input_kind_gives_the_same_shards(tmp_path: Path) -> None:
    records = [{"instruction": "say", "input": " ".join(WORDS[i % 5:i % 5 + 3]),
                "output": WORDS[i % 7]} for i in range(11)]
    folder = word_tokenizer(tmp_path / "tok")
    results = []
    for i, src in enumerate(_write_all_kinds(tmp_path, records)):
        out = tmp_path / f"out{i}"
        meta = prepare_examples([src], out, folder, None, Options(fmt="instruction"))
        assert meta["examples"] == 11, src
        results.append(((out / "train.bin").read_bytes(), (out / "flags.bin").read_bytes()))
    assert all(r == results[0] for r in results[1:])


def test_validation_is_a_seeded_draw_of_examples(tmp_path: Path) -> None:
    """Each example is held out iff its draw from the seeded generator is below F: the same
    examples every time, others under another seed, and every example on one side."""
    records = [{"text": " ".join(WORDS[: 1 + i % 9])} for i in range(200)]
    src = _jsonl(tmp_path / "t.jsonl", records)
    runs = [prepare_examples([src], tmp_path / name, None, None,
                             Options(validation_fraction=0.25, seed=seed))
            for name, seed in (("a", 0), ("b", 0), ("c", 1))]
    held = int(np.count_nonzero(np.random.default_rng([SPLIT_SALT, 0]).random(200) < 0.25))
    assert runs[0]["validation"]["examples"] == held and runs[0]["examples"] == 200 - held
    assert (tmp_path / "a" / "validation" / "train.bin").read_bytes() == \
        (tmp_path / "b" / "validation" / "train.bin").read_bytes()
    assert (tmp_path / "a" / "validation" / "train.bin").read_bytes() != \
        (tmp_path / "c" / "validation" / "train.bin").read_bytes()
    total = sum(len(" ".join(WORDS[: 1 + i % 9]).encode()) for i in range(200))
    assert runs[0]["num_tokens"] + runs[0]["validation"]["num_tokens"] == total


def test_padded_examples_are_one_window_each(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "i.jsonl", INSTRUCTIONS * 3)
    meta = prepare_examples([src], tmp_path / "p", None, None,
                            Options(fmt="instruction", seq_len=48))
    assert meta["layout"] == "padded" and meta["num_tokens"] == 9 * 49
    assert meta["truncated"] == 9  # Alpaca's prompt alone is longer than 49 bytes
    shards = TokenShards(tmp_path / "p", 48)
    assert len(shards) == 9 and shards.positions(np.arange(9)) is None
    flags = load_flags(tmp_path / "p", meta["num_tokens"])
    assert flags is not None and flags.reshape(9, 49)[:, 0].tolist() == [START] * 9
    with pytest.raises(InvalidInput, match="padded to seq_len 48"):
        TokenShards(tmp_path / "p", 64)


CHAT_OK = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
BAD = [  # (file name, content, format, what the one line must name)
    ("bad.jsonl", b'{"text": "a"}\n{"text": "b"\n', "text", ["line 2", "not JSON"]),
    ("bad.jsonl", b'{"text": "a"}\n{"other": "b"}\n', "text", ["line 2", "field 'text'"]),
    ("bad.jsonl", b'{"text": 3}\n', "text", ["line 1", "field 'text'", "not a string"]),
    ("bad.jsonl", json.dumps({"instruction": "a", "output": None}).encode() + b"\n",
     "instruction", ["line 1", "field 'output'"]),
    ("bad.jsonl", (json.dumps(CHAT_OK) + "\n" + json.dumps({"messages": [
        {"role": "bot", "content": "x"}]}) + "\n").encode(), "chat",
     ["line 2", "field 'messages[0].role'", "unknown role 'bot'"]),
    ("bad.jsonl", b'{"text": "a"}\n{"text": "\xff\xfe"}\n', "text", ["line 2", "not UTF-8"]),
    ("bad.jsonl", b"", "text", ["no example"]),
    ("bad.csv", b"text\nfine\n\xff\n", "text", ["row", "not UTF-8"]),
    ("bad.json", b'[{"text": "a"}, 3]', "text", ["element 2", "not an object"]),
    # nested 100,000 deep: Python's parser raised RecursionError, printed as an internal error
    ("deep.jsonl", b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "text",
     ["line 1", "nested too deep"]),
    ("deep.json", b'[{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]", "text",
     ["element 1", "nested too deep"]),
]


@pytest.mark.parametrize(("name", "content", "fmt", "says"), BAD)
def test_bad_examples_exit_2_with_one_line(tmp_path: Path, name: str, content: bytes, fmt: str,
                                           says: list[str]) -> None:
    """One line naming the file, the line (or row) and the field; exit 2; nothing written."""
    src = tmp_path / name
    src.write_bytes(content)
    tok = ["--tokenizer", str(word_tokenizer(tmp_path.parent / f"{tmp_path.name}-tok"))] \
        if fmt == "chat" else []
    result = runner.invoke(app, ["data", "prepare", str(src), "--format", fmt, "-o",
                                 str(tmp_path / "out"), *tok])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {src}: "), lines
    for words in says:
        assert words in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no output, no staging


def test_chat_needs_a_template(tmp_path: Path) -> None:
    tok_file = word_tokenizer(tmp_path / "tok") / "tokenizer.json"
    src = _jsonl(tmp_path / "c.jsonl", [CHAT_OK])
    result = runner.invoke(app, ["data", "prepare", str(src), "--format", "chat",
                                 "--tokenizer", str(tok_file), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert line == (f"error: {src}: line 1: field 'messages': the tokenizer has no chat "
                    "template to render messages with; pass --tokenizer a model folder whose "
                    "tokenizer has one.")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_template_that_refuses_a_conversation_is_one_line(tmp_path: Path) -> None:
    """A template's own raise_exception (roles must alternate) names the line and field."""
    folder = word_tokenizer(tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('user first') }}"
        "{% endif %}" + template)
    assert config  # the folder is a transformers tokenizer with its template beside it
    src = _jsonl(tmp_path / "c.jsonl", [CHAT_OK, {"messages": [
        {"role": "assistant", "content": "a"}]}])
    result = runner.invoke(app, ["data", "prepare", str(src), "--format", "chat",
                                 "--tokenizer", str(folder), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (f"error: {src}: line 2: field 'messages': the chat "
                                     "template refused the conversation (user first); or "
                                     "pass --max-bad N to skip and count up to N bad "
                                     "examples.")
    assert not (tmp_path / "out").exists()


def test_a_json_array_is_read_across_reads(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Elements, and UTF-8 characters, cut by the reads of 7 bytes are read whole."""
    from xffl.training import sources

    monkeypatch.setattr(sources, "READ_BYTES", 7)
    records = [{"text": "é" * (i % 5) + "ü", "n": i} for i in range(50)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    assert [r for _, r in sources.examples(path)] == records
    path.write_text(json.dumps(records)[:-1])
    with pytest.raises(InvalidInput, match="element 51: the array is not closed"):
        list(sources.examples(path))


def _bytes_read() -> int:
    """The bytes this process has read through read(2) and its kin so far (Linux's rchar)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_a_malformed_first_element_is_refused_without_reading_on(tmp_path: Path) -> None:
    """A 64 MiB array whose first element is malformed mid-way: refused from the first read
    (1 MiB), not after reading (and re-parsing) the rest of the file, as HEAD did.

    Bound: the reader reads 1 MiB at a time, so a refusal from the first read costs about
    1 MiB (and Python's own imports nothing here, all done); HEAD read the whole 64 MiB. 8 MiB
    leaves room for what pytest reads meanwhile and fails HEAD by 56 MiB."""
    from xffl.training import sources

    path = tmp_path / "a.json"
    element = json.dumps({"text": "x" * 1000}) + ", "
    with path.open("w") as fh:
        fh.write('[{"text": "a", oops}, ')
        for _ in range((64 << 20) // len(element) + 1):
            fh.write(element)
        fh.write('{"text": "end"}]')
    assert path.stat().st_size >= 64 << 20
    before = _bytes_read()
    with pytest.raises(InvalidInput, match=r"element 1: not JSON \(Expecting property name"):
        list(sources.examples(path))
    assert _bytes_read() - before < 8 << 20
