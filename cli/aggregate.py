"""`xffl aggregate`: verify site updates and aggregate them with a server strategy.

The one aggregate command line: ``python -m xffl.aggregator`` runs this same command.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer._click.types import ParamType

from xffl.aggregator.registry import WEIGHTINGS
from xffl.aggregator.registry import get as get_strategy
from xffl.aggregator.registry import names as strategy_names
from xffl.cli.common import (
    JsonOpt,
    console,
    err_console,
    handle_errors,
    markup_safe,
    print_json,
)
from xffl.core.errors import InvalidInput, RunFailed
from xffl.core.pairs import parse_pairs
from xffl.core.sizes import DEFAULT_MAX_SHARD_SIZE, parse_size

if TYPE_CHECKING:
    from xffl.aggregator.exchange import Manifest
    from xffl.training.config import ExchangeSpec


class StrategyName(ParamType):  # Typer 0.28 vendors click (typer._click)
    """A strategy's name, its choices read from the registry when help is drawn (a strategy
    registered after this module was imported is one of them); unknown names are refused
    by :func:`aggregate`, with the known ones."""

    name = "strategy"

    def get_metavar(self, param: Any, ctx: Any) -> str:
        """``[fedavg|fedavgm|...]``, as the registry holds them now."""
        return "[" + "|".join(strategy_names()) + "]"

    def convert(self, value: Any, param: Any, ctx: Any) -> str:
        """The name as given (checked against the registry when the command runs)."""
        return str(value)


@handle_errors
def aggregate(
    updates: Annotated[list[Path], typer.Argument(
        metavar="UPDATE...", help="Update checkpoint directories.")],
    output: Annotated[Path, typer.Option("-o", "--output", "--out",
                                         help="Global checkpoint to write.")],
    strategy: Annotated[
        str, typer.Option("--strategy", click_type=StrategyName(),
                          help="A registered strategy (the choices above).")
    ] = "fedavg",
    previous: Annotated[
        Path | None,
        typer.Option(
            "--previous",
            help="The global the round started from: updates must name it as parent and "
            "match its tensors; stateful strategies read their server state from it.",
        ),
    ] = None,
    parent_digest: Annotated[
        str | None, typer.Option("--parent-digest", help="Without --previous: the digest "
                                 "updates must name as their parent.")] = None,
    weighting: Annotated[
        str, typer.Option("--weighting", help="samples, tokens or uniform.")
    ] = "samples",
    weight: Annotated[
        list[str] | None, typer.Option("--weight", help="Explicit weight of one site, "
                                       "SITE=NUMBER (repeat; replaces --weighting).")] = None,
    param: Annotated[
        list[str] | None, typer.Option("--param", help="Strategy parameter KEY=NUMBER (repeat).")
    ] = None,
    round: Annotated[int | None, typer.Option("--round", help="Accept only this round.")] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="Accept only this run.")] = None,
    min_updates: Annotated[int, typer.Option(
        "--min-updates", min=1, help="Fail (exit 1) when fewer updates are accepted.")] = 1,
    no_finite_check: Annotated[bool, typer.Option(
        "--no-finite-check", help="Skip the NaN/Inf scan of the update tensors.")] = False,
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
    exchange: Annotated[str, typer.Option(
        "--exchange", metavar="UPDATE/DTYPE",
        help="What the updates hold: weights/fp32 (default), weights/bf16, delta/bf16, ... "
        "(the job's exchange.update/exchange.dtype); anything but weights/fp32 needs "
        "--previous, the global the round started from.")] = "weights/fp32",
    force: Annotated[bool, typer.Option(
        "--force", help="Replace OUT if it exists.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Check UPDATE directories and write their aggregate under the chosen strategy to OUT.

    Example: xffl aggregate --strategy fedavg -o OUT UPDATE...
    """
    get_strategy(strategy)
    params = parse_pairs(param or [])
    weights = parse_pairs(weight or [], "--weight", "SITE", "leonardo=2")
    max_bytes = parse_size(max_shard_size)
    if weighting not in WEIGHTINGS:
        raise InvalidInput(f"--weighting {weighting!r}: use samples, tokens or uniform.")
    for update in updates:
        if not update.is_dir():
            raise InvalidInput(f"update {update}: no such directory; give the update "
                               "checkpoint directories the sites sent back.")
    if output.exists() and not force:
        raise InvalidInput(f"-o {output}: it exists; choose a new path, or --force to replace "
                           "it.")
    if previous is not None and parent_digest is not None:
        raise InvalidInput("--previous names the parent already; give --parent-digest only "
                           "without it.")
    encoding = _exchange(exchange, previous)
    report = _aggregate(updates, output, strategy, previous, parent_digest,
                        weights or weighting, params, round, run_id, min_updates,
                        not no_finite_check, max_bytes, clip_norm, max_weight_share, encoding)
    if as_json:
        print_json(report)
        return
    for u in report["used"]:
        console.print(f"used     {u['site']} ({u['dir']}): samples {u['num_samples']}, weight "
                      f"{u['weight']:.4f}", soft_wrap=True)
    for r in report["rejected"]:
        console.print(
            f"[yellow]rejected[/yellow] {r['site']} ({markup_safe(r['dir'])}): "
            f"{markup_safe(r['reason'])}", soft_wrap=True
        )
    g = report["global"]
    console.print(
        f"[green]wrote[/green] {output}: {strategy} of {len(report['used'])} update(s), "
        f"round {g['round']}, {g['num_samples']} samples, digest {g['digest'][:12]}.",
        soft_wrap=True,
    )


