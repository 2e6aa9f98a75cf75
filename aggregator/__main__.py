"""``python -m xffl.aggregator``: the same command as ``xffl aggregate``, for a coordinator
with xffl installed as a library only.

Example::

    python -m xffl.aggregator -o rounds/3/global --round 3 --previous rounds/2/global \\
        --strategy fedadam updates/leonardo updates/karolina
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from xffl.core.startup import collect_less


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``xffl aggregate`` with ``argv``; return its exit code."""
    collect_less()  # before the imports it makes (see xffl.core.startup)
    import typer

    from xffl.cli.aggregate import aggregate
    from xffl.core.paths import private_files

    private_files()
    app = typer.Typer(add_completion=False)
    app.command()(aggregate)
    try:
        args = list(sys.argv[1:] if argv is None else argv)
        app(args=args, prog_name="python -m xffl.aggregator")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
