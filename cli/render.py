"""`xffl render`: write the plan of a job (CWL, StreamFlow config, inputs) without running it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from xffl.cli.common import JsonOpt, console, handle_errors, print_json
from xffl.core.errors import InvalidInput
from xffl.core.paths import registry_path
from xffl.jobs.load import load_job
from xffl.workflows.plan import write_plan


@handle_errors
def render(
    job: Annotated[Path, typer.Argument(help="The job spec (YAML).")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Folder to write the plan into.")],
    init_model: Annotated[
        bool, typer.Option(help="Also write the seeded initial model (rounds/0/global).")
    ] = True,
    as_json: JsonOpt = False,
) -> None:
    """Write the plan of JOB into a folder, to read it or run it by hand.

    With the initial model written, sbatch/<site>.sh of a SLURM site trains round 1 when
    submitted by hand (sbatch sbatch/SITE.sh [ROUND] [MODEL] [OUT]).

    Example: xffl render jobs/quickstart.yaml -o plan/
    """
    loaded = load_job(job)
    if out.exists() and any(out.iterdir()):
        raise InvalidInput(f"{out}: folder is not empty; choose a new or empty folder for -o.")
    run_id = f"render-{loaded.spec.name}"
    paths = write_plan(loaded, run_id, out, registry_path())
    if init_model:
        from xffl.training.trainer import init_global  # torch: import only when needed

        init_global(run_id, loaded.spec.model, loaded.spec.training.seed, paths.initial_model)
    files = sorted(str(p.relative_to(paths.root)) for p in paths.root.rglob("*") if p.is_file())
    if as_json:
        print_json({"plan": str(paths.root), "files": files})
        return
    console.print(f"plan written to {paths.root}:")
    for f in files:
        console.print(f"  {f}")
