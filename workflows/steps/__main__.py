"""``python -m xffl.workflows.steps STEP ARGS...``: one coordinator step (:mod:`.handoff`)."""

import sys

from xffl.workflows.steps.handoff import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
