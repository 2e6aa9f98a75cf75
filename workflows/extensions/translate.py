"""Adapter for StreamFlow 0.2.0rc3's CWL translation: each tool file is parsed once per check,
not once per port.

Before translating a workflow, StreamFlow runs cwl-utils 0.42's ``static_checker``, which asks
``cwl_utils.parser.utils.load_step`` for the type of every input and output of every step,
and ``load_step`` parses the step's ``run`` file from disk (ruamel.yaml) at each call. The
loop step of ``main.cwl`` has a port per site and its ``run`` is ``round.cwl``, which has a
step per site: the work grows with the square of the number of sites. Measured on a 38-site
plan: 679 parses, 51 s of a 55 s set-up before any job is submitted, on every execution of a
run (a resume, each cron tick).

:func:`install` (called by xffl's StreamFlow plugin, so ``streamflow run`` gets it too) wraps
``static_checker`` so that, while it runs, ``load_step`` parses each ``run`` file once and
hands the same parsed tool to every port of the check. The checker only reads types from it
(``convert_stdstreams_to_files``, which it also applies, is idempotent); the cache is
dropped when the check ends, and ``load_step`` outside a check is upstream's.
``tests/workflows/extensions/test_translate.py`` shows the upstream behaviour beside this one.
"""

from __future__ import annotations

import contextvars
from typing import Any

_MARK = "_xffl_parse_once"
_PARSED: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "xffl_parsed_steps", default=None)


def install() -> None:
    """Wrap ``cwl_utils.parser.utils.static_checker`` and ``load_step`` (once per process)."""
    import cwl_utils.parser.utils as parser_utils

    if getattr(parser_utils.static_checker, _MARK, False):
        return
    original_load = parser_utils.load_step
    original_check = parser_utils.static_checker

    def load_step(step: Any) -> Any:
        parsed = _PARSED.get()
        if parsed is None or not isinstance(step.run, str):
            return original_load(step)
        options = step.loadingOptions
        uri = options.fetcher.urljoin(base_url=options.fileuri, url=step.run)
        if uri not in parsed:
            parsed[uri] = original_load(step)
        return parsed[uri]

    def static_checker(workflow: Any) -> None:
        token = _PARSED.set({})
        try:
            original_check(workflow)
        finally:
            _PARSED.reset(token)

    for wrapper, original in ((load_step, original_load), (static_checker, original_check)):
        setattr(wrapper, _MARK, True)
        setattr(wrapper, "__wrapped__", original)  # noqa: B010 (what functools.wraps sets)
    parser_utils.load_step = load_step
    parser_utils.static_checker = static_checker
