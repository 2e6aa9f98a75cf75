"""StreamFlow failure manager for federated rounds: retry a site's job, then go on without it.

StreamFlow calls a failure manager's ``recover(job, step, exception)`` when a recoverable part
of a step fails: scheduling a job, staging its inputs, running its command (the
``@recoverable`` methods of streamflow.workflow.step). Its stock managers either abort the
workflow or roll the failed job back; neither lets a round continue with the facilities that
did deliver. This one, registered as ``xffl`` through xffl's StreamFlow plugin, knows which
steps belong to which site (its ``sites`` config):

* a failed training command is run again up to ``retries`` times (``retry_delay`` seconds
  apart), in the same job and working directory; a round timeout is not retried. An attempt
  whose output reports a complete checkpoint inside the round (``training.checkpoint``) of
  a later step than any before uses no retry: the next attempt continues from it
  (:func:`~xffl.workflows.steps.attempts.counts_against_retries`, bounded). A job that
  ended a chained round early to continue it (``training.checkpoint.chain``: exit 75 and
  its rank 0's line) is run again at once as the round's next job, counted as continued,
  not as a failure (:func:`~xffl.workflows.steps.attempts.continues`, bounded);
* when a site is given up (its retries are spent, its job timed out, or its login node could
  not be reached for scheduling or staging), every step of that site's job in that round
  emits an empty (null) token instead of failing. The round's admit step for the site then
  records "no update" with the reasons, and the aggregate step applies ``failure.min_sites``;
* the steps of a site's evaluation of the final model after the last round (its ``final``
  config) are retried and given up the same way: the final validation step then combines the
  other sites' numbers and names the missing site;
* a failure of any other step (admission, aggregation) fails the workflow, as StreamFlow's
  default manager does.

Each failed attempt is recorded in ``rounds/<r>/attempts/<site>.json``
(:mod:`xffl.workflows.steps.attempts`; of the final evaluation, in
``final-attempts/<site>.json``).
"""

from __future__ import annotations

import asyncio
import logging
from importlib.resources import files
from pathlib import Path

from streamflow.core.context import StreamFlowContext
from streamflow.core.recovery import FailureManager
from streamflow.core.scheduling import Hardware, JobAllocation
from streamflow.core.utils import get_entity_ids, get_tag
from streamflow.core.workflow import Job, Status, Step, Token
from streamflow.log_handler import logger
from streamflow.workflow.step import ExecuteStep, ScheduleStep
from streamflow.workflow.token import JobToken

from xffl.core.layout import RunLayout
from xffl.jobs.registry.attempts import SiteAttempts, write_attempts
from xffl.workflows.steps.attempts import continues, counts_against_retries, short_reason

