"""Run a plan with StreamFlow through its Python API (what `streamflow run` does, in-process)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path
from typing import Any

from xffl.workflows.plan import PlanPaths


async def _run(config_file: Path, name: str, outdir: Path) -> Any:
    # Imported lazily: StreamFlow pulls in a large dependency tree that most commands never need.
    from streamflow.config.config import WorkflowConfig
    from streamflow.config.validator import SfValidator
    from streamflow.cwl.main import main as cwl_main
    from streamflow.ext.utils import load_extensions
    from streamflow.main import build_context

    load_extensions()
    config = SfValidator().validate_file(str(config_file))
    config["path"] = str(config_file.resolve())
    context = build_context(config)
    args = argparse.Namespace(name=name, outdir=str(outdir), validate=False, quiet=False)
    try:
        for workflow in config.get("workflows", {}):
            await cwl_main(WorkflowConfig(workflow, config), context, args)
    finally:
        await context.close()


def run_plan(paths: PlanPaths, name: str, log_file: Path | None = None) -> None:
    """Execute the plan in ``paths`` with StreamFlow; raises on workflow failure.

    StreamFlow keeps its working files under $TMPDIR/streamflow: it is pointed at the run
    directory, so that the aggregate step can hardlink checkpoints instead of copying them.
    """
    from streamflow.log_handler import logger as sf_logger

    work = paths.root / "streamflow"
    tmp = work / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ["TMPDIR"] = str(tmp)
    if log_file is not None:
        handler = logging.FileHandler(log_file)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-8s %(message)s"))
        sf_logger.handlers = [handler]
        sf_logger.propagate = False
    sf_logger.setLevel(logging.INFO)
    asyncio.run(_run(paths.streamflow, name, work / "out"))
