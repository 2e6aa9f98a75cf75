"""A SLURM job's end in one SSH round trip instead of three.

Once a job has left ``squeue``, upstream's ``SlurmConnector`` (StreamFlow 0.2.0rc3) asks the
site three times, one SSH command after the other, on the round's critical path:
``scontrol show -o job ID`` for the job's ``StdOut`` path, ``cat`` of that file, and
``scontrol show -o job ID`` again for its ``ExitCode``. :class:`OneTripSlurmConnector` asks
once: one command that reads the job's record once and prints the exit code (upstream's own ``sed``
expression) on its first line and the output file (found by upstream's other expression)
after it. The answers mean what upstream's mean: the output is the file's text, stripped;
an exit code that is not a number (no record, or none in it) is asked again through upstream,
which raises its own error. The job id is quoted for the site's shell (upstream writes it
bare).
"""

from __future__ import annotations

from typing import Any

from streamflow.core.deployment import ExecutionLocation
from streamflow.deployment.connector.queue_manager import SlurmConnector

from xffl.schedulers.slurm_login import job_end_command, parse_job_end


class OneTripSlurmConnector(SlurmConnector):
    """Upstream's ``SlurmConnector`` whose ``_get_output`` and ``_get_returncode`` come from one
    command (upstream calls the first, then the second, for each finished job)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """As upstream's."""
        super().__init__(*args, **kwargs)
        self._ends: dict[str, int | None] = {}

    async def _job_end(self, job_id: str, location: ExecutionLocation) -> tuple[int | None, str]:
        stdout, _ = await self.run(location=location, command=[job_end_command(job_id)],
                                   capture_output=True)
        return parse_job_end(stdout)

    async def _get_output(self, job_id: str, location: ExecutionLocation) -> str:
        """The job's output; its exit code kept for ``_get_returncode``."""
        self._ends[job_id], output = await self._job_end(job_id, location)
        return output

    async def _get_returncode(self, job_id: str, location: ExecutionLocation) -> int:
        """The job's exit code: the one ``_get_output`` read (else one round trip); upstream's
        own call (and error) when the site gave no number."""
        if job_id in self._ends:
            code = self._ends.pop(job_id)
        else:
            code, _ = await self._job_end(job_id, location)
        if code is not None:
            return code
        upstream: int = await super()._get_returncode(job_id, location)
        return upstream
