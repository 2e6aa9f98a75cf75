"""`xffl aggregate`: verify site updates and aggregate them with a server strategy.

The one aggregate command line: ``python -m xffl.aggregator`` runs this same command.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer._click.types import ParamType

from xffl.aggregator.strategy_catalog import WEIGHTINGS
from xffl.aggregator.strategy_catalog import get as get_strategy
from xffl.aggregator.strategy_catalog import names as strategy_names
from xffl.cli.common import console, err_console, handle_errors, markup_safe, print_json
from xffl.cli.options import JsonOpt, output_option
from xffl.core.errors import InvalidInput, RunFailed
from xffl.core.pairs import parse_pairs
from xffl.core.sizes import DEFAULT_MAX_SHARD_SIZE, parse_size

if TYPE_CHECKING:
    from xffl.aggregator.exchange import Manifest
    from xffl.aggregator.reported import Bounds
    from xffl.aggregator.exchange_spec import ExchangeSpec
    from xffl.workflows.aggregate_run import RoundInputs


class StrategyName(ParamType):  # Typer 0.28 vendors click (typer._click)
    """A strategy's name, its choices read from the registry when help is drawn (a strategy
    registered after this module was imported is one of them); unknown names are refused
    by :func:`aggregate`, with the known ones."""

    name = "strategy"

    def get_metavar(self, param: Any, ctx: Any) -> str:
        """``NAME``: the choices are in the help, where they wrap."""
        return "NAME"

    def fill_help(self, text: str) -> str:
        """The option's help with ``{strategies}`` replaced by the registry's names now."""
        return text.replace("{strategies}", ", ".join(strategy_names()))

    def convert(self, value: Any, param: Any, ctx: Any) -> str:
        """The name as given (checked against the registry when the command runs)."""
        return str(value)


@handle_errors
def aggregate(
    updates: Annotated[list[Path] | None, typer.Argument(
        metavar="[UPDATE]...", help="Update checkpoint directories (with --run: the "
        "round's kept updates unless given).", show_default=False)] = None,
    output: Annotated[Path | None, output_option("Global checkpoint to write (required).")] = None,
    run: Annotated[str | None, typer.Option(
        "--run", metavar="RUN", help="Aggregate round --round of this run again: its kept "
        "updates, the global it started from, and its job's strategy, options and bounds on "
        "what each site may report (an option given here replaces the job's).")] = None,
    strategy: Annotated[str | None, typer.Option(
        "--strategy", click_type=StrategyName(), show_default=False,
        help="A registered strategy: {strategies} (default fedavg, or the run's).")] = None,
    previous: Annotated[Path | None, typer.Option(
        "--previous", help="The global the round started from: updates must name it as parent "
        "and match its tensors; stateful strategies read their server state from it.")] = None,
    parent_digest: Annotated[
        str | None, typer.Option("--parent-digest", help="Without --previous: the digest "
                                 "updates must name as their parent.")] = None,
    weighting: Annotated[str | None, typer.Option(
        "--weighting", show_default=False, help="samples, tokens or uniform (default samples, "
        "or the run's).")] = None,
    weight: Annotated[
        list[str] | None, typer.Option("--weight", help="Explicit weight of one site, "
                                       "SITE=NUMBER (repeat; replaces --weighting).")] = None,
    param: Annotated[list[str] | None, typer.Option(
        "--param", help="Strategy parameter KEY=NUMBER (repeat; replaces the run's).")] = None,
    round: Annotated[int | None, typer.Option(
        "--round", help="Accept only this round (with --run: the round to aggregate).")] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="Accept only this run.")] = None,
    min_updates: Annotated[int, typer.Option(
        "--min-updates", min=1, help="Fail (exit 1) when fewer updates are accepted.")] = 1,
    no_finite_check: Annotated[bool, typer.Option(
        "--no-finite-check", help="Skip the NaN/Inf scan of the update tensors.")] = False,
    max_shard_size: Annotated[str | None, typer.Option(
        "--max-shard-size", show_default=False, help="Split a larger global model into Hugging "
        "Face shards plus model.safetensors.index.json, e.g. 500MB or 2GiB; 0 never splits "
        f"(default {DEFAULT_MAX_SHARD_SIZE}, or the run's).")] = None,
    clip_norm: Annotated[float | None, typer.Option(
        "--clip-norm", help="Scale each update's change from --previous to at most this L2 "
        "norm (averaging strategies).")] = None,
    max_weight_share: Annotated[float | None, typer.Option(
        "--max-weight-share", help="No update's share of the weights above this, in (0, 1] "
        "(averaging strategies).")] = None,
    max_val_samples: Annotated[int | None, typer.Option(
        "--max-val-samples", min=1, help="Admit validation numbers measured on at most this "
        "many held-out sequences (the job's evaluation budget; with --run: the job's).")] = None,
    exchange: Annotated[str | None, typer.Option(
        "--exchange", metavar="UPDATE/DTYPE", show_default=False,
        help="What the updates hold: weights/fp32 (default, or the run's), weights/bf16, "
        "delta/bf16, delta/nf4/128 (a quantized delta and its block size), ... (the job's "
        "exchange.update/exchange.dtype, and its block_size); anything but "
        "weights/fp32 needs --previous, the global the round started from.")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace DIR if it exists.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Check UPDATE directories and write their aggregate under the chosen strategy to DIR.

    With --run RUN --round R (`xffl aggregate --run last --round 2 -o DIR`), the round's
    updates as the run kept them are aggregated again under the run's job: the result is
    the round's global, bit for bit.

    Example: xffl aggregate --strategy fedavg -o DIR UPDATE...
    """
    if output is None:
        raise InvalidInput("xffl aggregate needs -o/--output: the global checkpoint to write.")
    params = parse_pairs(param or [])
    bounds: Any = None if max_val_samples is None else _hand_bounds(max_val_samples)
    if run is not None:  # the run's job fills in what the command line leaves out
        job = _from_run(run, round, previous, parent_digest)
        updates, previous, bounds = updates or job.updates, job.previous, job.bounds
        strategy, weighting = strategy or job.strategy, weighting or job.weighting
        params = params if param else job.params
        max_shard_size, exchange = max_shard_size or job.max_shard_size, exchange or job.exchange
        clip_norm = job.clip_norm if clip_norm is None else clip_norm
        max_weight_share = job.max_weight_share if max_weight_share is None \
            else max_weight_share
    if not updates:
        raise InvalidInput("give the UPDATE directories to aggregate, or --run RUN --round R "
                           "for a round of a run.")
    strategy = strategy or "fedavg"
    get_strategy(strategy)
    weights = parse_pairs(weight or [], "--weight", "SITE", "leonardo=2")
    max_bytes = parse_size(max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    weighting = weighting or "samples"
    _check_inputs(updates, output, force, weighting, previous, parent_digest)
    encoding = _exchange(exchange or "weights/fp32", previous)
    options = Options(strategy, previous, parent_digest, weights or weighting, params, round,
                      run_id, min_updates, not no_finite_check, max_bytes, clip_norm,
                      max_weight_share, encoding, bounds, hint=run is None)
    report = _aggregate(updates, output, options)
    if as_json:
        print_json(report)
        return
    _print_report(report, output, strategy)


def _check_inputs(updates: list[Path], output: Path, force: bool, weighting: str,
                  previous: Path | None, parent_digest: str | None) -> None:
    """InvalidInput for what cannot be aggregated as asked (nothing is read or written)."""
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


def _print_report(report: dict[str, Any], output: Path, strategy: str) -> None:
    """The used and rejected updates and the global written, for people."""
    for u in report["used"]:
        console.print(f"used     {markup_safe(u['site'])} ({u['dir']}): samples "
                      f"{u['num_samples']}, weight {u['weight']:.4f}", soft_wrap=True)
    for r in report["rejected"]:
        console.print(
            f"[yellow]rejected[/yellow] {markup_safe(r['site'])} ({markup_safe(r['dir'])}): "
            f"{markup_safe(r['reason'])}", soft_wrap=True
        )
    g = report["global"]
    console.print(
        f"[green]wrote[/green] {output}: {strategy} of {len(report['used'])} update(s), "
        f"round {g['round']}, {g['num_samples']} samples, digest {g['digest'][:12]}.",
        soft_wrap=True,
    )


def _from_run(ref: str, rnd: int | None, previous: Path | None,
              parent_digest: str | None) -> RoundInputs:
    """What --run RUN --round R names (exit 2 without --round, or with --previous)."""
    from xffl.cli.common import resolve_run
    from xffl.jobs.registry.store import Registry
    from xffl.workflows.aggregate_run import round_inputs

    if rnd is None:
        raise InvalidInput("--run names a run; add --round R, the round to aggregate again "
                           "(`xffl status` lists them).")
    if previous is not None or parent_digest is not None:
        raise InvalidInput("--run takes the global the round started from from the run; "
                           "leave out --previous and --parent-digest.")
    record = resolve_run(Registry(), ref)
    return round_inputs(record.id, Path(record.run_dir), rnd)


def _hand_bounds(max_val_samples: int) -> Bounds:
    """The bounds of ``--max-val-samples`` without a run: validation numbers admitted."""
    from xffl.aggregator.reported import Bounds
    from xffl.workflows.steps.admit import SIDE_FILES

    return Bounds(side_files=SIDE_FILES, max_val_samples=max_val_samples)


@dataclass(frozen=True)
class Options:
    """How :func:`_aggregate` selects and aggregates the updates."""

    strategy: str
    previous: Path | None
    parent_digest: str | None
    weighting: Any
    params: dict[str, float]
    round: int | None
    run_id: str | None
    min_updates: int
    check_finite: bool
    max_bytes: int | None
    clip_norm: float | None
    max_weight_share: float | None
    exchange: ExchangeSpec | None
    bounds: Bounds | Mapping[str, Bounds] | None = None
    hint: bool = False  # a rejection names --run: the bounds of a run's job


def _exchange(label: str, previous: Path | None) -> ExchangeSpec:
    """``--exchange`` as a spec (exit 2 when it names none, or lacks --previous)."""
    from pydantic import ValidationError

    from xffl.aggregator.exchange_spec import ExchangeSpec  # pydantic: only when aggregating

    try:
        spec = ExchangeSpec.parse(label)
    except ValidationError:
        raise InvalidInput(f"--exchange {label!r}: give UPDATE/DTYPE with UPDATE weights or "
                           "delta and DTYPE fp32, bf16 or fp16, or delta/DTYPE/BLOCK with "
                           "DTYPE int8, nf4 or fp4 (e.g. delta/bf16, delta/nf4/128).") from None
    if not spec.plain and previous is None:
        raise InvalidInput(f"--exchange {label}: decoding these updates needs the global the "
                           "round started from; give it with --previous DIR.")
    return spec


def _aggregate(updates: list[Path], output: Path, o: Options) -> dict[str, Any]:
    """Select the updates, aggregate the accepted ones; what happened, as a report."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from xffl.aggregator.decode import Decoding, encoded_index
    from xffl.aggregator.exchange import read_manifest
    from xffl.aggregator.engine import run_strategy
    from xffl.aggregator.verify import select_updates

    reference = None
    decoding = None
    parent_digest, run_id = o.parent_digest, o.run_id
    if o.previous is not None:
        manifest = read_manifest(o.previous)
        parent_digest, reference = manifest.digest(), manifest.tensors
        if not o.hint:  # a run's round: the global carries the run's id, as the step wrote it
            run_id = run_id or manifest.run_id
        if o.exchange is not None and not o.exchange.plain:
            reference = encoded_index(reference, o.exchange.safetensors_dtype,
                                      o.exchange.codec)
            decoding = Decoding(o.previous, delta=o.exchange.update == "delta",
                                codec=o.exchange.codec)
    accepted, rejected = select_updates(
        updates, expected_round=o.round, expected_parent=parent_digest,
        reference_index=reference, expected_run_id=run_id, check_finite=o.check_finite,
        bounds=o.bounds,
    )
    report: dict[str, Any] = {
        "output": str(output),
        "strategy": o.strategy,
        "rejected": [{"dir": str(d), "site": s, "reason": r} for d, s, r in rejected],
    }
    if len(accepted) < o.min_updates:
        message = f"{len(accepted)} update(s) accepted, at least {o.min_updates} needed."
        reasons = [f"rejected {r['site']}: {r['reason']}" for r in report["rejected"]]
        if o.hint and rejected:
            reasons.append("updates of a run's round: --run RUN --round R checks them against "
                           "the run's job (its bounds, its evaluation budget).")
        raise RunFailed(message, lines=[message, *reasons])
    columns = (TextColumn("aggregating"), BarColumn(), MofNCompleteColumn(), TextColumn("tensors"))
    with Progress(
        *columns, console=err_console, transient=True, disable=not err_console.is_terminal
    ) as bar:
        task = bar.add_task("aggregate", total=None)
        result: Manifest = run_strategy(
            o.strategy, [d for d, _ in accepted], o.previous, output, weighting=o.weighting,
            params=o.params, run_id=run_id, round=o.round, parent_digest=parent_digest,
            max_shard_size=o.max_bytes, decoding=decoding,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
            clip_norm=o.clip_norm, max_weight_share=o.max_weight_share,
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
