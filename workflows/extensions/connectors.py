"""StreamFlow connectors as xffl needs them: a round's time limit is a deadline, and it is kept.

A train tool carries CWL's ``ToolTimeLimit`` (``failure.round_timeout``); StreamFlow hands it
to the connector as ``timeout``. The stock connectors of StreamFlow 0.2.0rc3 do not turn it
into what a round needs:

* ``SlurmConnector`` only passes it to sbatch as ``--time``: it replaces the facility's own
  time limit and leaves the queue wait unbounded;
* ``LocalConnector`` stops waiting after ``timeout`` but leaves the command running
  (``asyncio.wait_for`` on ``communicate()``, no kill);
* ``SlurmConnector.undeploy`` (``QueueManagerConnector``) cancels the jobs still in flight by
  calling ``_remove_jobs`` with the inner (ssh) location, whose own ``run`` then raises
  "does not wrap any inner location": no job is cancelled.

The two classes here, registered by xffl's StreamFlow plugin as ``xffl-slurm`` and
``xffl-local``, keep everything else of their parents: the deadline counts from submission
(queue wait included), the job is scancelled (the local process group killed) when it
passes, and the failure that StreamFlow sees starts with ``xffl: round timeout`` so that the
site failure manager gives the site up for the round instead of retrying.

With ``late`` in its config (``round_deadline.late: adopt``), ``xffl-slurm`` leaves a job past
the deadline running instead (no scancel), recorded as late (:mod:`xffl.workflows.steps.late`),
and the site's next train step adopts it: it polls that job id through upstream's own
``QueueManagerConnector`` polling (``_get_running_jobs``, ``_get_output``,
``_get_returncode``) instead of submitting, then moves the job's ``update/`` into its own
folder, where the tool's output glob finds it. A job late for more than ``maxRounds`` rounds
is scancelled and the step submits its own.

StreamFlow also renders each batch template with a plain ``jinja2.Template``
(``streamflow/deployment/template.py``), in which an expression such as
``{{ lipsum.__globals__.os.system(...) }}`` runs code on the coordinator. The site profile
schema refuses Jinja2 statements in the lines a site contributes; ``xffl-slurm`` also renders
its templates in Jinja2's sandbox (:class:`SandboxedTemplateMap`), so a template that got
past the schema still cannot reach Python. Its ``streamflow_environment`` and
``streamflow_workdir`` are shell-quoted (:mod:`xffl.workflows.extensions.shell`), and the workdir
it passes to ``sbatch --chdir "..."`` (upstream's double quotes) must be plain path text.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shlex
import signal
import urllib.parse
from collections.abc import MutableMapping, MutableSequence
from pathlib import Path
from typing import Any

from streamflow.core.deployment import ExecutionLocation
from streamflow.core.exception import WorkflowExecutionException
from streamflow.deployment.connector.local import LocalConnector
from streamflow.deployment.template import CommandTemplateMap

from xffl.core.layout import RunLayout
from xffl.site_profiles.schema import shell_unsafe_char
from xffl.workflows.extensions.failure import TIMEOUT_MARK
from xffl.workflows.extensions.job_end import OneTripSlurmConnector
from xffl.workflows.extensions.shell import create_command, environment_words
from xffl.workflows.steps.late import (
    LateJob,
    forget_adopted,
    is_job_id,
    leave_late,
    mark_adopted,
    read_late,
)

KILL_GRACE_S = 10.0
STDOUT = asyncio.subprocess.STDOUT


def timeout_error(job_name: str, timeout: float, what: str,
                  setting: str = "failure.round_timeout") -> WorkflowExecutionException:
    """The failure a job past its deadline (the job's ``setting``) ends with."""
    return WorkflowExecutionException(
        f"{TIMEOUT_MARK}: {job_name} was still queued or running after {timeout:g} s "
        f"({setting}); {what}")


class SandboxedTemplateMap(CommandTemplateMap):
    """StreamFlow's batch templates, compiled in Jinja2's sandbox instead of plain Templates."""

    def __init__(self, default: str, template_map: MutableMapping[str, str] | None = None):
        """As CommandTemplateMap (same checks), every template sandboxed."""
        from jinja2.sandbox import SandboxedEnvironment

        super().__init__(default, template_map)
        env = SandboxedEnvironment()
        sources = {"__DEFAULT__": default, **(template_map or {})}
        self.templates = {name: env.from_string(src) for name, src in sources.items()}

    def get_command(self, command: str, template: str | None = None,
                    environment: MutableMapping[str, str] | None = None,
                    workdir: str | None = None, **kwargs: Any) -> str:
        """Upstream's rendering, with the environment and the workdir shell-quoted."""
        name = template if template is not None and template in self.templates \
            else "__DEFAULT__"
        return self.templates[name].render(
            streamflow_command=command,
            streamflow_environment=" && ".join(environment_words(environment)),
            streamflow_workdir=shlex.quote(workdir) if workdir is not None else None,
            **kwargs)


class XfflSlurmConnector(OneTripSlurmConnector):
    """SlurmConnector whose ``timeout`` is a deadline from submission, then scancel (a job's
    end read in one round trip: :mod:`xffl.workflows.extensions.job_end`)."""

    def __init__(self, *args: Any, late: MutableMapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        """As SlurmConnector, with sandboxed templates; remembers each job's SLURM id.

        ``late`` (``{runDir, site, maxRounds}``): leave jobs past the deadline running and
        adopt them in the site's next round (see the module doc).
        """
        super().__init__(*args, **kwargs)
        self._job_ids: dict[str, str] = {}
        self.late = None if late is None else (
            RunLayout(Path(late["runDir"])), str(late["site"]), int(late["maxRounds"]))
        files = {name: Path(self.config_dir, service.file).read_text()
                 for name, service in self.services.items() if service.file is not None}
        default = (Path(self.config_dir, kwargs["file"]).read_text() if kwargs.get("file")
                   else "#!/bin/sh\n\n{{streamflow_command}}")
        self.template_map = SandboxedTemplateMap(default, files)

    @classmethod
    def get_schema(cls) -> str:
        """Upstream's schema of the slurm connector, with ``late`` (adopting late jobs)."""
        upstream: dict[str, Any] = json.loads(super().get_schema())
        base = urllib.parse.urljoin(upstream["$id"], upstream["$ref"])
        return json.dumps({
            **upstream, "$id": "https://xffl.dev/schemas/streamflow/xffl_slurm.json",
            "$ref": base,
            "properties": {**upstream["properties"], "late": {
                "type": "object", "description": "leave jobs past the deadline running and "
                "adopt them in the site's next round (round_deadline.late: adopt)",
                "properties": {
                    "runDir": {"type": "string", "description": "the run directory"},
                    "site": {"type": "string", "description": "the site's name"},
                    "maxRounds": {"type": "integer", "minimum": 1, "description": "rounds "
                                  "late beyond which a job is scancelled"}},
                "required": ["runDir", "site", "maxRounds"], "additionalProperties": False}},
        })

    async def _run_batch_command(self, command: str, environment: MutableMapping[str, str] | None,
                                 job_name: str, location: ExecutionLocation,
                                 workdir: str | None = None, stdin: int | str | None = None,
                                 stdout: int | str = STDOUT, stderr: int | str = STDOUT,
                                 timeout: int | None = None) -> str:
        """sbatch, keeping the facility's time limit; record the job id.

        Upstream writes ``--chdir "{workdir}"``: the workdir must be plain path text.
        """
        if workdir is not None and shell_unsafe_char(workdir) is not None:
            raise WorkflowExecutionException(
                f"refused to submit {job_name}: its folder {workdir!r} holds "
                f"{shell_unsafe_char(workdir)!r}, which sbatch's command line would expand")
        job_id: str = await super()._run_batch_command(
            command, environment, job_name, location, workdir, stdin, stdout, stderr, None)
        self._job_ids[job_name] = job_id
        return job_id

    async def run(self, location: ExecutionLocation, command: MutableSequence[str],
                  environment: MutableMapping[str, str] | None = None,
                  workdir: str | None = None, stdin: int | str | None = None,
                  stdout: int | str = STDOUT, stderr: int | str = STDOUT,
                  capture_output: bool = False, timeout: int | None = None,
                  job_name: str | None = None) -> tuple[str, int] | None:
        """Run a job (``job_name``) as a batch job bounded by ``timeout`` (or adopt the site's
        late one); else as upstream."""
        if not (job_name and timeout):
            result: tuple[str, int] | None = await super().run(
                location, command, environment, workdir, stdin, stdout, stderr,
                capture_output, timeout, job_name)
            return result
        rnd = _round_of(command)
        adopted = await self._adoptable(location, rnd)
        if self.late is not None and adopted is None and rnd is not None:
            forget_adopted(self.late[0], rnd, self.late[1])
        try:
            work = super().run(location, command, environment, workdir, stdin, stdout, stderr,
                               capture_output, None, job_name) if adopted is None else \
                self._adopt(location, adopted, workdir, rnd, stdout)
            result = await asyncio.wait_for(work, timeout)
            return result
        except asyncio.TimeoutError:
            job_id = adopted.job_id if adopted is not None else self._job_ids.get(job_name)
            if job_id is None:
                raise timeout_error(job_name, timeout, "it was never submitted") from None
            self._scheduled_jobs.pop(job_id, None)
            if self.late is not None and rnd is not None and workdir is not None \
                    and is_job_id(job_id):  # else cancelled: only a plain id is kept
                if adopted is None:
                    leave_late(self.late[0], LateJob(site=self.late[1], job_id=job_id,
                                                     round=rnd, workdir=workdir))
                raise timeout_error(job_name, timeout, f"SLURM job {job_id} left running "
                                    "(late: adopt)", "round_deadline.seconds") from None
            await self._remove_jobs(location, [job_id])
            raise timeout_error(job_name, timeout, f"SLURM job {job_id} scancelled") from None
        finally:
            self._job_ids.pop(job_name, None)

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

    async def _adopt(self, location: ExecutionLocation, job: LateJob, workdir: str | None,
                     rnd: int | None, stdout: int | str) -> tuple[str, int] | None:
        """Wait for the late ``job`` as upstream waits for one it submitted, then bring its
        update into this step's folder ``workdir``."""
        assert self.late is not None and rnd is not None and workdir is not None
        if shell_unsafe_char(workdir) is not None:
            raise WorkflowExecutionException(f"refused to adopt SLURM job {job.job_id}: the "
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
                        f"adopted SLURM job {job.job_id} left no update: {moved[0][:200]}")
        finally:
            mark_adopted(self.late[0], rnd, job)
        return output, code

    async def undeploy(self, external: bool) -> None:
        """scancel the jobs still in flight through their SLURM location, then as upstream."""
        groups: dict[str, tuple[ExecutionLocation, list[str]]] = {}
        scheduled: MutableMapping[str, ExecutionLocation] = self._scheduled_jobs
        for job_id, location in scheduled.items():
            groups.setdefault(location.name, (location, []))[1].append(job_id)
        scheduled.clear()
        await asyncio.gather(*(self._remove_jobs(loc, ids) for loc, ids in groups.values()),
                             return_exceptions=True)
        await super().undeploy(external)


class XfflLocalConnector(LocalConnector):
    """LocalConnector that kills a job's whole process group at its deadline or cancellation."""

    async def run(self, location: ExecutionLocation, command: MutableSequence[str],
                  environment: MutableMapping[str, str] | None = None,
                  workdir: str | None = None, stdin: int | str | None = None,
                  stdout: int | str = STDOUT, stderr: int | str = STDOUT,
                  capture_output: bool = False, timeout: int | None = None,
                  job_name: str | None = None) -> tuple[str, int] | None:
        """Run ``command`` in its own session (what upstream runs), bounded by ``timeout``."""
        if not job_name:
            result: tuple[str, int] | None = await super().run(
                location, command, environment, workdir, stdin, stdout, stderr,
                capture_output, timeout, job_name)
            return result
        line = create_command(self.__class__.__name__, command, environment, workdir,
                              stdin, stdout, stderr)
        pipe = asyncio.subprocess.PIPE if capture_output else asyncio.subprocess.DEVNULL
        proc = await asyncio.create_subprocess_exec(
            self._get_shell(), "-c", line, env=os.environ | location.environment,
            stdin=None, stdout=pipe, stderr=pipe, start_new_session=True)
        try:
            if capture_output:
                out, _ = await asyncio.wait_for(proc.communicate(), timeout)
                return out.decode().strip(), int(proc.returncode or 0)
            await asyncio.wait_for(proc.wait(), timeout)
            return None
        except asyncio.TimeoutError:
            await _kill_group(proc)
            raise timeout_error(job_name, float(timeout or 0), "its processes were killed") \
                from None
        except asyncio.CancelledError:
            await _kill_group(proc)
            raise


def _round_of(command: MutableSequence[str]) -> int | None:
    """The round a train command trains (its ``--round`` value, from xffl's own plan)."""
    for flag, value in itertools.pairwise(command):
        if flag == "--round" and value.isdigit():
            return int(value)
    return None


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM the process group of ``proc``, SIGKILL it after a grace period."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            await asyncio.wait_for(proc.wait(), wait)
            return
        except asyncio.TimeoutError:
            continue
