"""Write docs/reference/job-spec.md from the job spec's pydantic models (``--check``: compare).

The reference is generated, never edited: every field, its type, default and description
come from ``xffl.jobs.spec.schema.JobSpec`` and the models it holds. ``scripts/test.sh`` builds the
docs site from it; ``tests/scripts/test_docs.py`` fails when it is stale.
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

OUT = Path(__file__).resolve().parents[1] / "docs" / "reference" / "job-spec.md"


def _type(annotation: Any) -> str:
    """A field's type as a reader writes it in YAML."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:  # a type with its validator (PathText, EntryPoint)
        return _type(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in args if a is not type(None)) + \
            (" or null" if type(None) in args else "")
    if origin in (list, tuple):
        return f"list of {_type(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {_type(args[0])} to {_type(args[1])}" if args else "map"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return getattr(annotation, "__name__", str(annotation))


def _models(model: type[BaseModel], seen: list[type[BaseModel]]) -> list[type[BaseModel]]:
    """``model`` and every model its fields hold, depth first, each once."""
    if model in seen:
        return seen
    seen.append(model)
    for field in model.model_fields.values():
        stack = [field.annotation]
        while stack:
            t = stack.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                _models(t, seen)
            stack.extend(typing.get_args(t))
    return seen


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
        return "`{}`" if value == {} else "`[]`" if value == [] else "see its section"
    return "`null`" if field.default is None else f"`{field.default!r}`".replace("'", "")


def render() -> str:
    """The reference page."""
    from xffl.jobs.spec.schema import JobSpec

    out = ["# Job spec reference", "",
           "Generated from the job spec's models by `scripts/docs_reference.py`; a job spec is",
           "YAML, and every error names its file, line and field (exit code 2).", ""]
    for model in _models(JobSpec, []):
        doc = (model.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        out += [f"## {model.__name__}", "", doc, "", "| field | type | default | description |",
                "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            default = _default(field)
            text = field.description or (
                f"as the profile's `slurm.{name}`" if model.__name__ == "SlurmOverride" else "")
            out.append(f"| `{field.alias or name}` | {_type(field.annotation)} | {default} | "
                       f"{text.replace('|', '/')} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    """Write the page, or with ``--check`` exit 1 when the written page differs."""
    text = render()
    if "--check" in argv:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python scripts/docs_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
