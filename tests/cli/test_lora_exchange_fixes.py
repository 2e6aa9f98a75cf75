"""A LoRA job's exchange errors name a fix that validates: no circle between nf4 and delta."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from xffl.cli.app import app

runner = CliRunner()


def _job(exchange: dict[str, Any], lora: bool = True) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": "fix", "rounds": 2, "exchange": exchange,
                            "sites": [{"name": "alpha", "profile": "local",
                                       "data": {"path": "data/alpha"}}]}
    if lora:
        spec["training"] = {"lora": {"r": 8}}
    return spec


def _validate(tmp_path: Path, spec: dict[str, Any]) -> tuple[int, str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = runner.invoke(app, ["validate", str(path)])
    return result.exit_code, result.stderr


@pytest.mark.parametrize(("exchange", "lora"), [
    ({"dtype": "nf4"}, True),                        # the user's first try
    ({"update": "delta"}, True),                     # what the nf4 message said before
    ({"update": "delta", "dtype": "nf4"}, True),     # both
    ({"update": "delta", "dtype": "bf16"}, True),
    ({"update": "weights", "dtype": "int8"}, False), # a whole-model job: delta is its fix
])
def test_each_exchange_message_names_a_fix_that_validates(
        tmp_path: Path, exchange: dict[str, Any], lora: bool) -> None:
    """The message's `exchange: {...}`, put in the job as it says, validates."""
    code, err = _validate(tmp_path, _job(exchange, lora))
    assert code == 2, err
    fixes = re.findall(r"`(exchange: \{[^`]*\})`", err)
    assert len(fixes) == 1, err
    fixed = _job(yaml.safe_load(fixes[0])["exchange"], lora)
    code, err_after = _validate(tmp_path, fixed)
    assert code == 0, f"{err.strip()}\nthen, with {fixes[0]}:\n{err_after}"
