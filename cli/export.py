"""`xffl export`: a run's global model as a plain Hugging Face checkpoint or peft adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from xffl.cli.common import console, err_console, handle_errors, print_json, resolve_run
from xffl.cli.options import JsonOpt, RunArg, output_option
from xffl.core.errors import InvalidInput
from xffl.core.sizes import DEFAULT_MAX_SHARD_SIZE, parse_size
from xffl.jobs.registry.states import RunState
from xffl.jobs.registry.store import Registry


@handle_errors
def export(
    run: RunArg = "last",
    output: Annotated[Path | None, output_option("Folder to write (required).")] = None,
    round: Annotated[int | None, typer.Option(
        "--round", min=0, help="The global model after this round (default: the last).")] = None,
    merge: Annotated[bool, typer.Option(
        "--merge", help="LoRA runs: fold the adapter into the base model (W + alpha/r B·A) "
        "and write a whole model.")] = False,
    max_shard_size: Annotated[str, typer.Option(
        "--max-shard-size", help="Split a larger merged model into Hugging Face shards, "
        "e.g. 5GB; 0 never splits.")] = DEFAULT_MAX_SHARD_SIZE,
    force: Annotated[bool, typer.Option("--force", help="Replace OUTPUT if it exists.")] = False,
    tokenizer: Annotated[bool, typer.Option(
        "--tokenizer/--no-tokenizer", help="Write the job's tokenizer and chat template "
        "(model.tokenizer, else model.init's) beside the model.")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Write a run's global model where other tools read it, without xffl's manifest.

    A whole-model run gives model.safetensors (or shards) and config.json, which
    transformers' from_pretrained loads; a LoRA run gives adapter_model.safetensors and
    adapter_config.json, which peft's PeftModel.from_pretrained loads onto the base, or with
    --merge the base with the adapter folded in, streamed tensor by tensor. The job's
    tokenizer and chat template (model.tokenizer, else model.init's own) are written beside
    it, so that AutoTokenizer, apply_chat_template and generate work on OUTPUT alone.

    The default is the last completed round's global; a run that failed or was cancelled
    before completing any round is refused (its round 0 is the untrained initial model:
    --round 0 exports it on purpose), and one that stopped later is exported with a warning.

    Example: xffl export last --merge -o llama-federated
    """
    from xffl.aggregator.exchange import verify_checkpoint
    from xffl.core.layout import RunLayout
    from xffl.workflows.export import export_global, tokenizer_source

    if output is None:
        raise InvalidInput("xffl export needs -o/--output: the folder to write.")
    if output.exists() and not force:
        raise InvalidInput(f"-o {output}: it exists; choose a new path, or --force to "
                           "replace it.")
    max_bytes = parse_size(max_shard_size)
    record = resolve_run(Registry(), run)
    layout = RunLayout(Path(record.run_dir))
    rnd = record.rounds_done if round is None else round  # rounds complete in order
    if round is None and record.state != RunState.COMPLETED:
        if rnd == 0:
            raise InvalidInput(f"run {record.id} is {record.state} and completed no round: its "
                               "only global is round 0's untrained initial model; give "
                               "--round 0 to export that anyway.")
        err_console.print(f"[yellow]warning:[/yellow] run {record.id} is {record.state}: "
                          f"exporting the global after round {rnd}, its last completed round "
                          f"of {record.rounds_total}.", soft_wrap=True)
    if not layout.global_dir(rnd).is_dir():
        raise InvalidInput(f"run {record.id} has no global model after round {rnd}; "
                           "`xffl status` shows its completed rounds.")
    verify_checkpoint(layout.global_dir(rnd))
    source = tokenizer_source(layout) if tokenizer else None
    if tokenizer and source is None:
        err_console.print(f"[yellow]warning:[/yellow] run {record.id}'s job names no tokenizer "
                          "(model.tokenizer, or a model.init folder with one): the export has "
                          "none; set model.tokenizer in the job to have it written.",
                          soft_wrap=True)
    files = export_global(layout, rnd, output, merge=merge, max_shard_bytes=max_bytes,
                          tokenizer=source)
    data: dict[str, Any] = {"run_id": record.id, "round": rnd, "output": str(output),
                            "merged": merge, "files": files,
                            "tokenizer": None if source is None else str(source)}
    if as_json:
        print_json(data)
        return
    what = "merged model" if merge else "global model"
    console.print(f"wrote the {what} of run {record.id} after round {rnd} to {output}",
                  soft_wrap=True)
