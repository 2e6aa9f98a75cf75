"""Assemble what `xffl status` and `xffl runs` show from the registry."""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xffl.jobs.inflight import CopyInFlight, FinishedCopy, copies_in_flight, finished_copies
from xffl.jobs.registry.profiles_json import may_log_in
from xffl.jobs.registry.records import FinalLoss, RoundRecord, RunRecord, SiteRound
from xffl.jobs.registry.round_lock import holder
from xffl.jobs.registry.states import RoundState, RunState
from xffl.jobs.registry.store import Registry

if TYPE_CHECKING:
    from xffl.jobs.chains import RoundChain
    from xffl.jobs.report.estimates import SiteEstimate
    from xffl.jobs.slurm_view import SlurmJob


def runner_alive(run: RunRecord) -> bool:
    """Whether a process of this machine is executing the run: it holds the run's round lock.

    The lock, not the pid recorded in the registry, decides: that pid may since have been
    reused by any process, and a cron tick or a resume may have run the run since.
    """
    return holder(Path(run.run_dir)) is not None


def orphan_message(run_id: str) -> str:
    """Why a run that no process executes can no longer be ``running``."""
    return (f"its supervisor ended without recording an outcome (killed, or the disk was "
            f"full); `xffl resume {run_id}` continues from the last completed round")


def settle(registry: Registry, run: RunRecord) -> RunRecord:
    """``run`` as it really stands: one recorded ``running`` that no process runs has failed.

    Only a process holding the run's round lock sets ``running`` and it records the run's
    end before letting the lock go, so ``running`` with a free lock means that process died
    (SIGKILL, or a full disk that kept it from writing the registry). The run is marked
    failed, or, where the registry cannot be written either, shown so.
    """
    if run.state != RunState.RUNNING or runner_alive(run):
        return run
    current = registry.get_run(run.id)  # it may have ended since it was read
    if current.state != RunState.RUNNING or runner_alive(current):
        return current
    message = orphan_message(run.id)
    try:
        registry.set_state(run.id, RunState.FAILED, message, ended=time.time())
    except sqlite3.OperationalError:
        return replace(current, state=RunState.FAILED, message=message)
    return registry.get_run(run.id)


def latest_global(registry: Registry, run: RunRecord) -> str | None:
    """The path of the newest completed global checkpoint of ``run``."""
    done = [r for r in registry.rounds(run.id) if r.state == RoundState.COMPLETED and r.global_path]
    return done[-1].global_path if done else None


# JSON's one vocabulary: durations in seconds end in ``_s``, times are ISO-8601 with offset
_DURATIONS = {"train_seconds": "train_s", "delivered_seconds": "delivered_s",
              "startup_seconds": "startup_s", "aggregate_seconds": "aggregate_s",
              "save_seconds": "save_s"}
_TIMES = frozenset({"created", "updated", "started", "ended", "ts"})


def iso_time(ts: float | None) -> str | None:
    """An epoch time as JSON shows every time: ISO-8601, local, with its UTC offset."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts).astimezone().isoformat(timespec="milliseconds")


def json_fields(data: dict[str, Any]) -> dict[str, Any]:
    """Recorded fields under JSON's names: ``*_s`` durations, ISO-8601 times (``ts``: ``time``)."""
    return {("time" if k == "ts" else _DURATIONS.get(k, k)): iso_time(v) if k in _TIMES else v
            for k, v in data.items()}


def run_fields(run: RunRecord) -> dict[str, Any]:
    """A run's recorded fields as every command's JSON names them: its id is ``run_id``."""
    data = json_fields(asdict(run))
    return {"run_id": data.pop("id"), **data}


def run_summary(run: RunRecord) -> dict[str, Any]:
    """One run as a plain dict (the `xffl runs` row)."""
    data = run_fields(run)
    data["runner_alive"] = runner_alive(run) if not run.finished else False
    return data


