"""`xffl submit`: start a federated run from a job spec, optionally following it to the end."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from xffl.cli.common import console, handle_errors, markup_safe, print_json
from xffl.cli.options import JsonOpt, TrustOpt
from xffl.cli.watch import TimeoutOpt, follow, outcome
from xffl.core.errors import InvalidInput
from xffl.jobs.registry.store import Registry


@handle_errors
def submit(
    job: Annotated[Path, typer.Argument(metavar="JOB", help="The job spec (YAML).")],
    wait: Annotated[bool, typer.Option("--wait", help="Follow the run until it ends.")] = False,
    name: Annotated[
        str | None, typer.Option(help="Prefix of the run id (default: the job name).")
    ] = None,
    timeout: TimeoutOpt = 86400.0,
    start: Annotated[bool, typer.Option(
        help="Start the runner now; --no-start leaves the run to `xffl round` (cron).")] = True,
    trust_entry_point: TrustOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Validate JOB, register a run, start its runner in the background; print the run id.

    A JOB whose round 0 needs its model.entry_point (no model.init) is refused unless
    --trust-entry-point, which the run records: its rounds (resume, cron) may then run it here.
    So is a JOB with a site on a local profile that names any Python (model.entry_point,
    training.update_fn): that site trains here.

    Example: xffl submit demo/job.yaml --wait  (demo/: `xffl init demo`)
    """
    from xffl.workflows.submit import submit as submit_job

    if wait and not start:
        raise InvalidInput("--wait follows a run this command starts; with --no-start its "
                           "rounds run from `xffl round` (cron): follow them with `xffl watch "
                           "RUN`.")
    submitted = submit_job(job, name=name, start=start,
                           trust_entry_point=trust_entry_point)
    run = submitted.run
    registry = Registry()
    if not wait:
        if as_json:
            print_json({"run_id": run.id, "run_dir": run.run_dir, "state": run.state})
        else:
            console.print(f"submitted run [bold]{run.id}[/bold]; " + (
                f"runner pid {submitted.pid}; follow it with `xffl watch {run.id}`."
                if submitted.pid else markup_safe(run.message)), soft_wrap=True)
        return
    final = follow(registry, run, timeout, as_json=as_json, spawned=submitted.pid,
                   intro=f"submitted run [bold]{run.id}[/bold]; following it")
    outcome(registry, final, as_json)
