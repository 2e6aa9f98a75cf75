"""The files of a chained round (``training.checkpoint.chain``) in the site's state folder:
the launcher's stop request, rank 0's account of the job that ended, the round's list of jobs.

No torch here: the launcher (:mod:`xffl.training.launch`) reads and writes them and never
imports torch; the ranks' side is :mod:`xffl.training.chain`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from xffl.core.errors import ExitCode
from xffl.core.files import write_json

#: the exit code of a launcher whose job ended a chained round early after a checkpoint: the
#: round continues in the next job (EX_TEMPFAIL of sysexits.h: "try again later")
CONTINUE_EXIT = int(ExitCode.CONTINUED)
#: the folder of a round's checkpoints in the site's state folder (xffl.training.round_state);
#: the launcher removes it once the round's update is kept
ROOT = "checkpoints"
SITE_STATE_ENV = "XFFL_SITE_STATE"  # the launcher's --keep folder, for the ranks
STOP_FILE = ".chain-stop"  # the launcher's request (its USR1), in the site's state folder
END_FILE = ".chain-end.json"  # rank 0's account of the job that just ended
JOBS_FILE = "chain-jobs.json"  # the launcher's list of the round's jobs
MAX_JOBS = 64  # jobs of one round kept and reported, the newest
#: rank 0's line when a job ends a chained round early; the failure manager reads its numbers
CONTINUE_LINE = "xffl.training: round {round} continues in the next job at step {step} of {steps}"


def clear(state_dir: Path) -> None:
    """The launcher, before the ranks start: no stale request or account."""
    for name in (STOP_FILE, END_FILE):
        (Path(state_dir) / name).unlink(missing_ok=True)


def request_stop(state_dir: Path) -> None:
    """The launcher's USR1: ask the ranks to checkpoint and end the job."""
    (Path(state_dir) / STOP_FILE).touch(mode=0o600)


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and \
        0 <= value < 2**31 else None


def read_end(state_dir: Path, rnd: int) -> dict[str, Any] | None:
    """Rank 0's account of the job that just ended, for round ``rnd`` (None: none)."""
    try:
        data = json.loads((Path(state_dir) / END_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("round") != rnd or any(
            _count(data.get(k)) is None for k in ("from", "to", "steps")):
        return None
    return data


def record_job(state_dir: Path, end: dict[str, Any], job: dict[str, Any] | None,
               now: float) -> list[dict[str, Any]]:
    """Add the job that just ended to the round's list in ``state_dir`` (a list of another
    round or global model is replaced); the list, oldest first."""
    path = Path(state_dir) / JOBS_FILE
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        kept = {}
    same = isinstance(kept, dict) and kept.get("round") == end["round"] and \
        kept.get("parent") == end["parent"] and isinstance(kept.get("jobs"), list)
    jobs: list[dict[str, Any]] = list(kept["jobs"]) if same else []
    started = None if job is None else job.get("start_time") or job.get("launcher_start")
    jobs.append({
        "job_id": "" if job is None else str(job.get("job_id", "")),
        "step_from": int(end["from"]), "step_to": int(end["to"]), "steps": int(end["steps"]),
        "queue_wait_s": None if job is None else job.get("queue_wait_s"),
        "run_s": None if started is None else round(now - float(started), 3),
        "step_seconds": end.get("step_seconds"),
        "ended": "continued" if end.get("continues") else "completed"})
    jobs = jobs[-MAX_JOBS:]
    write_json(path, {"round": end["round"], "parent": end["parent"], "jobs": jobs})
    return jobs
