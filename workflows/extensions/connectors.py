"""StreamFlow connectors as xffl needs them: a round's time limit is a deadline, and it is kept.

A train tool carries CWL's ``ToolTimeLimit`` (``failure.round_timeout``); StreamFlow hands it
to the connector as ``timeout``. The stock connectors of StreamFlow 0.2.0rc3 do not turn it
into what a round needs:

* ``SlurmConnector`` only passes it to sbatch as ``--time``: it replaces the facility's own
  time limit and leaves the queue wait unbounded, and its ``undeploy`` cancels no job;
* ``LocalConnector`` stops waiting after ``timeout`` but leaves the command running
  (``asyncio.wait_for`` on ``communicate()``, no kill).

The classes here, registered by xffl's StreamFlow plugin as ``xffl-<scheduler>`` (one per
scheduler of :mod:`xffl.schedulers.registry`: ``xffl-slurm``) and ``xffl-local``, keep
everything else of their parents. A scheduler's class is built from its registry entry:
StreamFlow's own connector of the scheduler (``SlurmConnector``; upstream's ``PBSConnector``
and ``FluxConnector`` would do as well) under :class:`XfflQueueConnector`, which takes the
deadline (the job cancelled when it passes) and the adoption of late jobs
(``round_deadline.late: adopt``) from
:class:`~xffl.workflows.extensions.deadline.DeadlineMixin` (written against StreamFlow's
queue-manager methods alone), and checks what reaches the submit command. ``xffl-local``
kills the local process group at the deadline.

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
import importlib
import os
import shlex
import signal
from collections.abc import MutableMapping, MutableSequence
from pathlib import Path
from typing import Any

from streamflow.core.deployment import ExecutionLocation
from streamflow.core.exception import WorkflowExecutionException
from streamflow.deployment.connector.local import LocalConnector
from streamflow.deployment.connector.queue_manager import QueueManagerConnector, SlurmConnector
from streamflow.deployment.template import CommandTemplateMap

from xffl.schedulers.base import Scheduler
from xffl.schedulers.registry import SCHEDULERS
from xffl.site_profiles.schema import shell_unsafe_char
from xffl.workflows.extensions.deadline import STDOUT, DeadlineMixin, timeout_error
from xffl.workflows.extensions.job_end import OneTripSlurmConnector
from xffl.workflows.extensions.shell import create_command, environment_words

KILL_GRACE_S = 10.0
#: xffl's refinements of upstream's connectors, taken in their place: SLURM's reads a
#: finished job's output and exit code in one round trip (:mod:`.job_end`)
REFINED: dict[type[QueueManagerConnector], type[QueueManagerConnector]] = {
    SlurmConnector: OneTripSlurmConnector}


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


class XfflQueueConnector(DeadlineMixin):
    """A scheduler's StreamFlow connector as xffl runs it: the deadline and late adoption
    (:class:`DeadlineMixin`), sandboxed templates, and a job folder that is plain path text.
    Each scheduler's class is built from its entry in :mod:`xffl.schedulers.registry`
    (:func:`queue_connector_class`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """As the scheduler's connector with the deadline (``late``: :class:`DeadlineMixin`),
        with sandboxed templates."""
        super().__init__(*args, **kwargs)
        files = {name: Path(self.config_dir, service.file).read_text()
                 for name, service in self.services.items() if service.file is not None}
        default = (Path(self.config_dir, kwargs["file"]).read_text() if kwargs.get("file")
                   else "#!/bin/sh\n\n{{streamflow_command}}")
        self.template_map = SandboxedTemplateMap(default, files)

    async def _run_batch_command(self, command: str, environment: MutableMapping[str, str] | None,
                                 job_name: str, location: ExecutionLocation,
                                 workdir: str | None = None, stdin: int | str | None = None,
                                 stdout: int | str = STDOUT, stderr: int | str = STDOUT,
                                 timeout: int | None = None) -> str:
        """Submit, keeping the facility's time limit; record the job id.

        Upstream puts the workdir in the submit command's double quotes (SLURM's ``--chdir
        "{workdir}"``): it must be plain path text.
        """
        if workdir is not None and shell_unsafe_char(workdir) is not None:
            raise WorkflowExecutionException(
                f"refused to submit {job_name}: its folder {workdir!r} holds "
                f"{shell_unsafe_char(workdir)!r}, which sbatch's command line would expand")
        job_id: str = await super()._run_batch_command(
            command, environment, job_name, location, workdir, stdin, stdout, stderr, timeout)
        return job_id


def queue_connector_class(scheduler: Scheduler) -> type[XfflQueueConnector]:
    """``xffl-<scheduler>``: :class:`XfflQueueConnector` over the scheduler's own StreamFlow
    connector (its ``streamflow_connector``), with its words in messages and its schema id."""
    module, _, name = scheduler.streamflow_connector.partition(":")
    base = getattr(importlib.import_module(module), name)
    if not (isinstance(base, type) and issubclass(base, QueueManagerConnector)):
        raise TypeError(f"{scheduler.streamflow_connector} is not a StreamFlow queue manager")
    base = REFINED.get(base, base)
    made: type[XfflQueueConnector] = type(f"Xffl{name}", (XfflQueueConnector, base), {
        "__doc__": f"{name} whose ``timeout`` is a deadline from submission, then "
                   f"{scheduler.cancelled_word}.",
        "__module__": __name__,
        "JOB_WORD": scheduler.job_word, "CANCELLED": scheduler.cancelled_word,
        "SCHEMA_ID": f"https://xffl.dev/schemas/streamflow/xffl_{scheduler.name}.json"})
    return made


# xffl's connector of each batch scheduler (schedulers.registry), registered as xffl-<name>
QUEUE_CONNECTORS: dict[str, type[XfflQueueConnector]] = {
    name: queue_connector_class(sched) for name, sched in SCHEDULERS.items()}
XfflSlurmConnector = QUEUE_CONNECTORS["slurm"]


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
