"""`xffl report`: an HTML page and PNG plots of a run's loss, round times and throughput."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from xffl.cli.common import console, handle_errors, print_json, resolve_run
from xffl.cli.options import JsonOpt, RunArg, output_option
from xffl.jobs.registry.store import Registry


@handle_errors
def report(
    run: RunArg = "last",
    output: Annotated[Path | None, output_option(
        "Folder to write into (default: <run_dir>/report).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Write report.html and PNG plots of a run: loss, round-time breakdown, throughput.

    The loss plot shows each site's and the global loss per round; the breakdown splits
    every site's round into SLURM queue wait, training, transfer + orchestration and
    aggregation; the throughput plot shows each site's tokens per second of training. The
    page also holds a table of every round's numbers. The files replace an earlier report
    only once all of them are drawn.

    Example: xffl report quickstart-20261122-051000-a3f9 -o /tmp/report
    """
    from xffl.jobs.report.write import write_report

    registry = Registry()
    record = resolve_run(registry, run)
    data, files = write_report(registry, record, output)
    if as_json:
        print_json({**data.as_dict(), "html": str(files["html"]),
                    "files": [str(v) for v in files.values()]})
        return
    done = sum(1 for r in data.rounds if r.state == "completed")
    console.print(f"report of run [bold]{data.run_id}[/bold] ({data.state}, {done} completed "
                  f"round{'s' if done != 1 else ''}) written:")
    for path in files.values():
        console.print(f"  {path}")
