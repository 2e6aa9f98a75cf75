"""Typer's CliRunner builds an app's click command once per test process, not per invoke.

``typer.testing.CliRunner.invoke`` calls ``typer.main.get_command(app)`` every time, and that
evaluates the annotations of every command of the app (``from __future__ import annotations``:
an ``eval`` and a ``compile`` per parameter): ~30 CPU-ms, most of a fast CLI test, over a
thousand times in the suite. The ``xffl`` program builds it once per process; here each app
is built on its first invoke and that command serves the process's later invokes, as one
long-lived process would (click commands keep no state between invocations; an app changed
after its first invoke would not be seen: none is).
"""

from __future__ import annotations

from typing import Any

import typer
import typer.testing


def build_each_app_once() -> None:
    """Make ``CliRunner.invoke`` reuse the click command built for the same Typer app."""
    build = typer.testing._get_command
    if getattr(build, "built", None) is not None:
        return
    built: dict[int, tuple[typer.Typer, Any]] = {}

    def get_command(app: typer.Typer) -> Any:
        hit = built.get(id(app))
        if hit is None or hit[0] is not app:  # the app itself is kept: its id is never reused
            hit = built[id(app)] = (app, build(app))
        return hit[1]

    get_command.built = built  # type: ignore[attr-defined]
    typer.testing._get_command = get_command