@dataclass
class SiteStatus(SiteRound):
    """One site's round as recorded, with where its time went (:mod:`xffl.jobs.report.breakdown`).

    ``queue_wait_s + startup_seconds + train_seconds + transfer_s + other_s =
    delivered_seconds`` (the time from the round's start until the site's update was in place).
    """

    queue_wait_s: float | None = None
    transfer_s: float | None = None
    other_s: float | None = None
    tokens_per_s: float | None = None
    received_bytes: int | None = None
    sent_bytes: int | None = None


@dataclass(frozen=True)
class RoundStatus:
    """One round as recorded, its sites with their time breakdown."""

    record: RoundRecord
    sites: list[SiteStatus]
    # the median across sites of their validation losses (rounds/<r>/validation.json): the
    # robust number training.stop_when reads, beside the record's token-weighted mean
    val_loss_median: float | None = None

    def as_json(self) -> dict[str, Any]:
        """The round's fields (its wall time too), ``sites`` as a list of the sites' fields."""
        rec = self.record
        wall = rec.ended - rec.started if rec.ended is not None and rec.started is not None \
            else None
        data = json_fields({k: v for k, v in asdict(rec).items() if k != "sites"})
        return {**data, "wall_s": wall, "val_loss_median": self.val_loss_median,
                "sites": [json_fields(asdict(s)) for s in self.sites]}


@dataclass(frozen=True)
class Event:
    """One line of the run's event log."""

    ts: float
    kind: str
    message: str


@dataclass(frozen=True)
class Schedule:
    """The run's cron entry: its expression and next tick (ISO, local time, seconds)."""

    cron: str
    next_tick: str


@dataclass(frozen=True)
class Credential:
    """One SSH site's login credential and, when it blocks the next round, why."""

    site: str
    login: str
    expires: object = None
    seconds_left: object = None
    waiting: str | None = None
    renew: str | None = None


@dataclass(frozen=True)
class RunStatus:
    """Everything `xffl status` shows of one run."""

    run: RunRecord
    runner_alive: bool
    rounds: list[RoundStatus]
    latest_global: str | None
    events: list[Event]
    schedule: Schedule | None = None
    credentials: list[Credential] = field(default_factory=list)
    slurm: list[SlurmJob] = field(default_factory=list)
    estimates: list[SiteEstimate] = field(default_factory=list)
    copies: list[CopyInFlight] = field(default_factory=list)  # in flight now
    transfers: list[FinishedCopy] = field(default_factory=list)  # every finished copy
    # the final model's held-out loss, evaluated at every site after the last round
    final_loss: FinalLoss | None = None
    chains: list[RoundChain] = field(default_factory=list)  # rounds of several jobs

    def as_json(self) -> dict[str, Any]:
        """The `xffl status --json` object: the run's fields, then the rest by name."""
        return {**run_fields(self.run), "runner_alive": self.runner_alive,
                "rounds": [r.as_json() for r in self.rounds],
                "latest_global": self.latest_global,
                "events": [json_fields(asdict(e)) for e in self.events],
                "schedule": None if self.schedule is None else asdict(self.schedule),
                "credentials": [asdict(c) for c in self.credentials],
                "slurm": [j.as_dict() for j in self.slurm],
                "estimates": [e.as_dict() for e in self.estimates],
                "copies": [asdict(c) for c in self.copies],
                "transfers": [asdict(t) for t in self.transfers],
                "final_loss": None if self.final_loss is None else asdict(self.final_loss),
                "chains": [c.as_dict() for c in self.chains]}


def rounds_with_breakdown(registry: Registry, run: RunRecord) -> list[RoundStatus]:
    """The run's rounds; each site also has its queue wait, transfer time and throughput."""
    from xffl.jobs.report.breakdown import rounds_broken_down

    rounds = []
    for rnd, parts in rounds_broken_down(registry, run):
        sites = [SiteStatus(**asdict(site), queue_wait_s=b.queue_wait_s,
                            transfer_s=b.transfer_s, other_s=b.other_s,
                            tokens_per_s=b.tokens_per_s, received_bytes=b.received_bytes,
                            sent_bytes=b.sent_bytes) for site, b in parts]
        rounds.append(RoundStatus(record=rnd, sites=sites,
                                  val_loss_median=median_of(Path(run.run_dir), rnd.round)))
    return rounds


