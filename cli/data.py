"""`xffl data prepare`: turn a site's text files into token shards."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from xffl.cli.common import (
    JsonOpt,
    XfflCommand,
    XfflSubGroup,
    console,
    handle_errors,
    output_option,
    print_json,
)

app = typer.Typer(cls=XfflSubGroup, help="Prepare a site's training data (run it at the site).",
                  no_args_is_help=True)


@app.command("prepare", cls=XfflCommand)
@handle_errors
def prepare(
    texts: Annotated[list[Path], typer.Argument(
        metavar="TEXT...", help="Text files, tokenized in this order.")],
    output: Annotated[Path, output_option("Token-shard directory to create.")],
    tokenizer: Annotated[Path | None, typer.Option(
        help="A Hugging Face tokenizer.json (default: byte-level, 256 tokens).")] = None,
    eos: Annotated[str | None, typer.Option(
        help="Special token of the tokenizer to put after each file, e.g. '</s>'.")] = None,
    force: Annotated[bool, typer.Option(help="Replace a non-empty output directory.")] = False,
    validation_fraction: Annotated[float | None, typer.Option(
        metavar="F", help="Hold out the last F (0 < F < 1) of every file, cut at a line "
        "start, as token shards in OUT/validation.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Tokenize text files into train.bin + meta.json, the format a job's data.path names.

    Example: xffl data prepare corpus/*.txt -o /scratch/me/xffl-data --tokenizer tokenizer.json
    """
    from xffl.training.prepare import prepare as run_prepare

    meta = run_prepare(texts, output, tokenizer=tokenizer, eos=eos, force=force,
                       validation_fraction=validation_fraction)
    held = meta.get("validation")
    summary = {"out": str(output), "num_tokens": meta["num_tokens"],
               "vocab_size": meta["vocab_size"], "dtype": meta["dtype"],
               "inputs": len(meta["sources"]),
               "validation_tokens": None if held is None else held["num_tokens"],
               "files": sorted(str(f) for f in output.iterdir() if f.is_file())}
    if json_out:
        print_json(summary)
    else:
        console.print(f"wrote {summary['num_tokens']} tokens ({summary['dtype']}, vocabulary "
                      f"{summary['vocab_size']}) from {summary['inputs']} file(s) to {output}",
                      soft_wrap=True)  # a path is never cut into lines
        if held is not None:
            console.print(f"held out {held['num_tokens']} tokens in {output / held['path']}",
                          soft_wrap=True)
