"""Turn pydantic validation errors into one clear line per problem: file, line, field, fix."""

from __future__ import annotations

import difflib
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from xffl.core.errors import InvalidInput
from xffl.core.yamlio import Loc, YamlDoc

M = TypeVar("M", bound=BaseModel)


def _fields_at(model: type[BaseModel], loc: Loc) -> list[str]:
    """The field names a model accepts at ``loc`` (for did-you-mean suggestions)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        field = current.model_fields.get(str(part))
        if field is None:
            return []
        current = _inner_model(field.annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _inner_model(annotation: Any) -> Any:
    """The BaseModel inside Optional[...] or list[...], if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _dotted(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _describe(model: type[BaseModel], err: Any) -> tuple[Loc, str]:
    loc: Loc = tuple(
        p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))
    )
    kind = err["type"]
    if kind == "extra_forbidden":
        key = str(loc[-1])
        allowed = _fields_at(model, loc[:-1])
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(allowed)}"
        return loc, f"unknown key {key!r}; {hint}"
    if kind == "missing":
        return loc, "is required but missing; add it"
    msg = str(err["msg"])
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    got = err.get("input")
    scalar = isinstance(got, str | int | float | bool)
    shown = f" (got {got!r})" if kind != "model_type" and scalar else ""
    return loc, f"{msg[0].lower()}{msg[1:]}{shown}; fix the value"


def validate_doc(doc: YamlDoc, model: type[M], what: str) -> M:
    """Validate a YAML document against ``model``; raise InvalidInput with one line per error."""
    try:
        return model.model_validate(doc.data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc, text = _describe(model, err)
            line = doc.line_of(loc)
            where = f"{doc.path}:{line}" if line else str(doc.path)
            lines.append(f"{where}: {what} field {_dotted(loc)}: {text}.".replace("..", "."))
        raise InvalidInput(lines[0], lines=lines) from exc
