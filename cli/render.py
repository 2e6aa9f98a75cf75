"""`xffl render`: write the plan of a job (CWL, StreamFlow config, inputs) without running it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated

import typer

from xffl.cli.common import console, handle_errors, print_json
from xffl.cli.options import JsonOpt, TrustOpt, output_option
from xffl.core.errors import InvalidInput
from xffl.jobs.registry import new_run_id


@handle_errors
def render(
    job: Annotated[Path, typer.Argument(metavar="JOB", help="The job spec (YAML).")],
    output: Annotated[Path, output_option("Folder to write the plan into.")],
    init_model: Annotated[
        bool, typer.Option(help="Also write the seeded initial model (rounds/0/global).")
    ] = True,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace a non-empty OUT folder (its files are deleted first).")] = False,
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
    from xffl.jobs.load import load_job
    from xffl.jobs.trust import require_consent
    from xffl.workflows.plan.compile import write_initial_model, write_plan

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
        write_initial_model(layout, loaded.spec, run_id, trusted=trust_entry_point)
    root = layout.root
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    if as_json:
        print_json({"plan": str(root), "run_id": run_id, "files": files})
        return
    console.print(f"plan written to {root}:")
    for f in files:
        console.print(f"  {f}")
