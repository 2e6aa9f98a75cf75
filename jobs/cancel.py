"""Cancel a run: stop its runner, scancel its jobs at every SLURM site, record the outcome.

Decisions (also in `xffl cancel --help`):

* a run that already finished is left alone: a clear message and exit 0 (cancel is idempotent);
* what no later cron tick may undo comes first, before any facility is asked anything: the
  run's crontab entry is removed and the run recorded cancelled; then its runner is stopped
  and the round lock held until the last record, so no tick starts a round in between;
* a site that cannot be reached (after one retry) makes the command exit 3, but the run is
  still marked cancelled locally: its runner is gone, so nothing would ever finish it; the
  run's message names the sites where jobs may be left, for the user to scancel by hand;
* whatever else a facility answers (garbage from squeue or scancel) is a warning, never an
  error that stops the cancel.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from xffl.jobs import schedule
from xffl.jobs.registry.records import RoundRecord, RunRecord, SiteRound
from xffl.jobs.registry.round_lock import RoundInFlight, holder, round_lock
from xffl.jobs.registry.states import RoundState, RunState, SiteState
from xffl.jobs.registry.store import Registry
from xffl.jobs.slurm_view import (
    SLURM,
    SSH_TIMEOUT,
    SiteUnreachable,
    in_flight_round,
    job_name,
    query_site,
    slurm_sites,
    ssh_run,
)
from xffl.schedulers.base import Scheduler
from xffl.site_profiles.schema import SiteProfile

RUNNER_GRACE_S = 5.0
VERIFY_S = 10.0
LOCK_WAIT_S = 10.0  # for the round lock once the runner is stopped (a tick may hold it briefly)


@dataclass
class CancelResult:
    """What ``cancel_run`` did."""

    run_id: str
    already_finished: bool = False
    state: str = "cancelled"
    runner_stopped: bool = True
    cancelled_sites: list[str] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)
    left_over: dict[str, list[str]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    cron_removed: bool = False


def stop_runner(run: RunRecord, grace: float = RUNNER_GRACE_S) -> bool:
    """SIGTERM the process executing the run, SIGKILL it after ``grace`` s; True if it is gone.

    That process is the one holding the run's round lock (its supervisor, or the `xffl round`
    of a cron tick), never merely the pid the registry recorded, which may by now belong to
    an unrelated process. A supervisor leads its own session: its whole process group (the
    StreamFlow steps it runs) is signalled.
    """
    pid = holder(Path(run.run_dir))
    if pid is None:
        return True
    if pid == 0:  # held, but by a process this machine cannot name: signal nothing
        return False
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return True
    # never signal our own group (a foreground `xffl round` is in the caller's group)
    targets = pgid if pgid == pid and pgid != os.getpgrp() else None

    def _signal(sig: int) -> None:
        try:
            if targets is not None:
                os.killpg(targets, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def _gone() -> bool:
        # reap it if it is our child (tests start supervisors from this process)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return holder(Path(run.run_dir)) != pid

    _signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if _gone():
            break
        time.sleep(0.1)
    else:
        _signal(signal.SIGKILL)
        end = time.monotonic() + 2.0
        while time.monotonic() < end and not _gone():
            time.sleep(0.1)
    # what is left of the group (StreamFlow children) gets SIGKILL too
    if targets is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(targets, signal.SIGKILL)
    return _gone()


def scancel_command(run_id: str, site: str, rnd: int | None = None,
                    scheduler: Scheduler = SLURM) -> str:
    """The shell line that cancels the run's jobs at ``site``.

    By id, every job squeue lists under the site's name prefix (any round, renamed or not);
    then by name, ``scancel -n`` of the prefix and of round ``rnd``'s name, one name at a
    time (SLURM 22.05 matches ``-n a,b`` against no job at all), which also catches a job
    submitted after squeue answered, or one a squeue that prints garbage did not list. Its
    exit status is 0 when every ``scancel -n`` succeeded.
    """
    names = [job_name(run_id, site)] + ([job_name(run_id, site, rnd)] if rnd else [])
    return scheduler.cancel_command(job_name(run_id, site), names)


def scancel_site(run_id: str, site: str, profile: SiteProfile,
                 timeout: float = SSH_TIMEOUT, rnd: int | None = None) -> None:
    """scancel every job of the run on the site (any round), retried once; SiteUnreachable."""
    cmd = scancel_command(run_id, site, rnd, profile.scheduler or SLURM)
    last = ""
    for _attempt in range(2):
        try:
            rc, _out, err = ssh_run(profile, cmd, timeout)
        except SiteUnreachable as exc:
            last = str(exc)
            continue
        if rc == 0:
            return
        last = f"scancel failed: {err.strip()[:200]}"
    raise SiteUnreachable(last)


def cancel_run(registry: Registry, run: RunRecord, verify_s: float = VERIFY_S) -> CancelResult:
    """Cancel ``run`` (see the module doc for the order and the outcomes)."""
    result = CancelResult(run_id=run.id)
    if run.finished:
        result.already_finished = True
        result.state = run.state
        return result
    result.cron_removed = _remove_schedule(run.id, result.warnings)
    registry.set_state(run.id, RunState.CANCELLED, "cancelled by the user; stopping its runner "
                       "and its SLURM jobs", ended=time.time())
    result.runner_stopped = stop_runner(run)
    with _round_lock_within(Path(run.run_dir), LOCK_WAIT_S) as locked:
        if not locked:
            result.warnings.append("the round lock could not be taken: another process still "
                                   "executes the run")
        _cancel_jobs(registry, run, result, verify_s)
        _record(registry, run, result)
    return result


@contextlib.contextmanager
def _round_lock_within(run_dir: Path, wait: float) -> Iterator[bool]:
    """Hold the run's round lock, waited for up to ``wait`` s; yields whether it is held."""
    deadline = time.monotonic() + wait
    while True:
        try:
            with round_lock(run_dir):
                yield True
                return
        except RoundInFlight:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
    yield False


