"""`xffl validate`: check a job spec, its site profiles and the plan it compiles to."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from xffl.cli.common import console, err_console, handle_errors, markup_safe, print_json
from xffl.cli.options import JsonOpt

if TYPE_CHECKING:
    from xffl.jobs.spec.memory_check import SiteFit


def _memory_table(rows: list[SiteFit]) -> None:
    """One row per site: layout, the estimated peak per rank and the GPU it must fit."""
    from xffl.cli.tables import Rows

    table = Rows(["site", "profile", "ranks", "layout", "peak/rank", "GPU GiB", "fits"],
                 title="memory per rank (estimate, docs/large-models.md)")
    for row in rows:
        gib = row.estimate_gib
        peak = "-" if gib is None else f"{gib:.1f} GiB" if gib >= 1 else f"{gib * 1024:.0f} MiB"
        gpu = "CPU" if row.gpu_memory_gib is None else f"{row.gpu_memory_gib:g}"
        fits = {None: "-", True: "yes", False: "NO"}[row.fits]
        table.add(row.site, row.profile, row.ranks, row.layout, peak, gpu, fits)
    table.print()


@handle_errors
def validate(
    job: Annotated[Path, typer.Argument(metavar="JOB", help="The job spec (YAML).")],
    as_json: JsonOpt = False,
) -> None:
    """Check JOB and its site profiles (memory per GPU, ranks per node), compile the plan in
    a temp folder, validate it with cwltool.

    Example: xffl validate demo/job.yaml
    """
    from xffl.core.errors import InvalidInput
    from xffl.jobs.spec.load import load_job
    from xffl.jobs.spec.memory_check import check_sites
    from xffl.workflows.plan.compile import write_plan
    from xffl.workflows.plan.validate import validate_cwl

    loaded = load_job(job)
    checks = check_sites(loaded)
    for warning in checks.warnings:
        err_console.print(f"[yellow]warning:[/yellow] {markup_safe(warning)}", soft_wrap=True)
    if checks.errors:
        raise InvalidInput(checks.errors[0], lines=checks.errors)
    with tempfile.TemporaryDirectory(prefix="xffl-validate-") as tmp:
        layout = write_plan(loaded, f"validate-{loaded.spec.name}", Path(tmp))
        validate_cwl(layout.main)
    if as_json:
        print_json({"valid": True, "job": str(loaded.path), "rounds": loaded.spec.rounds,
                    "sites": [row.to_json() for row in checks.rows],
                    "warnings": checks.warnings})
        return
    _memory_table(checks.rows)
    sites = ", ".join(f"{s.name} ({s.profile})" for s in loaded.spec.sites)
    console.print(f"[green]valid[/green]: {loaded.path} — {loaded.spec.rounds} rounds, "
                  f"sites {sites}; the plan passes cwltool --validate.")
