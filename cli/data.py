"""`xffl data prepare`: turn a site's text files or examples into token shards."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from xffl.cli.common import (
    XfflCommand,
    XfflSubGroup,
    console,
    err_console,
    handle_errors,
    markup_safe,
    print_json,
)
from xffl.cli.options import JsonOpt, output_option
from xffl.core.errors import InvalidInput

app = typer.Typer(cls=XfflSubGroup, help="Prepare a site's training data (run it at the site).",
                  no_args_is_help=True)

FormatOpt = Literal["text", "instruction", "chat"]
TrainOnOpt = Literal["response", "prompt+response"]


def _check(inputs: list[Path], output: Path, force: bool, fraction: float | None,
           pack: bool, seq_len: int | None) -> None:
    """InvalidInput unless the inputs exist, DIR may be written and the options agree."""
    from xffl.training.prepare import check_inputs

    check_inputs(inputs, output, force, fraction)
    if not pack and seq_len is None:
        raise InvalidInput("--pad needs --seq-len N (the job's training.seq_len): each example "
                           "is padded to N + 1 tokens.")
    if seq_len is not None and seq_len < 1:
        raise InvalidInput(f"--seq-len must be a positive number of tokens (got {seq_len}).")


@app.command("prepare", cls=XfflCommand)
@handle_errors
def prepare(
    inputs: Annotated[list[Path], typer.Argument(
        metavar="INPUT...", help="Text files (.txt), or examples: .jsonl, .json, .parquet, "
        ".csv files or datasets save_to_disk folders, read in this order.")],
    output: Annotated[Path, output_option("Token-shard folder to create.")],
    tokenizer: Annotated[Path | None, typer.Option(
        help="A model folder (its tokenizer and chat template) or a tokenizer.json "
        "(default: byte-level, 256 tokens).")] = None,
    format: Annotated[FormatOpt, typer.Option(
        "--format", help="What an example holds: text (one field), instruction (prompt and "
        "response fields) or chat (a list of role/content messages).")] = "text",
    text_field: Annotated[str, typer.Option(help="--format text: the text's field.")] = "text",
    instruction_field: Annotated[str, typer.Option(
        help="--format instruction: the instruction's field.")] = "instruction",
    input_field: Annotated[str, typer.Option(
        help="--format instruction: the optional input's field.")] = "input",
    response_field: Annotated[str, typer.Option(
        help="--format instruction: the response's field.")] = "output",
    messages_field: Annotated[str, typer.Option(
        help="--format chat: the messages' field.")] = "messages",
    train_on: Annotated[TrainOnOpt, typer.Option(
        help="Which tokens of an instruction or chat example the loss counts.")] = "response",
    pack: Annotated[bool, typer.Option(
        "--pack/--pad", help="Pack examples into one stream (positions restart at each "
        "example), or pad each to --seq-len + 1 tokens.")] = True,
    seq_len: Annotated[int | None, typer.Option(
        metavar="N", help="--pad: the job's training.seq_len.")] = None,
    eos: Annotated[str | None, typer.Option(
        help="Special token of the tokenizer to put after each file (text) or example.")] = None,
    force: Annotated[bool, typer.Option(help="Replace a non-empty DIR.")] = False,
    validation_fraction: Annotated[float | None, typer.Option(
        metavar="F", help="Hold out F (0 < F < 1) in DIR/validation: of text files, the last F "
        "of each, cut at a line start; of examples, each with probability F (by --seed).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the examples' validation draw.")] = 0,
    max_bad: Annotated[int | None, typer.Option(
        "--max-bad", metavar="N", min=0, help="Skip up to N bad examples (a line that is not "
        "JSON, a field missing or of the wrong type), each reported by file, line and field "
        "and counted in meta.json's skipped; the N + 1st stops (default: the first stops).")
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Tokenize text files or examples into train.bin + meta.json, what a job's data.path names.

    Example: xffl data prepare corpus/*.txt -o /scratch/me/xffl-data --tokenizer tokenizer.json

    Example: xffl data prepare chats.jsonl --format chat --tokenizer MODEL_DIR -o DIR

    Example: xffl data prepare chats.jsonl --format chat --tokenizer MODEL_DIR -o DIR --max-bad 10
    """
    from xffl.training.prepare import prepare as run_prepare
    from xffl.training.prepare_examples import Options, prepare_examples
    from xffl.training.render import Fields

    _check(inputs, output, force, validation_fraction, pack, seq_len)
    texts = all(p.is_file() and p.suffix.lower() == ".txt" for p in inputs)
    if texts and format == "text" and pack:
        if max_bad is not None:
            raise InvalidInput("--max-bad skips bad examples of .jsonl, .json, .parquet, .csv "
                               "or datasets inputs; text files hold none: leave it out.")
        meta = run_prepare(inputs, output, tokenizer=tokenizer, eos=eos, force=force,
                           validation_fraction=validation_fraction)
    else:
        for src in inputs:
            if src.is_file() and src.suffix.lower() == ".txt":
                raise InvalidInput(f"{src}: a text file among examples (or with --pad); "
                                   "prepare .txt files on their own, --format text --pack.")
        fields = Fields(text_field, instruction_field, input_field, response_field,
                        messages_field)
        meta = prepare_examples(inputs, output, tokenizer, eos, Options(
            format, fields, train_on, None if pack else seq_len, validation_fraction, seed,
            max_bad), on_skip=_skipped)
    _report(meta, output, json_out, max_bad)


def _skipped(message: str) -> None:
    """Report one bad example left out (on stderr: --json keeps stdout for the summary)."""
    err_console.print(f"[yellow]skipped:[/yellow] {markup_safe(message)}", soft_wrap=True)


def _report(meta: dict[str, Any], output: Path, json_out: bool, max_bad: int | None) -> None:
    """The summary of what was written: JSON, or a few lines."""
    held = meta.get("validation")
    summary = {"out": str(output), "num_tokens": meta["num_tokens"],
               "loss_tokens": meta.get("loss_tokens", meta["num_tokens"]),
               "examples": meta.get("examples"),
               "vocab_size": meta["vocab_size"], "dtype": meta["dtype"],
               "inputs": len(meta["sources"]),
               "validation_tokens": None if held is None else held["num_tokens"],
               "skipped": meta["skipped"]["count"] if "skipped" in meta else None,
               "files": sorted(str(f) for f in output.iterdir() if f.is_file())}
    if json_out:
        print_json(summary)
        return
    examples = "" if meta.get("examples") is None else f", {meta['examples']} examples"
    console.print(f"wrote {summary['num_tokens']} tokens ({summary['loss_tokens']} in the loss"
                  f"{examples}; {summary['dtype']}, vocabulary {summary['vocab_size']}) from "
                  f"{summary['inputs']} input(s) to {output}", soft_wrap=True)
    if meta.get("layout") == "packed" and meta.get("examples") is not None:
        console.print("packed: a job reads the examples as windows of training.seq_len + 1 "
                      "tokens, the sequences `xffl status` counts", soft_wrap=True)
    if meta.get("truncated"):
        console.print(f"cut {meta['truncated']} example(s) longer than --seq-len + 1 tokens",
                      soft_wrap=True)
    if "skipped" in meta:
        console.print(f"skipped {meta['skipped']['count']} bad example(s) of at most "
                      f"{max_bad} (--max-bad), counted in {output / 'meta.json'}",
                      soft_wrap=True)
    if held is not None:
        console.print(f"held out {held['num_tokens']} tokens in {output / held['path']}",
                      soft_wrap=True)