def _exchange(label: str, previous: Path | None) -> ExchangeSpec:
    """``--exchange`` as a spec (exit 2 when it names none, or lacks --previous)."""
    from pydantic import ValidationError

    from xffl.training.config import ExchangeSpec  # pydantic: only when aggregating

    try:
        spec = ExchangeSpec.parse(label)
    except ValidationError:
        raise InvalidInput(f"--exchange {label!r}: give UPDATE/DTYPE with UPDATE weights or "
                           "delta and DTYPE fp32, bf16 or fp16 (e.g. delta/bf16).") from None
    if not spec.plain and previous is None:
        raise InvalidInput(f"--exchange {label}: decoding these updates needs the global the "
                           "round started from; give it with --previous DIR.")
    return spec


def _aggregate(updates: list[Path], output: Path, strategy: str, previous: Path | None,
               parent_digest: str | None, weighting: Any, params: dict[str, float],
               round: int | None, run_id: str | None, min_updates: int, check_finite: bool,
               max_bytes: int | None, clip_norm: float | None,
               max_weight_share: float | None,
               exchange: ExchangeSpec | None = None) -> dict[str, Any]:
    """Select the updates, aggregate the accepted ones; what happened, as a report."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from xffl.aggregator.decode import Decoding, encoded_index
    from xffl.aggregator.exchange import read_manifest
    from xffl.aggregator.strategies import run_strategy
    from xffl.aggregator.verify import select_updates

    reference = None
    decoding = None
    if previous is not None:
        manifest = read_manifest(previous)
        parent_digest, reference = manifest.digest(), manifest.tensors
        if exchange is not None and not exchange.plain:
            reference = encoded_index(reference, exchange.safetensors_dtype)
            decoding = Decoding(previous, delta=exchange.update == "delta")
    accepted, rejected = select_updates(
        updates, expected_round=round, expected_parent=parent_digest,
        reference_index=reference, expected_run_id=run_id, check_finite=check_finite,
    )
    report: dict[str, Any] = {
        "output": str(output),
        "strategy": strategy,
        "rejected": [{"dir": str(d), "site": s, "reason": r} for d, s, r in rejected],
    }
    if len(accepted) < min_updates:
        message = f"{len(accepted)} update(s) accepted, at least {min_updates} needed."
        reasons = [f"rejected {r['site']}: {r['reason']}" for r in report["rejected"]]
        raise RunFailed(message, lines=[message, *reasons])
    columns = (TextColumn("aggregating"), BarColumn(), MofNCompleteColumn(), TextColumn("tensors"))
    with Progress(
        *columns, console=err_console, transient=True, disable=not err_console.is_terminal
    ) as bar:
        task = bar.add_task("aggregate", total=None)
        result: Manifest = run_strategy(
            strategy, [d for d, _ in accepted], previous, output, weighting=weighting,
            params=params, run_id=run_id, round=round, parent_digest=parent_digest,
            max_shard_size=max_bytes, decoding=decoding,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
            clip_norm=clip_norm, max_weight_share=max_weight_share,
        )
    sites = result.extra["sites"]
    report["used"] = [{"dir": str(d), "site": m.site, "num_samples": m.num_samples,
                       "weight": sites[m.site]["weight"]} for d, m in accepted]
    report["global"] = {
        "round": result.round,
        "digest": result.digest(),
        "num_samples": result.num_samples,
        "metrics": result.metrics,
        "params": result.extra.get("params", {}),
        "files": sorted(result.files),
    }
    return report
