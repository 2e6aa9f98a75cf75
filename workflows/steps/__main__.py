"""``python -m xffl.workflows.steps STEP ARGS...``: one coordinator step (:mod:`.handoff`)."""

from __future__ import annotations

import sys

from xffl.core.startup import collect_less
from xffl.workflows.steps import handoff


def main() -> int:
    """Run the step named first on the command line (warm when the run's server listens)."""
    collect_less()  # before a cold step's imports (see xffl.core.startup)
    return handoff.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
