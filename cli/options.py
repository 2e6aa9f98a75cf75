"""The options and arguments commands share: RUN, --json, -o/--output, --trust-entry-point."""

from __future__ import annotations

from typing import Annotated, Any

import typer

RunArg = Annotated[str, typer.Argument(metavar="RUN",
                                       help="Run id, an unambiguous prefix, or 'last'.")]


def output_option(help: str, metavar: str = "DIR") -> Any:
    """The ``-o/--output/--out`` option every command that writes a file or folder takes: a
    folder is ``DIR`` in every help text, as in the docs (a file: ``FILE``)."""
    return typer.Option("-o", "--output", "--out", metavar=metavar, help=help)


JsonOpt = Annotated[bool, typer.Option("--json", envvar="XFFL_JSON",
                                       help="Print machine-readable JSON.")]
#: consent to import the job spec's Python here, given on the command line only (never from
#: XFFL_* in the environment: a standing consent would cover specs not yet read).
TrustOpt = Annotated[bool, typer.Option(
    "--trust-entry-point", allow_from_autoenv=False,
    help="Allow Python the job spec names to be imported and run on this machine: "
    "model.entry_point where round 0 needs it (no model.init, or LoRA), and for simulate, or "
    "submit of a job with a local site, any of it (training.update_fn too). Read that code "
    "first.")]
