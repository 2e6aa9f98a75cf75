"""Helpers of the run tests: what a run's registry and logs say about its sites."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from xffl.core.layout import RunLayout

_ADMIT = re.compile(r"^round (\d+): (\S+) update ([0-9a-f]{12}) admitted$")
REUSE_LINE = "reusing the update this site trained for round {rnd} from the same global model"


def admitted(status: dict[str, Any], rnd: int, site: str) -> list[str]:
    """The digests (12 hex) of every update of ``site`` admitted in round ``rnd``, in order."""
    out = []
    for event in status["events"]:
        m = _ADMIT.match(event["message"]) if event["kind"] == "admit" else None
        if m and int(m[1]) == rnd and m[2] == site:
            out.append(m[3])
    return out


def reused(run_dir: str | Path, rnd: int) -> bool:
    """Whether a local site's launcher handed back a kept update of round ``rnd``."""
    log = RunLayout(Path(run_dir)).streamflow_log.read_text(errors="replace")
    return REUSE_LINE.format(rnd=rnd) in log
