"""Cancel a run: stop its runner, scancel its jobs at every SLURM site, record the outcome.

Decisions (also in `xffl cancel --help`):

* a run that already finished is left alone: a clear message and exit 0 (cancel is idempotent);
* a site that cannot be reached (after one retry) makes the command exit 3, but the run is
  still marked cancelled locally: its runner is gone, so nothing would ever finish it; the
  run's message names the sites where jobs may be left, for the user to scancel by hand.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from xffl.jobs import schedule
from xffl.jobs.records import RoundRecord, RunRecord, SiteRound
from xffl.jobs.registry import Registry
from xffl.jobs.round_lock import holder
from xffl.jobs.slurm_view import (
    SSH_TIMEOUT,
    SiteUnreachable,
    in_flight_round,
    job_ids_command,
    job_name,
    query_site,
    slurm_sites,
    ssh_run,
)
from xffl.jobs.states import RoundState, RunState, SiteState
from xffl.site_profiles.schema import SiteProfile

RUNNER_GRACE_S = 5.0
VERIFY_S = 10.0


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


def scancel_command(run_id: str, site: str, rnd: int | None = None) -> str:
    """The shell line that cancels the run's jobs at ``site``.

    By id, every job squeue lists under the site's name prefix (any round, renamed or not);
    then by name, ``scancel -n`` of the prefix (and of round ``rnd``'s name), which also
    catches a job submitted after squeue answered. Its exit status is scancel -n's.
    """
    names = [job_name(run_id, site)] + ([job_name(run_id, site, rnd)] if rnd else [])
    return (f"ids=$({job_ids_command(run_id, site)}); "
            "[ -z \"$ids\" ] || scancel $ids 2>/dev/null; "
            f"scancel -n {shlex.quote(','.join(names))}")


def scancel_site(run_id: str, site: str, profile: SiteProfile,
                 timeout: float = SSH_TIMEOUT, rnd: int | None = None) -> None:
    """scancel every job of the run on the site (any round), retried once; SiteUnreachable."""
    cmd = scancel_command(run_id, site, rnd)
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
    """Cancel ``run`` (see the module doc for the outcomes)."""
    result = CancelResult(run_id=run.id)
    if run.finished:
        result.already_finished = True
        result.state = run.state
        return result
    result.runner_stopped = stop_runner(run)
    sites = slurm_sites(Path(run.run_dir))
    rnd = in_flight_round(run)
    for site, profile in sites.items():
        try:
            scancel_site(run.id, site, profile, rnd=rnd)
            result.cancelled_sites.append(site)
        except SiteUnreachable as exc:
            result.unreachable[site] = str(exc)
    pending = set(result.cancelled_sites)
    deadline = time.monotonic() + verify_s
    while pending:
        for site in sorted(pending):
            jobs = query_site(run.id, site, sites[site], rnd, timeout=min(SSH_TIMEOUT, verify_s))
            live = [j for j in jobs if j.job_id and j.state not in {"CANCELLED", "COMPLETED"}]
            for job in jobs:
                if job.job_id:
                    registry.record_slurm_job(run.id, job.round or rnd, site, job.job_id,
                                              job.state or "", job.queue_wait_s, job.run_s,
                                              name=job.name, nodes=job.nodes)
            if all(j.reachable for j in jobs) and not live:
                pending.discard(site)
                result.left_over.pop(site, None)
            else:
                result.left_over[site] = [j.job_id or "?" for j in live]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for row in registry.slurm_jobs(run.id):
        if row["round"] == rnd and row["site"] in result.cancelled_sites \
                and row["state"] in {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING"}:
            registry.record_slurm_job(run.id, rnd, row["site"], row["job_id"], "CANCELLED",
                                      row["queue_wait_s"], row["run_s"])
    # record the round in flight and the run itself
    current = registry.get_run(run.id)
    if any(r.round == rnd and r.state == RoundState.RUNNING for r in registry.rounds(run.id)):
        registry.finish_round(run.id, RoundRecord(
            round=rnd, state=RoundState.CANCELLED, ended=time.time(),
            sites=[SiteRound(site=s, state=SiteState.CANCELLED, reason="cancelled by the user")
                   for s in current.sites]))
    message = "cancelled by the user"
    if _remove_schedule(run.id):
        message += "; its cron entry removed"
    if result.unreachable:
        message += ("; could not reach " + ", ".join(sorted(result.unreachable))
                    + ": jobs named " + ", ".join(job_name(run.id, s) + "[-r<round>]"
                                                  for s in sorted(result.unreachable))
                    + " may still be queued there")
    if result.left_over:
        message += "; still in squeue after scancel: " + ", ".join(
            f"{s} ({', '.join(ids)})" for s, ids in sorted(result.left_over.items()))
    if not result.runner_stopped:
        message += "; its supervisor did not stop"
    registry.set_state(run.id, RunState.CANCELLED, message, ended=time.time())
    return result


def _remove_schedule(run_id: str) -> bool:
    """Remove the run's crontab entry, if any (a cancelled run has no round left to tick)."""
    if schedule.current(run_id) is None:
        return False
    return schedule.remove(run_id)
