"""`xffl simulate`: many virtual sites on this machine, trained K at a time, folded at once."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from xffl.cli.common import console, err_console, handle_errors, print_json
from xffl.cli.options import JsonOpt, TrustOpt, output_option
from xffl.cli.tables import Rows, say

if TYPE_CHECKING:
    from xffl.jobs.spec.schema import JobSpec


def _fmt(value: Any, digits: int = 4) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def render_summary(summary: dict[str, Any]) -> None:
    """A rounds table and where the results are."""
    table = Rows(("round", "sites", "seconds", "mean site loss", "global loss", "peak RSS MiB"),
                 title=f"simulation {summary['run_id']}: {summary['num_sites']} virtual sites, "
                       f"{summary['parallel']} at a time")
    for r in summary["rounds"]:
        table.add(str(r["round"]), str(r["num_sites"]), _fmt(r["wall_s"], 2),
                      _fmt(r["mean_loss"]), _fmt(r["global_loss"]),
                      f"{r['peak_rss_bytes'] / 2**20:.0f}")
    table.print()
    console.print(f"final global model: {summary['final_global']}", soft_wrap=True)
    console.print(f"numbers: {Path(summary['run_dir']) / 'simulate.json'}", soft_wrap=True)


@handle_errors
def simulate(
    job: Annotated[Path, typer.Argument(
        metavar="JOB", help="The job spec (YAML), as for `xffl submit`.")],
    sites: Annotated[int, typer.Option("--sites", help="Number of virtual sites N.")],
    parallel: Annotated[int | None, typer.Option(
        "--parallel", help="Sites trained at a time K (worker processes; default: one per "
        "core).")] = None,
    output: Annotated[Path | None, output_option("Folder for the results (default: "
        "$XFFL_HOME/simulations/<job name>-<timestamp>).")] = None,
    rounds: Annotated[int | None, typer.Option(
        "--rounds", help="Rounds to run (default: the job's).")] = None,
    timeout: Annotated[float | None, typer.Option(
        "--timeout", help="Seconds a round may take (default: failure.round_timeout, else "
        "3600).")] = None,
    keep_updates: Annotated[bool, typer.Option(
        "--keep-updates", help="Keep every site update in rounds/<r>/updates/ instead of "
        "deleting it once folded (disk then grows with N).")] = False,
    queue_waits: Annotated[str | None, typer.Option(
        "--queue-waits", help="Simulate batch queues instead of training: each job's queue "
        "wait drawn from lognormal:median=S,sigma=X or pareto:scale=S,alpha=X (seconds; "
        "each site's scale differs), and report the simulated time to a target loss of "
        "synchronous rounds, round_timeout and round_deadline (docs: queues).")] = None,
    queue_trace: Annotated[Path | None, typer.Option(
        "--queue-trace", help="As --queue-waits, with waits drawn from a file of observed "
        "ones (seconds, one per line).")] = None,
    seeds: Annotated[int, typer.Option(
        "--seeds", help="With --queue-waits: seeds 0..N-1, the same for every policy.")] = 3,
    target_loss: Annotated[float | None, typer.Option(
        "--target-loss", help="With --queue-waits: the federated validation loss to reach "
        "(default: 95 % of the way from the initial loss to the optimum).")] = None,
    trust_entry_point: TrustOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Simulate N sites of JOB on this machine with the real trainer; write every round's global.

    Virtual site i uses the job's site i % len(sites) as its template, with its own data
    (a dialect of a synthetic language, or a part of the template's dataset). Each update
    is folded into a running FedAvg as soon as it finishes and then deleted.

    The sites train here: a JOB naming Python (model.entry_point, training.update_fn) is
    refused unless --trust-entry-point.

    Example: xffl simulate demo/job.yaml --sites 100 --parallel 2 --rounds 1
    """
    from xffl.jobs.spec.load import load_job
    from xffl.jobs.spec.trust import require_local_consent
    from xffl.workflows.simulate import SimulateOptions, Simulation

    loaded = load_job(job)
    if queue_waits is not None or queue_trace is not None:
        _queues(loaded.spec, sites, queue_waits, queue_trace, seeds, target_loss, as_json)
        return
    require_local_consent(loaded.path, loaded.spec, trust_entry_point, "simulate")
    opts = SimulateOptions(sites=sites, parallel=parallel, out=output, rounds=rounds,
                           timeout=timeout, keep_updates=keep_updates)
    if as_json:
        summary = Simulation(loaded, opts).run()
        print_json(summary)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("sites"), TimeElapsedColumn())
    bar = Progress(*columns, console=err_console, transient=False)
    task = bar.add_task("initial model", total=1)

    def progress(rnd: int, done: int, total: int) -> None:
        label = "initial model" if rnd == 0 else f"round {rnd}/{sim.rounds}"
        bar.update(task, description=label, completed=done, total=total)

    sim = Simulation(loaded, opts, progress)  # checks the request: exit 2 before any output
    err_console.print(f"simulating {sites} virtual sites of {loaded.spec.name}, "
                      f"{sim.workers} at a time, in {sim.root}", soft_wrap=True)
    with bar:
        summary = sim.run()
    render_summary(summary)


def _queues(spec: JobSpec, sites: int, waits: str | None, trace: Path | None, seeds: int,
            target: float | None, as_json: bool) -> None:
    """``--queue-waits``/``--queue-trace``: the three round policies on simulated queues."""
    from xffl.core.errors import InvalidInput
    from xffl.jobs.spec.deadline import RoundDeadline
    from xffl.workflows.queue_sim import compare, parse_queue_waits, read_trace

    if (waits is None) == (trace is None):
        raise InvalidInput("give --queue-waits or --queue-trace, not both.")
    if sites < 1 or seeds < 1:
        raise InvalidInput(f"--sites and --seeds must be at least 1, got {sites} and {seeds}.")
    model = parse_queue_waits(waits) if waits is not None else read_trace(trace)  # type: ignore[arg-type]
    deadline = spec.round_deadline or RoundDeadline(seconds=1.0)
    result = compare(sites, spec.training.steps, deadline, model, list(range(seeds)), target)
    result["job"] = spec.name
    result["queue_waits"] = waits or str(trace)
    if as_json:
        print_json({k: v for k, v in result.items() if k != "runs"})
        return
    table = Rows(("policy", "best setting", "hours to target"),
                 title=f"{sites} virtual sites, {seeds} seeds, queue waits {result['queue_waits']}")
    for policy in ("sync", "timeout", "queue_aware"):
        table.add(policy, result["best"].get(policy, "-"), f"{result['hours'][policy]:.2f}")
    table.print()
    saving = result["saving_vs_best_timeout"]
    if saving is not None:
        say(f"queue-aware: {100 * abs(saving):.0f} % {'less' if saving >= 0 else 'more'} "
            "simulated time than the best of synchronous and round_timeout")
