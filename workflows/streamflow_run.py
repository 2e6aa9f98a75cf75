"""Run workflows of a plan with StreamFlow's Python API (what `streamflow run` does, in-process)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from xffl.workflows.extensions.lazy_kubernetes import install

install()  # before StreamFlow's connectors are imported: no Kubernetes client unless used


class ErrorLines(logging.Handler):
    """The first lines of StreamFlow's ERROR messages while a workflow runs (for the reason a
    run or an evaluation failed)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        """Keep the message's first three lines."""
        lines = [ln.strip() for ln in record.getMessage().splitlines() if ln.strip()]
        if lines:
            self.messages.append(" ".join(lines[:3])[:400])


class StepFailed(RuntimeError):
    """A step of the workflow failed (StreamFlow does not always end a workflow then)."""

    def __init__(self, step: str) -> None:
        super().__init__(f"step {step} failed")
        self.step = step


async def _watch(workflow: Any, task: asyncio.Task[Any], poll: float) -> None:
    """Cancel ``task`` as soon as any step of ``workflow`` has failed."""
    from streamflow.core.workflow import Status

    while not task.done():
        failed = [name for name, step in workflow.steps.items()
                  if step.status in (Status.FAILED, Status.CANCELLED)]
        if failed:
            task.cancel()
            raise StepFailed(failed[0])
        await asyncio.sleep(poll)


def load_config(config_file: Path) -> dict[str, Any]:
    """A streamflow.yml, validated by StreamFlow, with its path recorded (as streamflow run)."""
    from streamflow.config.validator import SfValidator
    from streamflow.ext.utils import load_extensions

    load_extensions()
    config: dict[str, Any] = SfValidator().validate_file(str(config_file))
    config["path"] = str(Path(config_file).resolve())
    return config


def open_context(config: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A StreamFlow context for ``config``, and a pristine copy of it for execute_workflow.

    StreamFlow's WorkflowConfig rewrites the deployments of the dict it is given (policy
    names become objects) and the deployment manager reads them from the context's dict:
    the context's copy is processed once here, and every workflow gets its own fresh copy.
    """
    from streamflow.config.config import WorkflowConfig
    from streamflow.main import build_context

    pristine = copy.deepcopy(config)
    first = next(iter(config.get("workflows", {})))
    WorkflowConfig(first, config)
    return build_context(config), pristine


async def execute_workflow(context: Any, config: dict[str, Any], wf_name: str, name: str,
                           outdir: Path, poll: float = 0.5,
                           on_start: Callable[[], None] | None = None) -> None:
    """Translate and run one workflow of ``config`` in ``context``; outputs land in ``outdir``.

    What streamflow.cwl.main.main does, keeping the workflow object in hand so that a failed
    step ends the run (StepFailed) instead of leaving a loop waiting for ever. ``on_start``
    is called once the workflow is translated and saved, as it starts executing.
    """
    # Imported lazily: StreamFlow pulls in a large dependency tree that most commands never need.
    import cwl_utils.parser
    import cwl_utils.parser.utils
    from streamflow.config.config import WorkflowConfig
    from streamflow.cwl.main import _parse_args
    from streamflow.cwl.translator import CWLTranslator
    from streamflow.workflow.executor import StreamFlowExecutor

    wf_config = WorkflowConfig(wf_name, copy.deepcopy(config))  # ``config``: pristine
    cwl_args = _parse_args(wf_config, context)
    definition = cwl_utils.parser.load_document_by_uri(cwl_args[0])
    inputs = cwl_utils.parser.utils.load_inputfile_by_uri(
        version=definition.cwlVersion, path=cwl_args[1],
        loadingOptions=definition.loadingOptions,
    )
    workflow = CWLTranslator(
        context=context, name=name, output_directory=str(outdir),
        cwl_definition=definition, cwl_inputs=inputs, cwl_inputs_path=cwl_args[1],
        workflow_config=wf_config,
    ).translate()
    await workflow.save(context.database)
    if on_start is not None:
        on_start()
    task = asyncio.create_task(StreamFlowExecutor(workflow).run())
    watcher = asyncio.create_task(_watch(workflow, task, poll))
    try:
        await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            await watcher  # raises StepFailed with the step's name
        raise
    finally:
        watcher.cancel()


@contextlib.contextmanager
def logging_to(log_file: Path) -> Iterator[None]:
    """Send StreamFlow's log (INFO and up) to ``log_file`` instead of stderr, for a while.

    The logger's handlers, level and propagation are put back afterwards, so that a run in
    this process (``xffl round`` in the foreground) leaves the process as it found it.
    """
    from streamflow.log_handler import logger as sf_logger

    saved = (list(sf_logger.handlers), sf_logger.propagate, sf_logger.level)
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-8s %(message)s"))
    sf_logger.handlers = [handler]
    sf_logger.propagate = False
    sf_logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        handler.close()
        sf_logger.handlers, sf_logger.propagate = saved[0], saved[1]
        sf_logger.setLevel(saved[2])
