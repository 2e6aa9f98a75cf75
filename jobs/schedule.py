"""Cron-driven rounds: the crontab entry of a run, installed, read back and removed.

The entry runs ``xffl round RUN`` with everything it needs spelled out, because cron starts
commands with an almost empty environment: the absolute path of this installation's
``xffl``, XFFL_HOME, HOME (for SSH's known_hosts) and PATH, and output appended to the run's
``cron.log``. Entries are tagged with a ``xffl:<run>`` comment, so the user's other crontab
lines are left alone (python-crontab reads and writes the crontab through ``crontab``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from croniter import croniter

from xffl.core.errors import InvalidInput
from xffl.core.paths import xffl_home
from xffl.jobs.registry.records import RunRecord
from xffl.jobs.registry.states import RunState
from xffl.jobs.spec.cron import validate_cron

if TYPE_CHECKING:
    from crontab import CronTab

PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class Schedule:
    """A run's crontab entry."""

    expr: str
    command: str

    def next_tick(self, now: datetime | None = None) -> datetime:
        """When cron next runs the entry (local time)."""
        tick: datetime = croniter(self.expr, now or datetime.now()).get_next(datetime)
        return tick


def _tag(run_id: str) -> str:
    return f"xffl:{run_id}"


def xffl_executable() -> str:
    """The absolute path of this installation's ``xffl`` command."""
    beside = Path(sys.executable).parent / "xffl"
    found = beside if beside.is_file() else shutil.which("xffl")
    if found is None:
        raise InvalidInput("cannot find the xffl command beside this Python; install xffl "
                           "(scripts/setup-venv.sh) before scheduling rounds.")
    return str(Path(found).resolve())


def crontab_safe(what: str, value: str) -> str:
    """``value`` if it can stand in a crontab line; InvalidInput naming ``what`` otherwise.

    A newline would end the entry and start one of the value's choosing; cron turns ``%``
    into a newline of the command's input. Quoting protects neither.
    """
    if "%" in value or any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise InvalidInput(f"{what} ({value!r}) holds a control character or '%', which "
                           "cannot stand in a crontab line; use a plain path without them.")
    return value


def cron_command(run: RunRecord) -> str:
    """The shell command of a run's crontab entry (every value checked, then shell-quoted)."""
    env = {"XFFL_HOME": str(xffl_home()), "HOME": os.environ.get("HOME", "/root"),
           "PATH": f"{Path(sys.executable).parent}:{PATH}"}
    # cron has no ssh-agent: an agent the user keeps at a fixed socket (`ssh-agent -a PATH`)
    # is passed on, so agent-held keys and certificates work from cron ticks too
    if os.environ.get("SSH_AUTH_SOCK"):
        env["SSH_AUTH_SOCK"] = os.environ["SSH_AUTH_SOCK"]
    for name, value in [*env.items(), ("the run directory", run.run_dir),
                        ("the xffl command", xffl_executable())]:
        crontab_safe(name, value)
    assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    log = shlex.quote(str(Path(run.run_dir) / "cron.log"))
    return (f"cd {shlex.quote(run.run_dir)} && env {assigns} {shlex.quote(xffl_executable())} "
            f"round {shlex.quote(run.id)} >> {log} 2>&1")


def _crontab() -> CronTab:
    from crontab import CronTab

    if shutil.which("crontab") is None:
        raise InvalidInput("the crontab command is missing; install cron (apt-get install "
                           "cron) to schedule rounds.")
    return CronTab(user=True)


def install(run: RunRecord, expr: str) -> Schedule:
    """Install (or replace) the run's crontab entry for the cron expression ``expr``."""
    expr = validate_cron(expr)
    if run.state in (RunState.COMPLETED, RunState.CANCELLED):
        raise InvalidInput(f"run {run.id} is {run.state}: there is no round left to schedule.")
    command = cron_command(run)  # refused before the crontab is touched
    cron = _crontab()
    cron.remove_all(comment=_tag(run.id))
    job = cron.new(command=command, comment=_tag(run.id))
    job.setall(expr)
    cron.write()
    return Schedule(expr, command)


def remove(run_id: str) -> bool:
    """Remove the run's crontab entry; whether there was one."""
    cron = _crontab()
    found = list(cron.find_comment(_tag(run_id)))
    if found:
        cron.remove_all(comment=_tag(run_id))
        cron.write()
    return bool(found)


def current(run_id: str) -> Schedule | None:
    """The run's crontab entry, if one is installed (None also when cron is not installed)."""
    if shutil.which("crontab") is None:
        return None
    for job in _crontab().find_comment(_tag(run_id)):
        return Schedule(str(job.slices), str(job.command))
    return None
