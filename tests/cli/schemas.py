"""The JSON Schemas of the commands' ``--json`` output (docs/json/), for tests to check with."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

SCHEMAS = Path(__file__).resolve().parents[2] / "docs" / "json"


@cache
def _validator(name: str) -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def check(name: str, data: Any) -> Any:
    """Raise if ``data`` does not validate against docs/json/``name``.schema.json; return it."""
    errors = sorted(_validator(name).iter_errors(data), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors[:5]]
    return data
