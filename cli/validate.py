"""`xffl validate`: check a job spec, its site profiles and the plan it compiles to."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer

from xffl.cli.common import console, handle_errors, print_json
from xffl.cli.options import JsonOpt


@handle_errors
def validate(
    job: Annotated[Path, typer.Argument(metavar="JOB", help="The job spec (YAML).")],
    as_json: JsonOpt = False,
) -> None:
    """Check JOB and its site profiles, compile the plan in a temp folder, validate it with cwltool.

    Example: xffl validate demo/job.yaml
    """
    from xffl.jobs.load import load_job
    from xffl.workflows.plan.compile import write_plan
    from xffl.workflows.plan.validate import validate_cwl

    loaded = load_job(job)
    with tempfile.TemporaryDirectory(prefix="xffl-validate-") as tmp:
        layout = write_plan(loaded, f"validate-{loaded.spec.name}", Path(tmp))
        validate_cwl(layout.main)
    if as_json:
        print_json({"valid": True, "job": str(loaded.path), "rounds": loaded.spec.rounds,
                    "sites": [{"site": s.name, "profile": s.profile}
                              for s in loaded.spec.sites]})
        return
    sites = ", ".join(f"{s.name} ({s.profile})" for s in loaded.spec.sites)
    console.print(f"[green]valid[/green]: {loaded.path} — {loaded.spec.rounds} rounds, "
                  f"sites {sites}; the plan passes cwltool --validate.")