def median_of(run_dir: Path, rnd: int) -> float | None:
    """The median across sites of round ``rnd``'s validation losses, as its aggregate step
    wrote it (None: none recorded, or an unreadable file)."""
    from xffl.aggregator.metrics import VAL_LOSS_MEDIAN
    from xffl.core.layout import RunLayout

    try:
        data = json.loads(RunLayout(run_dir).validation_file(rnd).read_text())
        value = data.get(VAL_LOSS_MEDIAN)
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) else None


def run_status(registry: Registry, run: RunRecord, *, slurm: bool = False,
               live: bool = True) -> RunStatus:
    """The run, its rounds with per-site results, events, its latest global model, its
    copies in flight (while it runs) and every finished one.

    ``slurm``: also SLURM's view of its jobs (``live``: asked over SSH while it runs).
    """
    run = settle(registry, run)
    schedule = None
    if not run.finished:
        from xffl.jobs.schedule import current

        entry = current(run.id)
        if entry is not None:
            schedule = Schedule(entry.expr, entry.next_tick().astimezone()
                                .isoformat(timespec="seconds"))
    from xffl.jobs.chains import round_chains
    from xffl.jobs.report.estimates import site_estimates

    jobs: list[SlurmJob] = []
    if slurm and may_log_in(Path(run.run_dir)):
        from xffl.jobs.slurm_view import slurm_view

        jobs = slurm_view(registry, run, live=live)
    rounds = rounds_with_breakdown(registry, run)
    return RunStatus(
        run=run, runner_alive=runner_alive(run) if not run.finished else False,
        rounds=rounds,
        latest_global=latest_global(registry, run),
        events=[Event(ts, kind, msg) for ts, kind, msg in registry.events(run.id)],
        schedule=schedule,
        credentials=credential_view(run) if not run.finished else [],
        slurm=jobs,
        estimates=site_estimates(registry, run) if uses_deadline(Path(run.run_dir)) else [],
        copies=copies_in_flight(run.run_dir) if not run.finished else [],
        transfers=finished_copies(registry.transfers(run.id), [r.record for r in rounds]),
        final_loss=registry.final_loss(run.id), chains=round_chains(run, jobs))


def uses_deadline(run_dir: Path) -> bool:
    """Whether the run's job sizes rounds to a deadline (``round_deadline`` in its job.json),
    read as plain JSON: `xffl status` validates no spec."""
    from xffl.core.layout import RunLayout

    try:
        job = json.loads(RunLayout(run_dir).job_json.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(job, dict) and job.get("round_deadline") is not None


def credential_view(run: RunRecord) -> list[Credential]:
    """Each SSH site's login credential now, and why it keeps the next round waiting.

    Read locally (certificate files, the ssh-agent): no connection is made. A site whose
    credential has expired, or will before a round could end, is ``waiting``, not failed.
    """
    from xffl.core.errors import XfflError

    run_dir = Path(run.run_dir)
    try:
        if not may_log_in(run_dir):
            return []  # no login to check: nothing to read (and no SSH stack to import)
        from xffl.jobs.credential_gate import blockers, site_credentials
        from xffl.jobs.slurm_view import load_profiles
        from xffl.jobs.spec.schema import JobSpec

        profiles = load_profiles(run_dir)
        spec = JobSpec.of_run(run_dir)
        creds = site_credentials(profiles)
        blocked = {b.site: b for b in blockers(spec, profiles)}
    except (OSError, ValueError, XfflError) as exc:
        return [Credential("-", "", waiting=f"cannot read the run's site profiles: {exc}")]
    rows = []
    for site, cred in creds.items():
        info = cred.as_dict()
        rows.append(Credential(site, cred.describe(), expires=info["expires"],
                               seconds_left=info["seconds_left"],
                               waiting=blocked[site].reason if site in blocked else None,
                               renew=cred.renew))
    return rows
