"""TensorBoard as a tracker: one event file per logged round, under <folder>/<run id>/."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xffl.jobs.tracking.tracker import Tracker

if TYPE_CHECKING:
    from xffl.jobs.registry.records import RunRecord


class TensorBoardTracker(Tracker):
    """Event files in a folder on the coordinator (TensorBoard's writer, no torch)."""

    backend = "TensorBoard"

    def log(self, run: RunRecord, params: dict[str, Any], step: int, wall_time: float,
            scalars: dict[str, float]) -> None:
        """Write one event file: a restart at ``step``, then the round's scalars.

        The SessionLog START makes TensorBoard drop what an earlier file logged at ``step``
        and after (a resumed run that repeats a round), as torch's SummaryWriter(purge_step=)
        does. Event files are read in name order: the names start with the time in ns.
        """
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        folder = Path(self.target) / run.id
        folder.mkdir(parents=True, exist_ok=True)
        now = time.time_ns()
        name = (f"events.out.tfevents.{now // 10**9:010d}.{now % 10**9:09d}."
                f"{socket.gethostname()}.{os.getpid()}")
        values = [Summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()]
        events = [Event(wall_time=wall_time, file_version="brain.Event:2"),
                  Event(wall_time=wall_time, step=step,
                        session_log=SessionLog(status=SessionLog.START)),
                  Event(wall_time=wall_time, step=step, summary=Summary(value=values))]
        partial = folder / f".xffl-{now}.partial"  # not "tfevents": TensorBoard never reads it
        with partial.open("wb") as out:
            writer = RecordWriter(out)
            for event in events:
                writer.write(event.SerializeToString())
        os.replace(partial, folder / name)
