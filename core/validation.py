"""Turn pydantic validation errors into one clear line per problem: file, line, field, fix."""

from __future__ import annotations

import difflib
import re
import types
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

from xffl.core.errors import InvalidInput
from xffl.core.yamlio import Loc, YamlDoc

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """A pydantic model that refuses unknown fields: a typo in a spec or profile is an error."""

    model_config = ConfigDict(extra="forbid")

_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")  # control chars, line breaks


def check_path_text(value: str) -> str:
    """ValueError unless ``value`` is a plain path: not blank, no control chars, no CWL `$(`."""
    if not value.strip():
        raise ValueError("path must not be empty")
    if _CONTROL.search(value):
        raise ValueError(f"path {value!r} holds a control character (newline, tab, NUL, ...); "
                         "use a plain path")
    if "$(" in value or "${" in value:
        raise ValueError(f"path {value!r} holds '$(' or '${{', which CWL reads as an "
                         "expression; rename the folder")
    return value


#: a job spec's or profile's path field: plain path text (:func:`check_path_text`)
PathText = Annotated[str, AfterValidator(check_path_text)]


def _members(annotation: Any) -> tuple[Any, ...]:
    """The non-None members of a Union annotation (empty for anything else)."""
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(a for a in get_args(annotation) if a is not type(None))
    return ()


def _tags(member: Any) -> set[str]:
    """The names pydantic uses in an error location for this member of a union."""
    tags = {getattr(member, "__name__", str(member)), str(member)}
    if isinstance(member, type) and issubclass(member, BaseModel):
        for field in member.model_fields.values():
            if get_origin(field.annotation) is Literal:
                tags |= {str(v) for v in get_args(field.annotation)}
    return tags


def _walk(model: type[BaseModel], loc: Loc) -> tuple[Loc, Any]:
    """``loc`` without pydantic's union-member tags, and the annotation it ends at."""
    current: Any = model
    out: list[str | int] = []
    for part in loc:
        members = _members(current)
        while len(members) == 1:
            current = members[0]
            members = _members(current)
        if members:
            match = next((m for m in members if str(part) in _tags(m)), None)
            if match is not None:
                current = match
                continue
            current = None
        out.append(part)
        args = get_args(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(part))
            current = field.annotation if field is not None else None
        elif get_origin(current) is dict and len(args) == 2:
            current = args[1]
        elif get_origin(current) in (list, tuple, set) and args:
            current = args[0]
        else:
            current = None
    members = _members(current)
    return tuple(out), (members[0] if len(members) == 1 else current)


def _subfield(model: type[BaseModel], loc: Loc, msg: str) -> Loc:
    """A model-wide check whose message starts with one of its fields points at that field.

    "data_parallel ddp does not combine ..." raised for ``training`` is about
    ``training.data_parallel``; "failure.min_sites is 3 ..." at the top about that field.
    """
    lead = re.match(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*", msg)
    if lead is None:
        return loc
    _, current = _walk(model, loc)
    for part in lead[0].split("."):
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return loc
        field = current.model_fields.get(part)
        if field is None:
            return loc
        members = _members(field.annotation)
        current = members[0] if len(members) == 1 else field.annotation
    return (*loc, *lead[0].split("."))


def _fields_at(model: type[BaseModel], loc: Loc) -> list[str]:
    """The field names a model accepts at ``loc`` (for did-you-mean suggestions)."""
    _, current = _walk(model, loc)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def field_path(loc: Loc) -> str:
    """``sites[0].data.path``; a key that is not plain is shown quoted, as ``env['a b']``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _PLAIN_KEY.match(part):
            out += f"[{part!r}]"
        else:
            out += f".{part}" if out else part
    return out or "(top level)"


def _shown(value: Any) -> str:
    """A short repr of a scalar input for the message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_KIND = {"list": "a list", "dict": "a mapping", "str": "a string", "int": "a number",
         "float": "a number", "bool": "a boolean", "NoneType": "empty"}


def _describe(model: type[BaseModel], err: Any) -> tuple[Loc, str]:
    raw: Loc = tuple(
        p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))
    )
    loc, _ = _walk(model, raw)
    kind = err["type"]
    got = err.get("input")
    if kind == "extra_forbidden":
        key = str(loc[-1])
        allowed = _fields_at(model, raw[:-1])
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(allowed)}"
        return loc, f"unknown key {_shown(key)}; {hint}"
    if kind == "missing":
        return loc, "is required but missing; add it"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        ctx = err.get("ctx") or {}
        disc = str(ctx.get("discriminator", "type")).strip("'\"")
        expected = ctx.get("expected_tags")
        if kind == "union_tag_not_found" or expected is None:
            return (*loc, disc), f"is required but missing; add {disc}: one of the known kinds"
        return (*loc, disc), f"unknown {disc} {_shown(ctx.get('tag'))}; use one of {expected}"
    if kind in ("model_type", "model_attributes_type", "dict_type", "list_type"):
        want = "a list" if kind == "list_type" else "a mapping (key: value)"
        have = _KIND.get(type(got).__name__, type(got).__name__)
        return loc, f"must be {want}, not {have}; fix the value"
    msg = str(err["msg"])
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
        loc = _subfield(model, loc, msg)
    msg = f"{msg[0].lower()}{msg[1:]}"
    if "; " in msg or msg.endswith("?"):  # the check's own message already says the fix
        return loc, msg
    scalar = isinstance(got, str | int | float | bool)
    shown = f" (got {_shown(got)})" if scalar else ""
    return loc, f"{msg}{shown}; fix the value"


def _merge(model: type[BaseModel], errors: list[Any]) -> list[tuple[Loc, str]]:
    """One (loc, text) per field: the errors of a union's members at one field become one."""
    merged: dict[Loc, list[str]] = {}
    for err in errors:
        loc, text = _describe(model, err)
        merged.setdefault(loc, []).append(text)
    out = []
    for loc, texts in merged.items():
        if len(texts) > 1 and all(t.startswith("input should be ") for t in texts):
            wants = [re.sub(r"( \(got .*\))?; fix the value$", "", t)[len("input should be "):]
                     .split(",")[0] for t in texts]
            got = texts[0].split(" (got ", 1)
            tail = f" (got {got[1]}" if len(got) > 1 else "; fix the value"
            out.append((loc, f"input should be {' or '.join(wants)}{tail}"))
        else:
            out.append((loc, texts[0]))
    # a misspelt required key is one problem, not two: keep "did you mean", drop "missing"
    for loc, text in list(out):
        found = re.search(r"did you mean '([^']+)'\?$", text)
        if found and text.startswith("unknown key"):
            out = [(other, t) for other, t in out
                   if not (other == (*loc[:-1], found[1]) and t.startswith("is required"))]
    return out


def validate_doc(doc: YamlDoc, model: type[M], what: str,
                 context: dict[str, Any] | None = None) -> M:
    """Validate a YAML document against ``model``; raise InvalidInput with one line per error.

    ``context`` reaches every validator (pydantic's validation context)."""
    try:
        return model.model_validate(doc.data, context=context)
    except ValidationError as exc:
        lines = []
        for loc, text in _merge(model, exc.errors()):
            line = doc.line_of(loc)
            where = f"{doc.path}:{line}" if line else str(doc.path)
            end = "" if text.endswith("?") else "."
            lines.append(f"{where}: {what} field {field_path(loc)}: {text.rstrip('.')}{end}")
        raise InvalidInput(lines[0], lines=lines) from exc
