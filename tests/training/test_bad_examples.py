"""`xffl data prepare --max-bad N`: bad chat examples reported, skipped and counted, or a stop
naming the first N + 1."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tests.cli.schemas import check
from tests.training.test_prepare_examples import CHATS, word_tokenizer
from xffl.cli.app import app
from xffl.training.data import load_flags, load_tokens, read_meta

runner = CliRunner()


def _inputs(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """A chat JSON-lines file with three different bad lines among the good ones, the same
    file with the good lines only, and what each bad line's report must say (in order)."""
    good = [json.dumps({"messages": m}) for m in CHATS]
    bad = ['{"messages": [{"role": "user", "content": "a"}',  # cut: not JSON
           json.dumps({"conversation": CHATS[0]}),  # the messages under another field
           json.dumps({"messages": [{"role": "bot", "content": "a"},
                                    {"role": "assistant", "content": "b"}]})]
    mixed = tmp_path / "chats.jsonl"
    mixed.write_text("\n".join([good[0], bad[0], good[1], bad[1], bad[2], good[2]]) + "\n")
    clean = tmp_path / "clean.jsonl"
    clean.write_text("\n".join(good) + "\n")
    says = [f"{mixed}: line 2: not JSON",
            f"{mixed}: line 4: field 'messages' is missing",
            f"{mixed}: line 5: field 'messages[0].role': unknown role 'bot'"]
    return mixed, clean, says


def _prepare(src: Path, out: Path, tok: Path, *extra: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["data", "prepare", str(src), "--format", "chat",
                                 "--tokenizer", str(tok), "-o", str(out), *extra])
    return result.exit_code, result.stdout, result.stderr


def test_max_bad_skips_reports_and_counts_each_bad_example(tmp_path: Path) -> None:
    """--max-bad 3 of a file with 3 bad lines: each reported on stderr by file, line and
    field; the shards are those of the good lines alone (the same tokens and flags, bit for
    bit); meta.json and --json count the 3."""
    tok = word_tokenizer(tmp_path / "tok")
    mixed, clean, says = _inputs(tmp_path)
    code, _, err = _prepare(mixed, tmp_path / "out", tok, "--max-bad", "3")
    assert code == 0, err
    skipped = [line for line in err.splitlines() if line.startswith("skipped: ")]
    assert len(skipped) == 3, err
    for line, words in zip(skipped, says, strict=True):
        assert line.startswith(f"skipped: {words}"), (line, words)
    meta = read_meta(tmp_path / "out")
    assert meta["skipped"]["count"] == 3 and meta["examples"] == 3
    assert [m.split(": ", 2)[1] for m in meta["skipped"]["first"]] == \
        ["line 2", "line 4", "line 5"]
    assert _prepare(clean, tmp_path / "ref", tok)[0] == 0
    ref = read_meta(tmp_path / "ref")
    assert "skipped" not in ref  # without --max-bad meta.json is what it was
    assert load_tokens(tmp_path / "out").tolist() == load_tokens(tmp_path / "ref").tolist()
    flags = load_flags(tmp_path / "out", meta["num_tokens"])
    ref_flags = load_flags(tmp_path / "ref", ref["num_tokens"])
    assert flags is not None and ref_flags is not None
    assert flags.tolist() == ref_flags.tolist()
    code, out, err = _prepare(mixed, tmp_path / "j", tok, "--max-bad", "5", "--json")
    assert code == 0, err
    assert check("data-prepare", json.loads(out))["skipped"] == 3
    assert err.count("skipped: ") == 3


def test_more_bad_examples_than_max_bad_stop_naming_the_first_n_plus_1(tmp_path: Path) -> None:
    """--max-bad 2 of 3 bad lines: exit 2, every one of the 3 named, nothing written."""
    tok = word_tokenizer(tmp_path / "tok")
    mixed, _, says = _inputs(tmp_path)
    code, _, err = _prepare(mixed, tmp_path / "out", tok, "--max-bad", "2")
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors[0] == ("error: more than 2 bad examples (--max-bad 2): fix them, or raise "
                         "--max-bad; the first 3:")
    assert len(errors) == 4, err
    for line, words in zip(errors[1:], says, strict=True):
        assert line.startswith(f"error: {words}"), (line, words)
    assert not (tmp_path / "out").exists()


def test_the_default_stops_at_the_first_and_names_max_bad(tmp_path: Path) -> None:
    """No --max-bad: the first bad line stops it, as before, and the line says --max-bad."""
    tok = word_tokenizer(tmp_path / "tok")
    mixed, _, says = _inputs(tmp_path)
    code, _, err = _prepare(mixed, tmp_path / "out", tok)
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: {says[0]}") and line.endswith(
        "; or pass --max-bad N to skip and count up to N bad examples."), line
    assert not (tmp_path / "out").exists()


def test_an_input_of_only_bad_examples_is_refused(tmp_path: Path) -> None:
    """Skipping every example of an input leaves nothing of it: refused, saying so."""
    tok = word_tokenizer(tmp_path / "tok")
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "a"}\n{"text": "b"}\n')
    code, _, err = _prepare(src, tmp_path / "out", tok, "--max-bad", "5")
    assert code == 2, err
    assert err.strip().splitlines()[-1] == (
        f"error: {src}: every example of it is bad (2 skipped); fix the file, or the --format "
        "and field options.")


def test_max_bad_of_text_files_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "a.txt"
    src.write_text("hello\n")
    result = runner.invoke(app, ["data", "prepare", str(src), "-o", str(tmp_path / "out"),
                                 "--max-bad", "1"])
    assert result.exit_code == 2
    assert "--max-bad skips bad examples" in result.stderr
