"""The deadline of a round's batch job, and late jobs adopted, for any StreamFlow queue manager.

A train tool carries CWL's ``ToolTimeLimit`` (``failure.round_timeout``); StreamFlow hands it
to the connector as ``timeout``. :class:`DeadlineMixin` makes it a deadline from submission
(queue wait included): the job is cancelled when it passes, and the failure that StreamFlow
sees starts with ``xffl: round timeout`` so that the site failure manager gives the site up
for the round instead of retrying. Upstream's queue managers only pass it to the scheduler as
the job's time limit (which replaces the facility's own and leaves the queue wait unbounded),
and their ``undeploy`` cancels the jobs in flight with the inner (ssh) location, whose own
``run`` then raises "does not wrap any inner location": no job is cancelled.

With ``late`` in its config (``round_deadline.late: adopt``), a job past the deadline is left
running instead, recorded as late (:mod:`xffl.workflows.steps.late`), and the site's next
train step adopts it: it polls that job id through upstream's own polling
(``_get_running_jobs``, ``_get_output``, ``_get_returncode``) instead of submitting, then moves
the job's ``update/`` into its own folder, where the tool's output glob finds it. A job late
for more than ``maxRounds`` rounds is cancelled and the step submits its own.

With ``inflight`` in its config (every batch site of a run), the connector records each
train job at submission and, when a later supervisor (``xffl resume``, a cron tick after a
killed coordinator) starts the same site's step of the same round, adopts that job if it is
still queued or running, the same way, instead of submitting a second one
(:mod:`xffl.workflows.steps.inflight_jobs`).

The mixin is written against :class:`QueueManagerConnector`'s abstract methods alone
(``_run_batch_command``, ``_get_running_jobs``, ``_get_output``, ``_get_returncode``,
``_remove_jobs``), so upstream's ``SlurmConnector``, ``PBSConnector`` and ``FluxConnector``
can each take it: ``class X(DeadlineMixin, PBSConnector)``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shlex
import urllib.parse
from collections.abc import MutableMapping, MutableSequence
from pathlib import Path
from typing import Any

from streamflow.core.deployment import ExecutionLocation
from streamflow.core.exception import WorkflowExecutionException
from streamflow.deployment.connector.queue_manager import QueueManagerConnector

from xffl.core.layout import RunLayout
from xffl.site_profiles.schema import shell_unsafe_char
from xffl.workflows.extensions.failure import TIMEOUT_MARK
from xffl.workflows.steps import inflight_jobs
from xffl.workflows.steps.inflight_jobs import InflightJob
from xffl.workflows.steps.late import (
    LateJob,
    forget_adopted,
    is_job_id,
    leave_late,
    mark_adopted,
    read_late,
)

STDOUT = asyncio.subprocess.STDOUT


def timeout_error(job_name: str, timeout: float, what: str,
                  setting: str = "failure.round_timeout") -> WorkflowExecutionException:
    """The failure a job past its deadline (the job's ``setting``) ends with."""
    return WorkflowExecutionException(
        f"{TIMEOUT_MARK}: {job_name} was still queued or running after {timeout:g} s "
        f"({setting}); {what}")


class DeadlineMixin(QueueManagerConnector):
    """A queue manager whose ``timeout`` is a deadline from submission (see the module doc)."""

    JOB_WORD = "batch job"  # how messages name a job: "SLURM job"
    CANCELLED = "cancelled"  # what a cancelled job is called: "scancelled"
    SCHEMA_ID = "https://xffl.dev/schemas/streamflow/xffl_queue.json"

    def __init__(self, *args: Any, late: MutableMapping[str, Any] | None = None,
                 inflight: MutableMapping[str, Any] | None = None, **kwargs: Any) -> None:
        """As the queue manager; remembers each job's id.

        ``late`` (``{runDir, site, maxRounds}``): leave jobs past the deadline running and
        adopt them in the site's next round (see the module doc). ``inflight`` (``{runDir,
        site}``): record each job at submission; adopt one an earlier supervisor left running.
        """
        super().__init__(*args, **kwargs)
        self._job_ids: dict[str, str] = {}
        self._rounds: dict[str, int] = {}  # the round of each train job being submitted
        self.inflight = None if inflight is None else (
            RunLayout(Path(inflight["runDir"])), str(inflight["site"]))
        self.late = None if late is None else (
            RunLayout(Path(late["runDir"])), str(late["site"]), int(late["maxRounds"]))

    @classmethod
    def get_schema(cls) -> str:
        """Upstream's schema of the connector, with ``late`` (adopting late jobs)."""
        upstream: dict[str, Any] = json.loads(super().get_schema())
        base = urllib.parse.urljoin(upstream["$id"], upstream["$ref"])
        return json.dumps({
            **upstream, "$id": cls.SCHEMA_ID,
            "$ref": base,
            "properties": {**upstream["properties"], "late": {
                "type": "object", "description": "leave jobs past the deadline running and "
                "adopt them in the site's next round (round_deadline.late: adopt)",
                "properties": {
                    "runDir": {"type": "string", "description": "the run directory"},
                    "site": {"type": "string", "description": "the site's name"},
                    "maxRounds": {"type": "integer", "minimum": 1, "description": "rounds "
                                  f"late beyond which a job is {cls.CANCELLED}"}},
                "required": ["runDir", "site", "maxRounds"], "additionalProperties": False},
                "inflight": {
                    "type": "object", "description": "record each train job at submission and "
                    "adopt one an earlier supervisor left queued or running",
                    "properties": {
                        "runDir": {"type": "string", "description": "the run directory"},
                        "site": {"type": "string", "description": "the site's name"}},
                    "required": ["runDir", "site"], "additionalProperties": False}},
        })

    async def _run_batch_command(self, command: str, environment: MutableMapping[str, str] | None,
                                 job_name: str, location: ExecutionLocation,
                                 workdir: str | None = None, stdin: int | str | None = None,
                                 stdout: int | str = STDOUT, stderr: int | str = STDOUT,
                                 timeout: int | None = None) -> str:
        """Submit as upstream, keeping the facility's time limit; record the job id."""
        job_id: str = await super()._run_batch_command(
            command, environment, job_name, location, workdir, stdin, stdout, stderr, None)
        self._job_ids[job_name] = job_id
        rnd = self._rounds.get(job_name)
        if self.inflight is not None and rnd is not None and workdir is not None \
                and is_job_id(job_id):
            inflight_jobs.record_submitted(self.inflight[0], InflightJob(
                site=self.inflight[1], round=rnd, job_id=job_id, workdir=workdir))
        return job_id

    async def run(self, location: ExecutionLocation, command: MutableSequence[str],
                  environment: MutableMapping[str, str] | None = None,
                  workdir: str | None = None, stdin: int | str | None = None,
                  stdout: int | str = STDOUT, stderr: int | str = STDOUT,
                  capture_output: bool = False, timeout: int | None = None,
                  job_name: str | None = None) -> tuple[str, int] | None:
        """Run a job (``job_name``) as a batch job bounded by ``timeout`` (or adopt the site's
        late one, or its job of this round an earlier supervisor left running); else as
        upstream."""
        rnd = _round_of(command)
        if not (job_name and (timeout or (self.inflight is not None and rnd is not None))):
            result: tuple[str, int] | None = await super().run(
                location, command, environment, workdir, stdin, stdout, stderr,
                capture_output, timeout, job_name)
            return result
        adopted: LateJob | InflightJob | None = await self._adoptable(location, rnd)
        if self.late is not None and adopted is None and rnd is not None:
            forget_adopted(self.late[0], rnd, self.late[1])
        if adopted is None:
            adopted = await self._picked_up(location, rnd)
        if rnd is not None:
            self._rounds[job_name] = rnd
        outcome = True  # the step learns how its job ended (else it is cancelled)
        try:
            work = super().run(location, command, environment, workdir, stdin, stdout, stderr,
                               capture_output, None, job_name) if adopted is None else \
                self._adopt(location, adopted, workdir, rnd, stdout)
            result = await asyncio.wait_for(work, timeout)
            return result
        except asyncio.CancelledError:
            outcome = False
            raise
        except asyncio.TimeoutError:
            limit = float(timeout or 0)
            job_id = adopted.job_id if adopted is not None else self._job_ids.get(job_name)
            if job_id is None:
                raise timeout_error(job_name, limit, "it was never submitted") from None
            self._scheduled_jobs.pop(job_id, None)
            if self.late is not None and rnd is not None and workdir is not None \
                    and is_job_id(job_id):  # else cancelled: only a plain id is kept
                if not isinstance(adopted, LateJob):
                    leave_late(self.late[0], LateJob(site=self.late[1], job_id=job_id,
                                                     round=rnd, workdir=workdir))
                raise timeout_error(job_name, limit, f"{self.JOB_WORD} {job_id} left running "
                                    "(late: adopt)", "round_deadline.seconds") from None
            await self._remove_jobs(location, [job_id])
            raise timeout_error(job_name, limit,
                                f"{self.JOB_WORD} {job_id} {self.CANCELLED}") from None
        finally:  # a record of this step's job goes once its outcome is known; an earlier
            # supervisor's stays while this step has no job (its sbatch failed: the
            # scheduler's controller may be away, the job it names still running)
            mine = self._job_ids.pop(job_name, None) is not None \
                or isinstance(adopted, InflightJob)
            self._rounds.pop(job_name, None)
            if self.inflight is not None and rnd is not None and outcome and mine:
                inflight_jobs.clear_inflight(self.inflight[0], rnd, self.inflight[1])

    async def _adoptable(self, location: ExecutionLocation, rnd: int | None) -> LateJob | None:
        """The site's late job that this round's step takes over, if any; one late for more
        than ``maxRounds`` rounds is scancelled and forgotten."""
        if self.late is None or rnd is None:
            return None
        layout, site, max_rounds = self.late
        job = read_late(layout, site)
        if job is None or job.staleness(rnd) <= max_rounds:
            return job
        await self._remove_jobs(location, [job.job_id])
        layout.late_job(site).unlink(missing_ok=True)
        return None

    async def _picked_up(self, location: ExecutionLocation,
                         rnd: int | None) -> InflightJob | None:
        """This round's job that an earlier supervisor submitted, if the scheduler still has
        it queued or running (upstream's polling); one that ended is forgotten."""
        if self.inflight is None or rnd is None:
            return None
        layout, site = self.inflight
        job = inflight_jobs.read_inflight(layout, rnd, site)
        if job is None:
            return None
        self._scheduled_jobs[job.job_id] = location
        async with self._jobs_cache_lock:
            self._jobs_cache.clear()
            running = await self._get_running_jobs(location)
        if job.job_id in running:
            inflight_jobs.note(layout, inflight_jobs.adopted_message(job))
            return job
        self._scheduled_jobs.pop(job.job_id, None)
        inflight_jobs.note(layout, inflight_jobs.resubmitted_message(job))
        return None

    async def _adopt(self, location: ExecutionLocation, job: LateJob | InflightJob,
                     workdir: str | None, rnd: int | None,
                     stdout: int | str) -> tuple[str, int] | None:
        """Wait for the late or earlier supervisor's ``job`` as upstream waits for one it
        submitted, then bring its update into this step's folder ``workdir``."""
        assert rnd is not None and workdir is not None
        if shell_unsafe_char(workdir) is not None:
            raise WorkflowExecutionException(f"refused to adopt {self.JOB_WORD} {job.job_id}: the "
                                             f"folder {workdir!r} is not plain path text")
        self._scheduled_jobs[job.job_id] = location
        async with self._jobs_cache_lock:
            self._jobs_cache.clear()
        while True:
            async with self._jobs_cache_lock:
                running = await self._get_running_jobs(location)
            if job.job_id not in running:
                break
            await asyncio.sleep(self.pollingInterval)
        self._scheduled_jobs.pop(job.job_id, None)
        try:  # the job is over: whatever comes of it, it is never adopted again
            output = await self._get_output(job.job_id, location) if stdout == STDOUT else ""
            try:
                code = await self._get_returncode(job.job_id, location)
            except WorkflowExecutionException:  # SLURM forgot it (MinJobAge): an update it
                code = 0  # left is judged by admission (checksums, round, parent) as any
            if code == 0:
                moved = await super().run(location, [
                    "mv", "-T", shlex.quote(f"{job.workdir}/update"),
                    shlex.quote(f"{workdir}/update")], capture_output=True)
                if moved is not None and moved[1] != 0:
                    raise WorkflowExecutionException(
                        f"adopted {self.JOB_WORD} {job.job_id} left no update: {moved[0][:200]}")
        finally:
            if isinstance(job, LateJob):
                assert self.late is not None
                mark_adopted(self.late[0], rnd, job)
        return output, code

    async def undeploy(self, external: bool) -> None:
        """Cancel the jobs still in flight through their queue manager's location, then as
        upstream."""
        groups: dict[str, tuple[ExecutionLocation, list[str]]] = {}
        scheduled: MutableMapping[str, ExecutionLocation] = self._scheduled_jobs
        for job_id, location in scheduled.items():
            groups.setdefault(location.name, (location, []))[1].append(job_id)
        scheduled.clear()
        await asyncio.gather(*(self._remove_jobs(loc, ids) for loc, ids in groups.values()),
                             return_exceptions=True)
        await super().undeploy(external)


def _round_of(command: MutableSequence[str]) -> int | None:
    """The round a train command trains (its ``--round`` value, from xffl's own plan)."""
    for flag, value in itertools.pairwise(command):
        if flag == "--round" and value.isdigit():
            return int(value)
    return None
