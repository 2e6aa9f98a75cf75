"""`xffl provenance`: a Workflow Run RO-Crate of a run (StreamFlow's provenance plus xffl's)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from xffl.cli.common import console, handle_errors, print_json, resolve_run
from xffl.cli.options import JsonOpt, RunArg, output_option
from xffl.core.errors import InvalidInput
from xffl.jobs.registry.store import Registry


@handle_errors
def provenance(
    run: RunArg = "last",
    output: Annotated[Path | None, output_option(
        "The crate to write (default: <run>.crate.zip here).", metavar="FILE")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Write a Workflow Run RO-Crate (zip) of RUN: every StreamFlow execution of its plan,
    each round's global model and each site's update with their sha256, and the SLURM job
    that trained each update. Checkpoints are described by checksum, not copied.

    Example: xffl provenance last -o run.crate.zip
    """
    from xffl.core.layout import RunLayout
    from xffl.workflows.provenance import write_crate

    registry = Registry()
    record = resolve_run(registry, run)
    if not RunLayout(Path(record.run_dir)).streamflow_db.is_file():
        raise InvalidInput(f"run {record.id} has not started a StreamFlow workflow yet; "
                           "nothing to describe.")
    target = output if output is not None else Path.cwd() / f"{record.id}.crate.zip"
    if not target.name.endswith(".zip"):
        raise InvalidInput(f"-o {target}: the crate is a zip file; name it *.crate.zip.")
    path = write_crate(registry, record, target)
    if as_json:
        print_json({"run_id": record.id, "crate": str(path)})
    else:
        console.print(f"RO-Crate of run {record.id} written to {path}", soft_wrap=True)