TIMEOUT_MARK = "xffl: round timeout"


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` says the job ran past the round's time limit."""
    return isinstance(exc, TimeoutError) or str(exc).startswith(TIMEOUT_MARK)


def _round_of(job: Job) -> int:
    token = job.inputs.get("round")
    return int(token.value) if token is not None and isinstance(token.value, int) else 0


class SiteFailureManager(FailureManager):
    """Per-site retries, then a null output instead of a failed workflow (see module doc)."""

    def __init__(self, context: StreamFlowContext, retries: int = 0,
                 retry_delay: float = 0.0, run_dir: str | None = None,
                 sites: dict[str, list[str]] | None = None,
                 final: dict[str, list[str]] | None = None) -> None:
        """Configured from streamflow.yml's ``failureManager.config``."""
        super().__init__(context)
        self.retries = retries
        self.retry_delay = retry_delay
        self.layout = RunLayout(Path(run_dir)) if run_dir else None
        self.sites = sites or {}
        self.final = final or {}
        self.records: dict[tuple[str, int, bool], SiteAttempts] = {}

    @classmethod
    def get_schema(cls) -> str:
        """The JSON schema of the ``config`` block."""
        return files(__package__).joinpath("schemas", "site_failure_manager.json").read_text(
            "utf-8")

    async def close(self) -> None:
        """Nothing to release."""

    async def is_recovering(self, job_name: str) -> bool:
        """Retries run inside ``recover``: no job is ever in a separate recovery."""
        return False

    async def notify(self, output_port: str, output_token: Token,
                     job_token: JobToken | None = None) -> None:
        """Outputs need no bookkeeping here."""

    def site_of(self, step: Step) -> tuple[str, bool] | None:
        """The site whose job ``step`` runs or stages, if any, and whether it is the final
        model's evaluation."""
        for final, owned in ((False, self.sites), (True, self.final)):
            for site, prefixes in owned.items():
                if any(step.name == p or step.name.startswith(p + "/") for p in prefixes):
                    return site, final
        return None

    def _note(self, site: str, rnd: int, reason: str, *, timed_out: bool = False,
              final: bool = False) -> SiteAttempts:
        record = self.records.setdefault((site, rnd, final),
                                         SiteAttempts(site=site, round=rnd, final=final))
        record.failures.append(f"attempt {record.attempts}: {reason}")
        record.timed_out = record.timed_out or timed_out
        self._save(record)
        return record

    def _save(self, record: SiteAttempts) -> None:
        if self.layout is not None:
            write_attempts(self.layout, record)

    async def recover(self, job: Job, step: Step, exception: BaseException) -> None:
        """Retry or give the site up for this round; re-raise for steps of no site."""
        owner = self.site_of(step)
        if owner is None:
            raise exception
        site, final = owner
        rnd = _round_of(job)
        known = self.records.get((site, rnd, final))
        if known is not None and known.gave_up:  # a later step of a job already given up
            await self._emit_nothing(job, step)
            return
        record, timed_out, chained = self._judge(site, rnd, exception, final)
        if isinstance(step, ExecuteStep) and not timed_out:
            # an attempt that left a newer checkpoint inside the round uses no retry, nor does
            # a job that ended a chained round to continue it (and it waits no retry delay)
            while record.attempts - record.progressed - record.continued <= self.retries:
                if self.retry_delay and not chained:
                    await asyncio.sleep(self.retry_delay)
                record.attempts += 1
                self._save(record)
                logger.info(f"xffl: round {rnd} site {site}: attempt {record.attempts} of "
                            f"{job.name}")
                try:
                    # the command and the collection of its outputs, as ExecuteStep runs them,
                    # without the @recoverable wrapper that would call us again
                    await ExecuteStep._execute_command.__wrapped__(step, job, {})
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    record, timed_out, chained = self._judge(site, rnd, exc, final)
                    if timed_out:
                        break
        record.gave_up = True
        self._save(record)
        if logger.isEnabledFor(logging.WARNING):
            logger.warning(f"xffl: {'the final evaluation' if final else f'round {rnd}'} goes "
                           f"on without site {site}: {record.reason}")
        await self._emit_nothing(job, step)

    def _judge(self, site: str, rnd: int, exc: BaseException,
               final: bool) -> tuple[SiteAttempts, bool, bool]:
        """Record a failed attempt, or a job that ended a chained round to continue it (not
        a failure); the record, whether it timed out, whether it continues."""
        text = str(exc)
        record = self.records.setdefault((site, rnd, final),
                                         SiteAttempts(site=site, round=rnd, final=final))
        if not final and not is_timeout(exc) and continues(record, text):
            self._save(record)
            logger.info(f"xffl: round {rnd} site {site}: job {record.continued} of the round "
                        f"ended at step {record.best_step} of {record.steps}; the next job "
                        "continues the round")
            return record, False, True
        timed_out = is_timeout(exc)
        record = self._note(site, rnd, short_reason(text or type(exc).__name__),
                            timed_out=timed_out, final=final)
        counts_against_retries(record, text)
        return record, timed_out, False

    async def _emit_nothing(self, job: Job, step: Step) -> None:
        """Let the round go on: null outputs for this job (a bare job token for scheduling)."""
        tag = get_tag(job.inputs.values())
        if isinstance(step, ScheduleStep):
            scheduler = self.context.scheduler
            # the steps after scheduling look the job's allocation up; with no locations
            # they fail at once, and come back here to emit nothing in turn
            scheduler.job_allocations.setdefault(job.name, JobAllocation(
                job=job.name, target=step.binding_config.targets[0], locations=[],
                status=Status.FAILED, hardware=Hardware()))
            step.get_output_port().put(JobToken(value=job, tag=tag))
            return
        for port in step.get_output_ports().values():
            token = Token(value=None, tag=tag)
            port.put(await step._persist_token(
                token=token, port=port, input_token_ids=get_entity_ids(job.inputs.values())))

