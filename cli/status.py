"""`xffl status`: where a run stands, round by round and site by site."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from xffl.cli.common import JsonOpt, console, handle_errors, print_json, resolve_run
from xffl.jobs.registry import Registry


def _num(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def render_status(data: dict[str, Any]) -> None:
    """Print a run's status as a header and a rounds x sites table."""
    from xffl.jobs.report import fmt

    console.print(f"run [bold]{data['id']}[/bold]: {data['state']} — "
                  f"{data['rounds_done']}/{data['rounds_total']} rounds"
                  + (f" — {data['message']}" if data["message"] else ""))
    table = Table("round", "site", "state", "samples", "tokens", "loss", "queue s", "train s",
                  "transfer s", "aggregate s")
    for rnd in data["rounds"]:
        for site in rnd["sites"]:
            tries = site.get("attempts", 1)
            table.add_row(str(rnd["round"]), site["site"], site["state"] + (
                f" after {tries} attempts" if tries > 1 else "") + (
                f" ({site['reason']})" if site["reason"] else ""),
                _num(site["num_samples"]), _num(site["num_tokens"]),
                _num(site["loss"], "{:.4f}"), fmt("queue_wait_s", site.get("queue_wait_s")),
                _num(site["train_seconds"], "{:.1f}"),
                fmt("transfer_s", site.get("transfer_s")), "")
        table.add_row(str(rnd["round"]), "[bold]global[/bold]", rnd["state"],
                      _num(rnd["num_samples"]), "", _num(rnd["loss"], "{:.4f}"), "", "", "",
                      _num(rnd["aggregate_seconds"], "{:.2f}"), end_section=True)
    console.print(table)
    if data.get("slurm"):
        jobs = Table("round", "site", "SLURM job", "SLURM state", "queue wait s", "run s",
                     title="SLURM jobs")
        for job in data["slurm"]:
            state = job["state"] or ("unreachable" if not job["reachable"] else "-")
            if job["error"]:
                state += f" ({job['error']})"
            elif not job["live"] and job["state"] in {"PENDING", "RUNNING", "COMPLETING"}:
                state += " (last seen)"
            jobs.add_row(_num(job["round"]), job["site"], job["job_id"] or "-", state,
                         _num(job["queue_wait_s"], "{:.0f}"), _num(job["run_s"], "{:.0f}"))
        console.print(jobs)
    if data.get("credentials"):
        creds = Table("site", "login", "next round", title="SSH credentials")
        for row in data["credentials"]:
            creds.add_row(row["site"], row["login"],
                          f"[yellow]waiting: {row['waiting']}[/yellow]" if row["waiting"]
                          else "ready")
        console.print(creds)
    if data["latest_global"]:
        console.print(f"latest global model: {data['latest_global']}")
    if data.get("schedule"):
        console.print(f"schedule: `xffl round` at '{data['schedule']['cron']}', next tick "
                      f"{data['schedule']['next_tick'].replace('T', ' ')}")
    console.print(f"run directory: {data['run_dir']}")


@handle_errors
def status(
    run: Annotated[str, typer.Argument(help="Run id, an unambiguous prefix, or 'last'.")] = "last",
    as_json: JsonOpt = False,
    live: Annotated[bool, typer.Option("--live/--no-live", help="Ask SLURM over SSH about a "
                                       "running run's jobs.")] = True,
) -> None:
    """Show a run's state and a rounds x sites table (state, samples, loss, durations).

    Each site's round is broken down into SLURM queue wait, training and transfer +
    orchestration (until its update was in place); `xffl report` draws the same numbers.

    For SLURM sites it also shows each round's job id, SLURM state, queue wait and run time,
    read live over SSH while the run is running (a site that cannot be reached says so).

    Example: xffl status quickstart-20261122-051000-a3f9
    """
    from xffl.jobs.slurm_view import slurm_view
    from xffl.jobs.status import run_status

    registry = Registry()
    record = resolve_run(registry, run)
    data = run_status(registry, record)
    data["slurm"] = slurm_view(registry, record, live=live)
    if as_json:
        print_json(data)
    else:
        render_status(data)
