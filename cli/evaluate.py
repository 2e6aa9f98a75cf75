"""`xffl evaluate`: cross-site validation of a round, every site evaluating every model."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any

import typer

from xffl.cli.common import console, err_console, handle_errors, print_json, resolve_run
from xffl.cli.options import JsonOpt, RunArg
from xffl.cli.tables import say
from xffl.core.errors import ExitCode, InvalidInput
from xffl.jobs.registry.store import Registry

if TYPE_CHECKING:
    from xffl.jobs.registry.records import FinalLoss
    from xffl.workflows.evaluate_run import Outcome


@handle_errors
def evaluate(
    run: RunArg = "last",
    round: Annotated[int | None, typer.Option(
        "--round", min=1, help="The round whose models to evaluate (default: the last "
        "completed).")] = None,
    final: Annotated[bool, typer.Option(
        "--final", help="Evaluate the run's final global model alone, as after its last "
        "round, and record its held-out loss (`xffl status`: final model); for a run whose "
        "final evaluation failed or was never run.")] = False,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=1, help="Seconds the whole evaluation may take; then its jobs are "
        "stopped (exit 4).")] = 3600.0,
    as_json: JsonOpt = False,
) -> None:
    """Cross-site validation: every site evaluates the round's global model and every site's
    update on its own held-out data (data.validation), at the site, as the site trains
    (its SLURM job or local process, its ranks). The models are sent to every site; only
    the losses come back. The sites x models matrix of losses is recorded in the registry
    (`xffl report` draws it) and printed. Exit 1 if a site's row failed (the others are
    still recorded).

    With --final, only the last round's global model is evaluated, as every run does after
    its last round; the sites' losses make the final model's held-out loss (their mean over
    all the held-out targets, and their median), recorded for `xffl status` and `xffl report`.

    Example: xffl evaluate quickstart-20261122-051000-a3f9 --round 3
    """
    from xffl.workflows.evaluate_run import evaluate_run
    from xffl.workflows.final_evaluation import evaluate_final

    registry = Registry()
    record = resolve_run(registry, run)
    if final and round is not None:
        raise InvalidInput("--final evaluates the last round's global; leave out --round.")
    rnd = record.rounds_done if round is None else round
    final_loss: FinalLoss | None = None

    def work() -> Outcome:
        nonlocal final_loss
        if final:
            final_loss, done = evaluate_final(registry, record, timeout)
            return done
        return evaluate_run(registry, record, rnd, timeout)
    if as_json:
        outcome = work()
    else:
        with err_console.status(f"run {record.id}: evaluating round {rnd}'s "
                                f"{'global model' if final else 'models'} at every site "
                                "(StreamFlow)"):
            outcome = work()
    rows = {r.site: r for r in outcome.rows}
    if as_json:
        data: dict[str, Any] = {
            "run_id": outcome.run_id, "round": outcome.round, "models": outcome.models,
            "sites": list(rows),
            "losses": [None if r.result is None else [r.result.losses[m] for m in outcome.models]
                       for r in outcome.rows],
            "samples": {s: r.result.samples for s, r in rows.items() if r.result is not None},
            "failed": {s: r.error for s, r in rows.items() if r.error is not None},
            "wall_s": outcome.seconds,
        }
        if final:
            data["final_loss"] = None if final_loss is None else asdict(final_loss)
        print_json(data)
    else:
        from xffl.cli.tables import Rows

        table = Rows(["data site", *outcome.models, "samples", "note"], text=("note",),
                     title=f"run {outcome.run_id}, round {outcome.round}: mean token loss "
                     "of each model (columns) on each site's held-out data (rows)")
        for r in outcome.rows:
            if r.result is None:
                table.add(r.site, *("-" for _ in outcome.models), "-", f"failed: {r.error}")
            else:
                table.add(r.site, *(f"{r.result.losses[m]:.4f}" for m in outcome.models),
                          str(r.result.samples), "")
        table.print()
        if final:
            from xffl.cli.status import final_line

            say(final_line(final_loss) if final_loss is not None else
                "no site sent a loss: the final model's held-out loss is not recorded")
        else:
            console.print(f"recorded in the registry ({outcome.seconds:.1f} s); `xffl report "
                          f"{outcome.run_id}` draws the matrix", soft_wrap=True)
    if outcome.failed:
        raise typer.Exit(int(ExitCode.RUN_FAILED))
