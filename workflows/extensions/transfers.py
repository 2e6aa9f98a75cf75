"""xffl's StreamFlow data manager: StreamFlow's own, timing each transfer to or from a site.

Every copy between the coordinator and a site goes through
``DataManager.transfer_data`` (the round's global model and job file in, the update back).
This subclass measures each such call on the coordinator's clock and, in a registered run,
stores it in the run registry (:meth:`xffl.jobs.registry.store.Registry.record_transfer`). The
report attributes a transfer to the round during which it started (rounds run one after the
other) and shows the transfer time apart from the queue wait, the start-up and the training.
Each transfer's size is that of its files on the coordinator's side (the source of what
goes to a site, the destination of what comes back): the bytes on the wire, less the tar
framing. While a transfer moves, its bytes so far, MB/s and ETA are written every
``PROGRESS_S`` seconds to ``transfers/<site>-<in|out>.json`` in the run directory (what
xffl-ssh's copies of that site have moved), which ``xffl watch`` shows; the file goes when
the transfer ends. Copies inside one deployment (the coordinator's hard links) are not timed. A
transfer that StreamFlow satisfies with a link to the copy the site already holds (a LoRA
job's frozen base model from the second round on) moves nothing and is recorded with 0
bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import stat
import time
from collections.abc import MutableSequence
from importlib.resources import files
from pathlib import Path
from typing import Any

from streamflow.core.context import StreamFlowContext
from streamflow.core.data import DataType
from streamflow.core.deployment import ExecutionLocation
from streamflow.data.manager import DefaultDataManager
from streamflow.log_handler import logger

from xffl.core.layout import RunLayout, registration

PROGRESS_S = 0.5


def progress_file(layout: RunLayout, site: str, direction: str) -> Path:
    """Where the progress of a site's transfer in ``direction`` (in, out) is kept."""
    return layout.root / "transfers" / f"{site}-{direction}.json"


def tree_bytes(path: Path) -> int | None:
    """The bytes of the regular files at ``path``, a file or a folder; None when nothing is
    there. ``path`` itself may be a link (StreamFlow links what a local site hands back
    instead of copying it); links inside are not followed."""
    try:
        top = path.stat()
    except OSError:
        return None
    if not stat.S_ISDIR(top.st_mode):
        return top.st_size if stat.S_ISREG(top.st_mode) else 0
    total = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            try:
                info = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                total += info.st_size
    return total


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
        held = self.held_at_destination(src_path, dst_locations)
        which = self.direction(src_location, dst_locations)
        reporter = None
        if which is not None and self.layout is not None:
            deployment = (dst_locations[0] if which[1] == "in" else src_location).deployment
            reporter = asyncio.ensure_future(self.report(deployment, *which))
        try:
            await super().transfer_data(src_location, src_path, dst_locations, dst_path,
                                        writable)
        finally:
            if reporter is not None:
                reporter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reporter
        if which is not None:
            site, direction = which
            here = src_path if direction == "in" else dst_path  # the coordinator's side
            self.record(site, direction, started, time.time(),
                        0 if held else tree_bytes(Path(here)))

    async def report(self, deployment: str, site: str, direction: str) -> None:
        """Write the progress of ``deployment``'s copies until cancelled; then remove it."""
        assert self.layout is not None
        path = progress_file(self.layout, site, direction)
        conn = copying_connector(self.context.deployment_manager.get_connector(deployment))
        try:
            while conn is not None:
                await asyncio.sleep(PROGRESS_S)
                copies = list(conn.progress.values())
                if not copies:
                    continue
                moved, total = sum(c.moved for c in copies), sum(c.total for c in copies)
                seconds = time.monotonic() - min(c.started for c in copies)
                rate = moved / seconds if seconds > 0 else 0.0
                write_private(path, {"site": site, "direction": direction, "bytes": moved,
                                     "total": total, "mb_s": rate / 1e6,
                                     "eta_s": (total - moved) / rate if rate else None})
        finally:
            with contextlib.suppress(OSError):
                path.unlink()

    def held_at_destination(self, src_path: str,
                            dst_locations: MutableSequence[ExecutionLocation]) -> bool:
        """Whether every destination already holds a copy of ``src_path`` (StreamFlow's own
        test in ``transfer_data``: then it links that copy and nothing crosses)."""
        primary = self.path_mapper.get(path=os.path.realpath(src_path),
                                       data_type=DataType.PRIMARY)
        return all(any(p.deployment == d.deployment and p.name == d.name for p in primary)
                   for d in dst_locations)

    def record(self, site: str, direction: str, started: float, ended: float,
               nbytes: int | None = None) -> None:
        """Store one transfer in the run's registry (nothing for an unregistered plan)."""
        reg = registration(self.layout) if self.layout is not None else None
        if reg is None:
            return
        from xffl.jobs.registry.store import Registry

        try:
            Registry(reg.registry).record_transfer(reg.run_id, site, direction, started, ended,
                                                   nbytes)
        except (OSError, sqlite3.Error) as exc:  # timing is never worth failing a round
            logger.warning(f"xffl: could not record a transfer of site {site}: {exc}")


def copying_connector(conn: Any) -> Any:
    """The xffl-ssh connector (its ``progress``) under ``conn``, if there is one: StreamFlow
    hands out a FutureConnector, and a SLURM connector wraps the SSH one."""
    for _ in range(8):
        if conn is None or isinstance(getattr(conn, "progress", None), dict):
            return conn
        inner = getattr(conn, "_connector", None)  # a FutureConnector, once deployed
        if inner is None:
            try:
                inner = conn.connector  # a ConnectorWrapper's inner connector
            except Exception:
                return None
        conn = inner
    return None


def write_private(path: Path, data: dict[str, object]) -> None:
    """Replace ``path`` with ``data`` as JSON, owner-only, in one step."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(data, out)
    os.replace(tmp, path)
