"""Validate generated CWL with cwltool (the reference implementation), in-process."""

from __future__ import annotations

import io
import logging
from pathlib import Path

from xffl.core.errors import XfflError

_INSTALLED: dict[str, tuple[str, str]] = {}  # cwltool's custom schemas after our last set-up


def install_extension_schemas() -> None:
    """Set up cwltool's extension schemas as ``--enable-ext`` does, unless they are in place.

    cwltool's own ``--enable-ext`` set-up reinstalls them on every call, which empties its
    cache of parsed schemas: each validation in one process then parsed the CWL schemas
    again (most of its CPU time). Set up again only when they differ from our last set-up.
    """
    import argparse

    import cwltool.main
    from cwltool.process import custom_schemas

    if not _INSTALLED or custom_schemas != _INSTALLED:
        cwltool.main.setup_schema(argparse.Namespace(enable_ext=True), None)
        _INSTALLED.clear()
        _INSTALLED.update(custom_schemas)


def validate_cwl(path: Path) -> None:
    """Run ``cwltool --validate --enable-ext`` on ``path``; raise XfflError if it is invalid."""
    import cwltool.main

    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    cwl_logger = logging.getLogger("cwltool")
    cwl_logger.addHandler(handler)
    try:
        code = cwltool.main.main(
            argsl=["--validate", "--enable-ext", "--quiet", str(path)],
            stdout=out, stderr=err, logger_handler=handler,
            custom_schema_callback=install_extension_schemas,
        )
    finally:
        cwl_logger.removeHandler(handler)
    if code != 0:
        detail = " ".join((err.getvalue() or out.getvalue()).split())[:500]
        raise XfflError(f"{path}: the generated CWL does not validate with cwltool: {detail}")
