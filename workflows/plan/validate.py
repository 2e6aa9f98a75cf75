"""Validate generated CWL with cwltool (the reference implementation), in-process."""

from __future__ import annotations

import io
import logging
from pathlib import Path

from xffl.core.errors import XfflError


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
        )
    finally:
        cwl_logger.removeHandler(handler)
    if code != 0:
        detail = " ".join((err.getvalue() or out.getvalue()).split())[:500]
        raise XfflError(f"{path}: the generated CWL does not validate with cwltool: {detail}")
