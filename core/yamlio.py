"""YAML loading that remembers the line of every mapping key, for error messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from xffl.core.errors import InvalidInput

Loc = tuple[str | int, ...]


class _LineLoader(yaml.SafeLoader):
    """A SafeLoader that records the line of each key path in ``self.lines``."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    loader.flatten_mapping(node)
    result: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, str):
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is not a string (quote it, or fix the indentation)",
                key_node.start_mark,
            )
        if key in result:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        result[key] = loader.construct_object(value_node, deep=True)
    return result


_LineLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def _index_lines(node: yaml.Node, path: Loc, out: dict[Loc, int],
                 seen: set[int] | None = None) -> None:
    """Record the line of every key path under ``node``; an aliased node is walked once."""
    seen = set() if seen is None else seen
    if id(node) in seen:  # anchors and aliases: no exponential walk ("billion laughs")
        return
    seen.add(id(node))
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node)
            out[(*path, key)] = key_node.start_mark.line + 1
            _index_lines(value_node, (*path, key), out, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[(*path, i)] = item.start_mark.line + 1
            _index_lines(item, (*path, i), out, seen)


class YamlDoc:
    """A parsed YAML document with the line of every key path."""

    def __init__(self, path: Path, data: Any, lines: dict[Loc, int]) -> None:
        self.path = path
        self.data = data
        self.lines = lines

    def line_of(self, loc: Loc) -> int | None:
        """The line of ``loc`` or of its nearest ancestor that the document has."""
        probe = tuple(loc)
        while probe:
            if probe in self.lines:
                return self.lines[probe]
            probe = probe[:-1]
        return None


_KINDS = {"list": "a list", "str": "a single string", "int": "a number", "float": "a number",
          "bool": "a boolean"}


def load_yaml(path: Path, what: str) -> YamlDoc:
    """Read ``path`` as a YAML mapping; any problem is an InvalidInput naming the file."""
    if path.is_dir():
        raise InvalidInput(f"{path}: is a folder, not a {what} file; give the YAML file.")
    if not path.is_file():
        raise InvalidInput(f"{path}: {what} not found; check the path.")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"{path}: cannot read the {what} ({exc}); check the file.") from exc
    lines: dict[Loc, int] = {}
    loader = None
    try:
        loader = _LineLoader(text)  # one parse: the lines from its nodes, then the data
        node = loader.get_single_node()
        if node is not None:
            _index_lines(node, (), lines)  # before construction flattens merge keys (<<)
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = exc.problem or exc.context or "invalid YAML"
        if exc.context and problem.startswith("but "):  # "expected X, but found Y"
            problem = f"{exc.context}, {problem}"
        elif exc.context and exc.context.startswith("while ") and exc.context_mark is not None:
            problem = f"{problem} {exc.context} started on line {exc.context_mark.line + 1}"
        raise InvalidInput(
            f"{path}{where}: YAML syntax error: {problem}; fix the YAML syntax."
        ) from exc
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise InvalidInput(
            f"{path}:{line}: YAML syntax error: control character #x{char:04x} is not allowed "
            "in YAML; remove it (or write it as an escape in double quotes)."
        ) from exc
    except yaml.YAMLError as exc:
        problem = " ".join(str(exc).split())
        raise InvalidInput(f"{path}: YAML syntax error ({problem}); fix the YAML syntax.") from exc
    except RecursionError as exc:
        raise InvalidInput(
            f"{path}: the {what} is nested too deeply to read; flatten it."
        ) from exc
    finally:
        if loader is not None:
            loader.dispose()
    if data is None:
        raise InvalidInput(f"{path}: the {what} is empty; write its fields as a YAML mapping.")
    if not isinstance(data, dict):
        raise InvalidInput(
            f"{path}: the {what} must be a YAML mapping (key: value), "
            f"not {_KINDS.get(type(data).__name__, type(data).__name__)}; "
            "write it as a mapping."
        )
    return YamlDoc(path, data, lines)
