"""`xffl aggregate`: verify site updates and aggregate them with a server strategy."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, cast

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from xffl.aggregator.exchange import read_manifest
from xffl.aggregator.inputs import Weighting
from xffl.aggregator.strategies import STRATEGIES, parse_pairs, run_strategy
from xffl.aggregator.verify import select_updates
from xffl.cli.common import JsonOpt, console, err_console, handle_errors, print_json
from xffl.core.errors import InvalidInput, RunFailed
from xffl.core.sizes import DEFAULT_MAX_SHARD_SIZE, parse_size


@handle_errors
def aggregate(
    updates: Annotated[list[Path], typer.Argument(help="Update checkpoint directories.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Global checkpoint to write.")],
    strategy: Annotated[
        str, typer.Option("--strategy", help=f"One of {', '.join(STRATEGIES)}.")
    ] = "fedavg",
    previous: Annotated[
        Path | None,
        typer.Option(
            "--previous",
            help="The global the round started from: updates must name it as parent and "
            "match its tensors; stateful strategies read their server state from it.",
        ),
    ] = None,
    weighting: Annotated[
        str, typer.Option("--weighting", help="samples, tokens or uniform.")
    ] = "samples",
    param: Annotated[
        list[str] | None, typer.Option("--param", help="Strategy parameter KEY=NUMBER (repeat).")
    ] = None,
    round: Annotated[int | None, typer.Option("--round", help="Accept only this round.")] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="Accept only this run.")] = None,
    max_shard_size: Annotated[
        str,
        typer.Option(
            "--max-shard-size",
            help="Split a larger global model into Hugging Face shards plus "
            "model.safetensors.index.json, e.g. 500MB or 2GiB; 0 never splits.",
        ),
    ] = DEFAULT_MAX_SHARD_SIZE,
    clip_norm: Annotated[float | None, typer.Option(
        "--clip-norm", help="Scale each update's change from --previous to at most this L2 "
        "norm (averaging strategies).")] = None,
    max_weight_share: Annotated[float | None, typer.Option(
        "--max-weight-share", help="No update's share of the weights above this, in (0, 1] "
        "(averaging strategies).")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace OUT if it exists.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Check UPDATE directories and write their aggregate under the chosen strategy to OUT.

    Example: xffl aggregate --strategy fedavg -o OUT UPDATE...
    """
    params = parse_pairs(param or [])
    max_bytes = parse_size(max_shard_size)
    if weighting not in ("samples", "tokens", "uniform"):
        raise InvalidInput(f"--weighting {weighting!r}: use samples, tokens or uniform.")
    if output.exists() and not force:
        raise InvalidInput(f"-o {output}: it exists; choose a new path, or --force to replace "
                           "it.")
    parent = reference = None
    if previous is not None:
        manifest = read_manifest(previous)
        parent, reference = manifest.digest(), manifest.tensors
    accepted, rejected = select_updates(
        updates,
        expected_round=round,
        expected_parent=parent,
        reference_index=reference,
        expected_run_id=run_id,
    )
    report: dict[str, Any] = {
        "output": str(output),
        "strategy": strategy,
        "rejected": [{"dir": str(d), "site": s, "reason": r} for d, s, r in rejected],
        "used": [{"dir": str(d), "site": m.site} for d, m in accepted],
    }
    if not accepted:
        reasons = [f"rejected {r['site']}: {r['reason']}" for r in report["rejected"]]
        raise RunFailed("no update was accepted.", lines=["no update was accepted.", *reasons])
    columns = (TextColumn("aggregating"), BarColumn(), MofNCompleteColumn(), TextColumn("tensors"))
    with Progress(
        *columns, console=err_console, transient=True, disable=not err_console.is_terminal
    ) as bar:
        task = bar.add_task("aggregate", total=None)
        result = run_strategy(
            strategy,
            [d for d, _ in accepted],
            previous,
            output,
            weighting=cast(Weighting, weighting),
            params=params,
            run_id=run_id,
            round=round,
            parent_digest=parent,
            max_shard_size=max_bytes,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
            clip_norm=clip_norm, max_weight_share=max_weight_share,
        )
    report["global"] = {
        "round": result.round,
        "digest": result.digest(),
        "num_samples": result.num_samples,
        "params": result.extra.get("params", {}),
        "files": sorted(result.files),
    }
    if as_json:
        print_json(report)
        return
    for r in report["rejected"]:
        console.print(
            f"[yellow]rejected[/yellow] {r['site']} ({r['dir']}): {r['reason']}", soft_wrap=True
        )
    sites = ", ".join(str(u["site"]) for u in report["used"])
    console.print(
        f"[green]wrote[/green] {output}: {strategy} of {len(accepted)} update(s) ({sites}), "
        f"round {result.round}, digest {result.digest()[:12]}.",
        soft_wrap=True,
    )
