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
    as_json: JsonOpt = False,
) -> None:
    """Write the plan of JOB into a folder, to read it or run it by hand.

    Example: xffl render jobs/quickstart.yaml -o plan/
    """
    loaded = load_job(job)
    if out.exists() and any(out.iterdir()):
        raise InvalidInput(f"{out}: folder is not empty; choose a new or empty folder for -o.")
    paths = write_plan(loaded, f"render-{loaded.spec.name}", out, registry_path())
    files = sorted(str(p.relative_to(paths.root)) for p in paths.root.rglob("*") if p.is_file())
    if as_json:
        print_json({"plan": str(paths.root), "files": files})
        return
    console.print(f"plan written to {paths.root}:")
    for f in files:
        console.print(f"  {f}")
