"""aggregation.max_shard_size: validated in the job spec and passed to the aggregate step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import QUICKSTART
from xffl.core.errors import InvalidInput
from xffl.core.sizes import parse_size
from xffl.jobs.spec.load import load_job
from xffl.jobs.spec.schema import JobSpec
from xffl.workflows.plan.compile import write_plan


def _job(tmp_path: Path, size: Any) -> Path:
    data = yaml.safe_load(QUICKSTART.read_text())
    if size is not None:
        data["aggregation"]["max_shard_size"] = size
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(data, sort_keys=False))
    return f


def _aggregate_size(tmp_path: Path, size: Any) -> int | None:
    """The shard size the plan's aggregate step reads (from the plan's job.json), in bytes."""
    paths = write_plan(load_job(_job(tmp_path, size)), "qs-9", tmp_path / "plan")
    return parse_size(JobSpec.of_run(paths.root).aggregation.max_shard_size)


# one default for the plan, the initial model and `xffl aggregate`: Hugging Face's 5GB
@pytest.mark.parametrize(("size", "expected"), [(None, 5 * 10**9), ("2GiB", 2 * 2**30),
                                                (0, None)])
def test_max_shard_size_reaches_the_aggregate_step(tmp_path: Path, size: Any,
                                                   expected: int | None) -> None:
    assert _aggregate_size(tmp_path, size) == expected


def test_bad_max_shard_size_names_the_field(tmp_path: Path) -> None:
    f = _job(tmp_path, "5 gigs")
    with pytest.raises(InvalidInput) as info:
        load_job(f)
    line = f.read_text().splitlines().index("  max_shard_size: 5 gigs") + 1
    assert info.value.lines == [
        f"{f}:{line}: job spec field aggregation.max_shard_size: max shard size '5 gigs': "
        "expected a number of bytes with an optional unit (KB, MB, GB, TB, KiB, MiB, GiB, "
        "TiB), e.g. 5GB or 500MB (got '5 gigs'); fix the value."
    ]
