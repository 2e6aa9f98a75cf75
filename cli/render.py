"""`xffl render`: write the plan of a job (CWL, StreamFlow config, inputs) without running it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from xffl.cli.common import console, err_console, handle_errors, print_json
from xffl.cli.options import JsonOpt, TrustOpt, output_option
from xffl.core.errors import InvalidInput
from xffl.jobs.registry.store import new_run_id

if TYPE_CHECKING:
    from xffl.core.layout import RunLayout
    from xffl.jobs.spec.load import LoadedJob


@handle_errors
def render(
    job: Annotated[Path, typer.Argument(metavar="JOB", help="The job spec (YAML).")],
    output: Annotated[Path, output_option("Folder to write the plan into.")],
    init_model: Annotated[
        bool, typer.Option(help="Also write the seeded initial model (rounds/0/global).")
    ] = True,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace a non-empty DIR (its files are deleted first).")] = False,
    trust_entry_point: TrustOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Write the plan of JOB into a folder: the same files `xffl submit` runs.

    The plan runs without xffl's supervisor and registry: `streamflow run
    DIR/streamflow.yml`, or `cwltool --enable-ext DIR/main.cwl DIR/inputs.yml` (sites on
    this machine). sbatch/<site>.sh of a SLURM site trains one round when submitted by hand
    from a copy of DIR at the facility (sbatch sbatch/SITE.sh [ROUND] [MODEL] [JOB] [OUT]).

    A JOB whose round 0 needs its model.entry_point (no model.init) is refused unless
    --trust-entry-point: that Python would run here. --no-init-model runs none of it.

    Example: xffl render demo/job.yaml -o plan/  (demo/: `xffl init demo`)
    """
    from xffl.jobs.spec.load import load_job
    from xffl.jobs.spec.trust import require_consent
    from xffl.workflows.plan.compile import write_plan

    loaded = load_job(job)
    if init_model:  # before anything is written
        require_consent(loaded.path, loaded.spec, trust_entry_point, "render")
    if output.exists() and any(output.iterdir()):
        if not force:
            raise InvalidInput(f"{output}: folder is not empty; choose a new or empty folder for "
                               "-o, or --force to replace it.")
        shutil.rmtree(output)
    run_id = new_run_id(f"render-{loaded.spec.name}")
    layout = write_plan(loaded, run_id, output)
    if init_model:
        _write_initial_model(layout, loaded, run_id, trust_entry_point)
    root = layout.root
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    if as_json:
        print_json({"plan": str(root), "run_id": run_id, "files": files})
        return
    console.print(f"plan written to {root}:")
    for f in files:
        console.print(f"  {f}")


def _write_initial_model(layout: RunLayout, loaded: LoadedJob, run_id: str,
                         trusted: bool) -> None:
    """Round 0's model (a LoRA job's frozen base, then its adapter), with a progress bar on a
    terminal: a multi-GB ``model.init`` takes minutes to copy."""
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeRemainingColumn,
    )

    from xffl.workflows.plan.compile import write_initial_model

    what = ("the frozen base (rounds/0/base)" if loaded.spec.training.lora is not None
            else "the initial model (rounds/0/global)")
    with Progress(TextColumn(f"writing {what}"), BarColumn(), TaskProgressColumn(),
                  TimeRemainingColumn(), console=err_console,
                  transient=False, disable=not err_console.is_terminal) as bar:
        task = bar.add_task("initial model", total=None)
        write_initial_model(layout, loaded.spec, run_id, trusted=trusted,
                            progress=lambda done, total: bar.update(task, completed=done,
                                                                    total=total))
