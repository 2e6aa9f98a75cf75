"""validate_cwl in one process: cwltool's parsed schemas are kept between calls, its
extensions (cwltool:Loop) stay known, and a file broken since is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from cwltool import process

from tests.conftest import QUICKSTART
from xffl.core.errors import XfflError
from xffl.jobs.spec.load import load_job
from xffl.workflows.plan.compile import write_plan
from xffl.workflows.plan.cwl import CWL_VERSION
from xffl.workflows.plan.validate import validate_cwl


def test_schemas_are_parsed_once_and_extensions_survive_a_standard_set_up(
        tmp_path: Path, xffl_home: Path) -> None:
    main = write_plan(load_job(QUICKSTART), "qs-1", tmp_path / "plan").main  # has cwltool:Loop
    validate_cwl(main)
    parsed = process.SCHEMA_CACHE[CWL_VERSION]
    validate_cwl(main)
    assert process.SCHEMA_CACHE[CWL_VERSION] is parsed  # not parsed again (~0.6 CPU-s a call)
    # cwltool without --enable-ext (another caller in this process) drops the extensions:
    # the next validation sets them up again, or cwltool:Loop would be an unknown field
    process.use_standard_schema(CWL_VERSION)
    validate_cwl(main)
    # the kept schemas keep no document: the same file, now broken, is refused
    main.write_text(main.read_text().replace("cwltool:Loop", "cwltool:Loops"))
    with pytest.raises(XfflError, match="does not validate with cwltool"):
        validate_cwl(main)