def _cancel_jobs(registry: Registry, run: RunRecord, result: CancelResult,
                 verify_s: float) -> None:
    """scancel the run's jobs at every SLURM site, then watch squeue until none is left."""
    sites = slurm_sites(Path(run.run_dir))
    rnd = in_flight_round(run)
    for site, profile in sites.items():
        try:
            scancel_site(run.id, site, profile, rnd=rnd)
            result.cancelled_sites.append(site)
        except SiteUnreachable as exc:
            result.unreachable[site] = str(exc)
        except Exception as exc:  # anything a facility may make of it
            result.warnings.append(f"site {site}: scancel: {_first_line(exc)}")
    pending = set(result.cancelled_sites)
    deadline = time.monotonic() + verify_s
    while pending:
        for site in sorted(pending):
            try:
                live = _live_jobs(registry, run, site, sites[site], rnd, verify_s)
            except Exception as exc:  # what squeue printed could not be read: stop asking
                result.warnings.append(f"site {site}: squeue: {_first_line(exc)}")
                pending.discard(site)
                continue
            if live is None:
                result.left_over[site] = []
            elif live:
                result.left_over[site] = live
            else:
                pending.discard(site)
                result.left_over.pop(site, None)
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for row in registry.slurm_jobs(run.id):
        if row["round"] == rnd and row["site"] in result.cancelled_sites \
                and row["state"] in {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING"}:
            registry.record_slurm_job(run.id, rnd, row["site"], row["job_id"], "CANCELLED",
                                      row["queue_wait_s"], row["run_s"])


def _live_jobs(registry: Registry, run: RunRecord, site: str, profile: SiteProfile, rnd: int,
               verify_s: float) -> list[str] | None:
    """The ids of the run's jobs squeue still lists at ``site`` (recorded on the way); None
    when squeue could not say."""
    jobs = query_site(run.id, site, profile, rnd, timeout=min(SSH_TIMEOUT, verify_s))
    for job in jobs:
        if job.job_id:
            registry.record_slurm_job(run.id, job.round or rnd, site, job.job_id,
                                      job.state or "", job.queue_wait_s, job.run_s,
                                      name=job.name, nodes=job.nodes)
    live = [j.job_id or "?" for j in jobs
            if j.job_id and j.state not in {"CANCELLED", "COMPLETED"}]
    return live if live or all(j.reachable for j in jobs) else None


def _record(registry: Registry, run: RunRecord, result: CancelResult) -> None:
    """Record the round in flight and the run as cancelled, with what was left behind."""
    rnd = in_flight_round(run)
    current = registry.get_run(run.id)
    if any(r.round == rnd and r.state == RoundState.RUNNING for r in registry.rounds(run.id)):
        registry.finish_round(run.id, RoundRecord(
            round=rnd, state=RoundState.CANCELLED, ended=time.time(),
            sites=[SiteRound(site=s, state=SiteState.CANCELLED, reason="cancelled by the user")
                   for s in current.sites]))
    message = "cancelled by the user"
    if result.cron_removed:
        message += "; its cron entry removed"
    if result.unreachable:
        message += ("; could not reach " + ", ".join(sorted(result.unreachable))
                    + ": jobs named " + ", ".join(job_name(run.id, s) + "[-r<round>]"
                                                  for s in sorted(result.unreachable))
                    + " may still be queued there")
    if result.left_over:
        message += "; still in squeue after scancel: " + ", ".join(
            f"{s} ({', '.join(ids) or 'squeue did not answer'})"
            for s, ids in sorted(result.left_over.items()))
    if not result.runner_stopped:
        message += "; its supervisor did not stop"
    if result.warnings:
        message += "; " + "; ".join(result.warnings)
    registry.set_state(run.id, RunState.CANCELLED, message, ended=time.time())


def _first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, at most 200 characters."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def _remove_schedule(run_id: str, warnings: list[str]) -> bool:
    """Remove the run's crontab entry, if any (a cancelled run has no round left to tick);
    a crontab that cannot be edited is a warning."""
    try:
        if schedule.current(run_id) is None:
            return False
        return schedule.remove(run_id)
    except Exception as exc:
        warnings.append(f"its cron entry could not be removed ({_first_line(exc)}): "
                        f"remove it with `xffl schedule {run_id} --remove`")
        return False
