"""The batch job a round trains in: give it the round's name and record it for the coordinator.

The launcher runs once per job, in the batch script. When the job is not yet named as the
round's job should be (``xffl-<run>-<site>-r<round>``: a script submitted by hand, or
main.cwl run directly by StreamFlow), its scheduler renames it (SLURM: ``scontrol update``,
:func:`xffl.schedulers.slurm.job_start`), so the scheduler's own records carry the round.
When training ends it writes
``slurm_job.json`` (job id, name, cluster, nodes, submit/start times, exit code) into the
update directory, beside the checkpoint: it travels back with the update and the coordinator
records it in the run registry. The file is not part of the checkpoint (the manifest does
not list it; verification ignores it).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from xffl.schedulers.registry import current

RECORD_FILE = "slurm_job.json"
RECORD_BYTES = 64 << 10
MAX_INT = 2**53  # an integer from the record: SQLite's range, exact as a float, and no abort
_JOB_ID = re.compile(r"^[0-9]{1,12}(_[0-9]{1,12})?$")
#: a chained round's jobs (:mod:`xffl.training.chain`), in the record of the job that ended it
ROUND_JOBS = "round_jobs"
MAX_ROUND_JOBS = 64
_STEP_KEYS = ("step_from", "step_to", "steps")
_SECONDS_KEYS = ("queue_wait_s", "run_s", "step_seconds")
_ENDED = ("continued", "completed")


def start(name: str | None, environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """At the job's start: rename it to ``name`` if needed; return what its scheduler says.

    None outside a batch job. Never raises: a job that cannot be renamed or described still
    trains (the record then says so).
    """
    env = os.environ if environ is None else environ
    scheduler = current(env)
    return None if scheduler is None else scheduler.job_start(name, env)


def finish(record: dict[str, Any] | None, out_dir: Path, returncode: int,
           round_jobs: list[dict[str, Any]] | None = None) -> Path | None:
    """Write the job's record into ``out_dir`` (beside it when there is no checkpoint);
    ``round_jobs``: a chained round's jobs (:mod:`xffl.training.chain`), this one last."""
    if record is None:
        return None
    done = {**record, "launcher_end": time.time(), "exit_code": returncode}
    if round_jobs:
        done[ROUND_JOBS] = round_jobs
    done["run_s"] = done["launcher_end"] - float(record.get("start_time")
                                                 or record["launcher_start"])
    out_dir = Path(out_dir)
    target = out_dir / RECORD_FILE if out_dir.is_dir() else (
        out_dir.parent / f"{out_dir.name}.{RECORD_FILE}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(done, indent=2) + "\n")
    except OSError:
        return None
    return target


def read_record(update_dir: Path) -> dict[str, Any] | None:
    """The ``slurm_job.json`` an update came back with, if any (None if absent or damaged).

    It came from a facility: at most RECORD_BYTES are read, the job id must be a SLURM job
    id (digits, or an array job's ``N_M``), and every other value a short printable string,
    a finite float or an integer of at most MAX_INT in size (what the registry stores);
    anything else makes the record count as absent.
    """
    from xffl.aggregator.exchange import read_small_file
    from xffl.core.errors import CheckpointError

    try:
        data = json.loads(read_small_file(Path(update_dir) / RECORD_FILE, RECORD_BYTES))
    except (OSError, ValueError, CheckpointError):
        return None
    if not isinstance(data, dict) or not _JOB_ID.match(str(data.get("job_id", ""))):
        return None
    jobs = data.pop(ROUND_JOBS, None)
    if jobs is not None:
        checked = [valid_round_job(j) for j in jobs] if isinstance(jobs, list) and \
            len(jobs) <= MAX_ROUND_JOBS else [None]
        if all(j is not None for j in checked):  # else left out: the rest still counts
            data[ROUND_JOBS] = checked
    for value in data.values():
        if isinstance(value, list):
            continue  # the round's jobs, checked above
        if isinstance(value, str) and (len(value) > 256 or not value.isprintable()):
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, int) and abs(value) > MAX_INT:
            return None
        if not isinstance(value, str | int | float | bool | None):
            return None
    return data


def valid_round_job(entry: object) -> dict[str, Any] | None:
    """One job of a chained round as a facility reported it, if well-formed: a SLURM job id
    (or none), step counts below 2**31, finite seconds, how it ended; None otherwise."""
    if not isinstance(entry, dict) or not set(entry) <= {"job_id", "ended", *_STEP_KEYS,
                                                          *_SECONDS_KEYS}:
        return None
    job_id = entry.get("job_id", "")
    if not isinstance(job_id, str) or (job_id and not _JOB_ID.match(job_id)):
        return None
    if entry.get("ended") not in _ENDED:
        return None
    out: dict[str, Any] = {"job_id": job_id, "ended": entry["ended"]}
    for key in _STEP_KEYS:
        value = entry.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
            return None
        out[key] = value
    for key in _SECONDS_KEYS:
        value = entry.get(key)
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)
                                  or not math.isfinite(value) or not 0 <= value < MAX_INT):
            return None
        out[key] = None if value is None else float(value)
    return out if out["step_from"] <= out["step_to"] <= out["steps"] else None
