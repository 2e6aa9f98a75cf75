"""SLURM's dialect on the login node: #SBATCH lines, squeue, scancel, ``sbatch --test-only``.

Every command here is a shell line that xffl runs over SSH on a site's login node, and every
parser reads what the facility answered. The facility's text is not trusted: a squeue line
whose id, state or node list is not SLURM's is skipped, a time or elapsed field that is not
SLURM's counts as unknown, and only an ``sbatch --test-only`` answer of exactly its form is
an estimate::

    sbatch: Job 4 to start at 2026-11-26T00:16:03 using 2 processors on nodes n1 in partition debug

Clocks never mix: a listing and an estimate start with the login node's own ``date``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from datetime import datetime

from xffl.schedulers.base import QueuedJob

# what a squeue field may be; a line with any other field is not SLURM's and is skipped
_ELAPSED = re.compile(r"(?:(\d{1,5})-)?(?:(\d{1,5}):)?(\d{1,5}):(\d{1,5})")
_JOB_ID = re.compile(r"[0-9][0-9_+\[\]\-,]{0,63}")  # 12, 12_3, 12_[1-4], 12+0
_STATE = re.compile(r"[A-Z_]{1,32}")
_NODES = re.compile(r"[\w\[\]\-,.]{0,1000}")
SQUEUE_FORMAT = "%i|%j|%T|%V|%S|%M|%N"
# every job of the user on the login node's cluster, with its name (filtered by prefix later)
SQUEUE_MINE = f"squeue -h -u \"$(id -un)\" -o {shlex.quote(SQUEUE_FORMAT)}"
CLOCK = "date +%Y-%m-%dT%H:%M:%S"
# sbatch's long option names and the settings (a site profile's SlurmSpec fields) they take
SBATCH_OPTIONS = (
    ("partition", "partition"), ("account", "account"), ("qos", "qos"),
    ("ntasks-per-node", "ntasks_per_node"), ("gpus-per-node", "gpus_per_node"),
    ("cpus-per-task", "cpus_per_task"), ("mem", "mem"), ("constraint", "constraint"),
)

MAX_ESTIMATE_S = 366 * 86400.0
MAX_LINES = 64  # what is read of the answer (sbatch prints one line)
_ISO = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}"
_NOW = re.compile(_ISO)
_ANSWER = re.compile(rf"sbatch: Job \d{{1,12}} to start at ({_ISO}) using \d{{1,9}} processors"
                     r" on nodes [\w\[\]\-,.]{1,1000} in partition [\w\-.]{1,64}")


def batch_options(settings: Mapping[str, object], extra: Sequence[str]) -> list[str]:
    """The ``--option=value`` sbatch options of the settings that are set, ``extra`` last."""
    options = [f"--{flag}={settings[field]}" for flag, field in SBATCH_OPTIONS
               if settings.get(field) is not None]
    return options + list(extra)


def name_directive(job_name: str) -> str:
    """The ``#SBATCH`` line naming the job (the script's first line after the shebang)."""
    return f"#SBATCH --job-name={job_name}"


def directives(nodes: int, ranks: int, time: str, options: Sequence[str],
               signal_margin: int | None = None) -> list[str]:
    """The ``#SBATCH`` lines of a round's job: nodes, tasks, time limit, ``options``, and with
    ``signal_margin`` USR1 to the batch shell that many seconds before the time limit."""
    return [f"#SBATCH --nodes={nodes}", f"#SBATCH --ntasks={ranks}", f"#SBATCH --time={time}",
            *(f"#SBATCH {opt}" for opt in options),
            *([f"#SBATCH --signal=B:USR1@{int(signal_margin)}"] if signal_margin else [])]


def job_ids_command(prefix: str) -> str:
    """A shell line printing the ids of every job named ``prefix`` (any round).

    It matches the prefix itself and the prefix followed by ``-r<digits>``, nothing else.
    """
    quoted = shlex.quote(prefix)
    return (f"squeue -h -u \"$(id -un)\" -o '%i %j' | awk -v p={quoted} "
            "'$2 == p || (index($2, p \"-r\") == 1 && "
            "substr($2, length(p) + 3) ~ /^[0-9]+$/) {print $1}'")


