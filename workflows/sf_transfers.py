"""xffl's StreamFlow data manager: StreamFlow's own, timing each transfer to or from a site.

Every copy between the coordinator and a site goes through
``DataManager.transfer_data`` (the round's global model and job file in, the update back).
This subclass measures each such call on the coordinator's clock and, in a registered run,
stores it in the run registry (:meth:`xffl.jobs.registry.Registry.record_transfer`). The
report attributes a transfer to the round during which it started (rounds run one after the
other) and shows the transfer time apart from the queue wait, the start-up and the training.
Copies inside one deployment (the coordinator's hard links) are not timed.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import MutableSequence
from importlib.resources import files
from pathlib import Path

from streamflow.core.context import StreamFlowContext
from streamflow.core.deployment import ExecutionLocation
from streamflow.data.manager import DefaultDataManager
from streamflow.log_handler import logger

from xffl.core.layout import RunLayout, registration


class TransferClock(DefaultDataManager):
    """StreamFlow's default data manager that records how long each site transfer took."""

    def __init__(self, context: StreamFlowContext, run_dir: str | None = None,
                 sites: dict[str, str] | None = None) -> None:
        """Configured from streamflow.yml's ``dataManager.config``."""
        super().__init__(context)
        self.layout = RunLayout(Path(run_dir)) if run_dir else None
        self.sites = sites or {}

    @classmethod
    def get_schema(cls) -> str:
        """The JSON schema of the ``config`` block."""
        return files(__package__).joinpath("schemas", "transfer_clock.json").read_text("utf-8")

    def direction(self, src: ExecutionLocation,
                  dst: MutableSequence[ExecutionLocation]) -> tuple[str, str] | None:
        """(site, ``in`` or ``out``) of a copy between the coordinator and one site, else None."""
        src_site = self.sites.get(src.deployment)
        dst_sites = {self.sites.get(loc.deployment) for loc in dst}
        if src_site is None and len(dst_sites) == 1 and None not in dst_sites:
            return str(next(iter(dst_sites))), "in"
        if src_site is not None and dst_sites == {None}:
            return src_site, "out"
        return None

    async def transfer_data(self, src_location: ExecutionLocation, src_path: str,
                            dst_locations: MutableSequence[ExecutionLocation], dst_path: str,
                            writable: bool = False) -> None:
        """StreamFlow's transfer, timed when it crosses between the coordinator and a site."""
        started = time.time()
        await super().transfer_data(src_location, src_path, dst_locations, dst_path, writable)
        which = self.direction(src_location, dst_locations)
        if which is not None:
            self.record(*which, started, time.time())

    def record(self, site: str, direction: str, started: float, ended: float) -> None:
        """Store one transfer in the run's registry (nothing for an unregistered plan)."""
        reg = registration(self.layout) if self.layout is not None else None
        if reg is None:
            return
        from xffl.jobs.registry import Registry

        try:
            Registry(reg.registry).record_transfer(reg.run_id, site, direction, started, ended)
        except (OSError, sqlite3.Error) as exc:  # timing is never worth failing a round
            logger.warning(f"xffl: could not record a transfer of site {site}: {exc}")