def cancel_command(prefix: str, names: Sequence[str]) -> str:
    """scancel by id every job squeue lists under ``prefix``, then ``scancel -n`` each name.

    One name at a time (SLURM 22.05 matches ``-n a,b`` against no job at all); the names also
    catch a job submitted after squeue answered, or one a squeue that prints garbage did not
    list. Its exit status is 0 when every ``scancel -n`` succeeded.
    """
    return (f"ids=$({job_ids_command(prefix)}); "
            "[ -z \"$ids\" ] || scancel $ids 2>/dev/null; "
            f"r=0; for n in {' '.join(shlex.quote(n) for n in names)}; "
            "do scancel -n \"$n\" || r=1; done; [ $r -eq 0 ]")


def seconds(text: str) -> float | None:
    """SLURM's elapsed time ([D-]HH:MM:SS, MM:SS) in seconds; None for anything else."""
    match = _ELAPSED.fullmatch(text.strip())
    if match is None:
        return None
    days, hours, minutes, secs = (int(g or 0) for g in match.groups())
    return float(days * 86400 + hours * 3600 + minutes * 60 + secs)


def _time(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text.strip())
    except ValueError:
        return None


def parse_squeue(text: str) -> list[QueuedJob]:
    """Parse the clock line and squeue lines in SQUEUE_FORMAT (see the module doc).

    The queue wait is submit to start for a job that started, submit to the clock line for a
    pending one.
    """
    lines = [ln for ln in text.splitlines() if ln.strip()]
    now = _time(lines[0]) if lines else None
    jobs = []
    for line in lines[1:]:
        fields = line.split("|")
        if len(fields) != 7:
            continue
        job_id, name, state, submit, start, elapsed, nodes = fields
        if not (_JOB_ID.fullmatch(job_id) and _STATE.fullmatch(state)
                and _NODES.fullmatch(nodes)):
            continue
        sub, sta = _time(submit), _time(start)
        if sub is not None and sta is not None and state != "PENDING":
            wait: float | None = max(0.0, (sta - sub).total_seconds())
        elif sub is not None and now is not None:
            wait = max(0.0, (now - sub).total_seconds())
        else:
            wait = None
        jobs.append(QueuedJob(job_id=job_id, name=name, state=state,
                              nodes="" if nodes in {"", "(null)"} else nodes,
                              queue_wait_s=wait, run_s=seconds(elapsed)))
    return jobs


def estimate_command(nodes: int, ranks: int, time: str, options: Sequence[str]) -> str:
    """The login-node shell line: the clock, then ``sbatch --test-only`` of a round's job."""
    argv = ["sbatch", "--test-only", f"--nodes={nodes}", f"--ntasks={ranks}",
            f"--time={time}", *options, "--wrap=true"]
    return f"{CLOCK}; " + " ".join(shlex.quote(a) for a in argv) + " 2>&1"


def parse_test_only(text: str) -> float | None:
    """Seconds from the login node's clock (first line) to SLURM's estimated start, or None."""
    lines = text.splitlines()[:MAX_LINES]
    if not lines or _NOW.fullmatch(lines[0].strip()) is None:
        return None
    try:
        now = datetime.fromisoformat(lines[0].strip())
    except ValueError:
        return None
    for line in lines[1:]:
        match = _ANSWER.fullmatch(line.strip())
        if match is None:
            continue
        try:
            start = datetime.fromisoformat(match.group(1))
        except ValueError:  # 2026-13-45T99:...: digits in the right places, no time
            return None
        secs = max(0.0, (start - now).total_seconds())
        return secs if secs <= MAX_ESTIMATE_S else None
    return None


_EXIT = "'s/^.*ExitCode=\\([0-9]\\+\\):.*/\\1/p'"  # upstream's _get_returncode
_STDOUT = "'s/^.*StdOut=\\([^[:space:]]*\\).*/\\1/p'"  # upstream's _get_output


def job_end_command(job_id: str) -> str:
    """The site's shell line: a finished job's exit code on the first line, then its output
    file (upstream SlurmConnector's two ``sed`` expressions over one ``scontrol show``; used
    by :mod:`xffl.workflows.extensions.job_end`)."""
    return (f"j=$(scontrol show -o job {shlex.quote(job_id)}); "
            f"printf '%s\\n' \"$(printf '%s\\n' \"$j\" | sed -n {_EXIT})\"; "
            f"o=$(printf '%s\\n' \"$j\" | sed -n {_STDOUT}); "
            "if [ -n \"$o\" ]; then cat \"$o\"; fi")


def parse_job_end(text: str) -> tuple[int | None, str]:
    """The exit code (None: not a number) and the output that :func:`job_end_command` wrote."""
    first, _, rest = text.partition("\n")
    try:
        code: int | None = int(first.strip())
    except ValueError:
        code = None
    return code, rest.strip()
