"""The run registry: one SQLite file that records runs, rounds, per-site results and events."""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from xffl.core.fstype import on_network_filesystem
from xffl.core.paths import private_dir, registry_path
from xffl.jobs.registry.records import (
    EvalCell,
    FinalLoss,
    RoundRecord,
    RunRecord,
    SiteRound,
    Transfer,
)
from xffl.jobs.registry.schema import SCHEMA, migrate
from xffl.jobs.registry.states import RoundState, RunState, SiteState


def new_run_id(name: str) -> str:
    """A unique, sortable, shell-safe run id such as ``quickstart-20261122-051000-a3f9``."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


class Registry:
    """Access to the registry database; every method opens a short transaction."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path is not None else registry_path()
        self._journal: str | None = None

    @property
    def journal_mode(self) -> str:
        """WAL on a local disk; SQLite's rollback journal on a network filesystem, where the
        write-ahead log's shared memory does not work across processes."""
        if self._journal is None:
            private_dir(self.path.parent)
            self._journal = "DELETE" if on_network_filesystem(self.path.parent) else "WAL"
        return self._journal

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        journal = self.journal_mode
        conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        conn.row_factory = sqlite3.Row
        try:
            conn.execute(f"PRAGMA journal_mode={journal}")
            conn.execute("PRAGMA busy_timeout=30000")
            conn.executescript(SCHEMA)
            migrate(conn)
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        finally:
            conn.close()

    def _select(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        """The rows of one query, read in its own transaction."""
        with self._db() as db:
            return db.execute(sql, args).fetchall()

    def create_run(self, run_id: str, name: str, job_path: Path, run_dir: Path,
                   rounds_total: int, sites: list[str]) -> RunRecord:
        """Insert a new run in state ``submitted``."""
        now = time.time()
        with self._db() as db:
            db.execute(
                "INSERT INTO runs (id, name, job_path, run_dir, state, rounds_total, sites,"
                " created, updated) VALUES (?, ?, ?, ?, 'submitted', ?, ?, ?, ?)",
                (run_id, name, str(job_path), str(run_dir), rounds_total, json.dumps(sites),
                 now, now),
            )
            self._event(db, run_id, "submitted", f"run submitted from {job_path}")
        return self.get_run(run_id)

    def delete_run(self, run_id: str) -> None:
        """Remove every trace of a run (used when submission fails half-way)."""
        with self._db() as db:
            for table, col in (("runs", "id"), ("rounds", "run_id"), ("site_rounds", "run_id"),
                               ("events", "run_id"), ("slurm_jobs", "run_id"),
                               ("transfers", "run_id"), ("evaluations", "run_id"),
                               ("queue_estimates", "run_id"), ("final_losses", "run_id")):
                db.execute(f"DELETE FROM {table} WHERE {col} = ?", (run_id,))

    def get_run(self, run_id: str) -> RunRecord:
        """The run with this id; KeyError if there is none."""
        with self._db() as db:
            row = db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise KeyError(run_id)
        return _run_from_row(row)

    def find_runs(self, prefix: str) -> list[RunRecord]:
        """Runs whose id starts with ``prefix`` (to accept unambiguous abbreviations)."""
        rows = self._select(
            "SELECT * FROM runs WHERE id LIKE ? ESCAPE '\\' ORDER BY created",
            (prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%",))
        return [_run_from_row(r) for r in rows]

    def list_runs(self) -> list[RunRecord]:
        """All runs, newest first."""
        rows = self._select("SELECT * FROM runs ORDER BY created DESC")
        return [_run_from_row(r) for r in rows]

    def set_state(self, run_id: str, state: RunState, message: str = "",
                  **fields: Any) -> None:
        """Move a run to ``state`` and log the transition as an event."""
        state = RunState(state)  # a state's name is accepted too; anything else is refused
        allowed = {"started", "ended", "runner_pid", "rounds_done"}
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"unknown run fields {sorted(unknown)}")
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._db() as db:
            db.execute(
                f"UPDATE runs SET state = ?, message = ?, updated = ?{', ' if sets else ''}{sets}"
                " WHERE id = ?",
                (state.value, message, time.time(), *fields.values(), run_id),
            )
            self._event(db, run_id, state.value, message or state.value)

    def start_round(self, run_id: str, rnd: int, sites: list[str]) -> None:
        """Record that round ``rnd`` started with these sites.

        A site's delivery time from an earlier start of the same round is kept: its update is
        reused when the round runs again (see :meth:`mark_delivered`).
        """
        now = time.time()
        with self._db() as db:
            db.execute(
                "INSERT OR REPLACE INTO rounds (run_id, round, state, started) VALUES (?, ?, "
                "'running', ?)", (run_id, rnd, now),
            )
            for site in sites:
                db.execute(
                    "INSERT OR REPLACE INTO site_rounds (run_id, round, site, state,"
                    " delivered_seconds) VALUES (?, ?, ?, 'running', (SELECT delivered_seconds"
                    " FROM site_rounds WHERE run_id = ? AND round = ? AND site = ?))",
                    (run_id, rnd, site, run_id, rnd, site),
                )
            self._event(db, run_id, "round", f"round {rnd} started")

    def finish_round(self, run_id: str, record: RoundRecord) -> None:
        """Store a completed round with every site's outcome and advance ``rounds_done``."""
        with self._db() as db:
            db.execute(
                "INSERT OR REPLACE INTO rounds (run_id, round, state, started, ended,"
                " aggregate_seconds, global_path, global_digest, num_samples, loss, val_loss,"
                " val_samples, val_tokens) VALUES (?, ?, ?, COALESCE(?, (SELECT started FROM rounds"
                " WHERE run_id = ? AND round = ?)), ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, record.round, RoundState(record.state).value, record.started, run_id,
                 record.round, record.ended, record.aggregate_seconds, record.global_path,
                 record.global_digest, record.num_samples, record.loss, record.val_loss,
                 record.val_samples, record.val_tokens),
            )
            for s in record.sites:
                # a site that delivered keeps the delivery time marked when its update arrived
                delivered = s.delivered_seconds
                if delivered is None and SiteState(s.state).delivered:
                    row = db.execute(
                        "SELECT delivered_seconds FROM site_rounds WHERE run_id = ?"
                        " AND round = ? AND site = ?", (run_id, record.round, s.site),
                    ).fetchone()
                    delivered = row[0] if row is not None else None
                db.execute(
                    "INSERT OR REPLACE INTO site_rounds (run_id, round, site, state, num_samples,"
                    " num_tokens, loss, train_seconds, reason, attempts, delivered_seconds,"
                    " startup_seconds, val_loss, val_loss_update, val_samples, val_tokens,"
                    " staleness, staleness_weight, late_job_id, device, gpus,"
                    " tokens_per_s_per_gpu, tflops, mfu, peak_memory_gib, save_seconds,"
                    " group_bytes_per_step, group_bytes_round)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?,"
                    " ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (run_id, record.round, s.site, SiteState(s.state).value, s.num_samples,
                     s.num_tokens, s.loss, s.train_seconds, s.reason, s.attempts, delivered,
                     s.startup_seconds, s.val_loss, s.val_loss_update, s.val_samples,
                     s.val_tokens, s.staleness, s.staleness_weight, s.late_job_id, s.device,
                     s.gpus, s.tokens_per_s_per_gpu, s.tflops, s.mfu, s.peak_memory_gib,
                     s.save_seconds, s.group_bytes_per_step, s.group_bytes_round),
                )
            if record.state == RoundState.COMPLETED:
                db.execute(
                    "UPDATE runs SET rounds_done = MAX(rounds_done, ?), updated = ? WHERE id = ?",
                    (record.round, time.time(), run_id),
                )
            self._event(db, run_id, "round", f"round {record.round} {record.state}")

    def rounds(self, run_id: str) -> list[RoundRecord]:
        """Every recorded round of a run with its sites, in order."""
        with self._db() as db:
            rows = db.execute("SELECT * FROM rounds WHERE run_id = ? ORDER BY round",
                              (run_id,)).fetchall()
            site_rows = db.execute(
                "SELECT * FROM site_rounds WHERE run_id = ? ORDER BY round, site", (run_id,)
            ).fetchall()
        by_round: dict[int, list[SiteRound]] = {}
        for s in site_rows:
            by_round.setdefault(s["round"], []).append(
                SiteRound(site=s["site"], state=SiteState(s["state"]), num_samples=s["num_samples"],
                          num_tokens=s["num_tokens"], loss=s["loss"],
                          train_seconds=s["train_seconds"], reason=s["reason"],
                          attempts=s["attempts"], delivered_seconds=s["delivered_seconds"],
                          startup_seconds=s["startup_seconds"], val_loss=s["val_loss"],
                          val_loss_update=s["val_loss_update"], val_samples=s["val_samples"],
                          val_tokens=s["val_tokens"],
                          staleness=s["staleness"], staleness_weight=s["staleness_weight"],
                          late_job_id=s["late_job_id"], device=s["device"], gpus=s["gpus"],
                          tokens_per_s_per_gpu=s["tokens_per_s_per_gpu"], tflops=s["tflops"],
                          mfu=s["mfu"], peak_memory_gib=s["peak_memory_gib"],
                          save_seconds=s["save_seconds"],
                          group_bytes_per_step=s["group_bytes_per_step"],
                          group_bytes_round=s["group_bytes_round"])
            )
        return [
            RoundRecord(round=r["round"], state=RoundState(r["state"]), started=r["started"],
                        ended=r["ended"], aggregate_seconds=r["aggregate_seconds"],
                        global_path=r["global_path"], global_digest=r["global_digest"],
                        num_samples=r["num_samples"], loss=r["loss"], val_loss=r["val_loss"],
                        val_samples=r["val_samples"], val_tokens=r["val_tokens"],
                        sites=by_round.get(r["round"], []))
            for r in rows
        ]

    def mark_delivered(self, run_id: str, rnd: int, site: str,
                       at: float | None = None) -> float | None:
        """Record that ``site``'s update of round ``rnd`` is in place on the coordinator now.

        Stored as seconds since the round's recorded start (``at``: the epoch time, default
        now); returns them, or None when the round or site is not recorded.
        """
        now = time.time() if at is None else at
        with self._db() as db:
            row = db.execute("SELECT started FROM rounds WHERE run_id = ? AND round = ?",
                             (run_id, rnd)).fetchone()
            if row is None or row["started"] is None:
                return None
            seconds = max(0.0, now - row["started"])
            cur = db.execute(
                "UPDATE site_rounds SET delivered_seconds = ? WHERE run_id = ? AND round = ?"
                " AND site = ?", (seconds, run_id, rnd, site))
        return seconds if cur.rowcount else None

    def record_slurm_job(self, run_id: str, rnd: int, site: str, job_id: str, state: str,
                         queue_wait_s: float | None, run_s: float | None,
                         name: str = "", nodes: str = "",
                         steps: tuple[int, int] | None = None) -> None:
        """Store what SLURM last said about one site's job in one round.

        Values not known now (None, or an empty name or node list) keep what was recorded.
        ``steps``: the round's steps the job took (from, to), a chained round's job.
        """
        step_from, step_to = steps if steps is not None else (None, None)
        with self._db() as db:
            db.execute(
                "INSERT INTO slurm_jobs (run_id, round, site, job_id, state, queue_wait_s,"
                " run_s, updated, name, nodes, step_from, step_to)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (run_id, round, site, job_id) DO UPDATE SET"
                " state = excluded.state, updated = excluded.updated,"
                " queue_wait_s = COALESCE(excluded.queue_wait_s, queue_wait_s),"
                " run_s = COALESCE(excluded.run_s, run_s),"
                " name = COALESCE(NULLIF(excluded.name, ''), name),"
                " nodes = COALESCE(NULLIF(excluded.nodes, ''), nodes),"
                " step_from = COALESCE(excluded.step_from, step_from),"
                " step_to = COALESCE(excluded.step_to, step_to)",
                (run_id, rnd, site, job_id, state, queue_wait_s, run_s, time.time(), name,
                 nodes, step_from, step_to),
            )

    def slurm_jobs(self, run_id: str) -> list[dict[str, Any]]:
        """Every SLURM job recorded for a run, by round and site."""
        rows = self._select(
            "SELECT round, site, job_id, name, nodes, state, queue_wait_s, run_s, updated,"
            " step_from, step_to FROM slurm_jobs WHERE run_id = ?"
            " ORDER BY round, site, updated", (run_id,))
        return [dict(r) for r in rows]

    def record_queue_estimate(self, run_id: str, site: str, queue_wait_s: float,
                              source: str) -> None:
        """Store a queue-wait estimate of ``site`` taken before its first round (``source``:
        how, e.g. ``sbatch --test-only``); it seeds the site's queue-wait average."""
        with self._db() as db:
            db.execute("INSERT OR REPLACE INTO queue_estimates (run_id, site, queue_wait_s,"
                       " source, recorded) VALUES (?, ?, ?, ?, ?)",
                       (run_id, site, queue_wait_s, source, time.time()))

    def queue_estimates(self, run_id: str) -> dict[str, float]:
        """The run's recorded queue-wait seeds, by site."""
        rows = self._select(
            "SELECT site, queue_wait_s FROM queue_estimates WHERE run_id = ?", (run_id,))
        return {r["site"]: float(r["queue_wait_s"]) for r in rows}

    def record_transfer(self, run_id: str, site: str, direction: str, started: float,
                        ended: float, nbytes: int | None = None) -> None:
        """Store one StreamFlow transfer between the coordinator and ``site`` (``in``: to the
        site, ``out``: back from it): epoch times on the coordinator and the bytes moved."""
        with self._db() as db:
            db.execute("INSERT INTO transfers (run_id, site, direction, started, ended, bytes)"
                       " VALUES (?, ?, ?, ?, ?, ?)",
                       (run_id, site, direction, started, ended, nbytes))

    def transfers(self, run_id: str) -> list[Transfer]:
        """Every recorded transfer of a run, in the order they started."""
        rows = self._select(
            "SELECT site, direction, started, ended, bytes FROM transfers WHERE run_id = ?"
            " ORDER BY started", (run_id,))
        return [Transfer(r["site"], r["direction"], r["started"], r["ended"], r["bytes"])
                for r in rows]

    def record_evaluations(self, run_id: str, cells: list[EvalCell]) -> None:
        """Store a cross-site evaluation (replacing the same cells of an earlier one)."""
        now = time.time()
        with self._db() as db:
            db.executemany(
                "INSERT OR REPLACE INTO evaluations (run_id, round, data_site, model, loss,"
                " samples, recorded) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(run_id, c.round, c.data_site, c.model, c.loss, c.samples, now)
                 for c in cells])

    def evaluations(self, run_id: str) -> list[EvalCell]:
        """Every recorded cross-site evaluation cell of a run, by round, data site, model."""
        rows = self._select(
            "SELECT round, data_site, model, loss, samples FROM evaluations WHERE"
            " run_id = ? ORDER BY round, data_site, model", (run_id,))
        return [EvalCell(r["round"], r["data_site"], r["model"], r["loss"], r["samples"])
                for r in rows]

    def record_final(self, run_id: str, final: FinalLoss) -> None:
        """Store the final model's held-out loss (replacing an earlier one)."""
        with self._db() as db:
            db.execute(
                "INSERT OR REPLACE INTO final_losses (run_id, round, val_loss, val_loss_median,"
                " val_samples, val_tokens, sites, site_tokens, recorded) VALUES"
                " (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, final.round, final.val_loss, final.val_loss_median, final.val_samples,
                 final.val_tokens, json.dumps(final.sites), json.dumps(final.site_tokens),
                 time.time()))

    def final_loss(self, run_id: str) -> FinalLoss | None:
        """The final model's held-out loss of a run, if it was measured."""
        rows = self._select("SELECT * FROM final_losses WHERE run_id = ?", (run_id,))
        if not rows:
            return None
        r = rows[0]
        return FinalLoss(round=r["round"], val_loss=r["val_loss"],
                         val_loss_median=r["val_loss_median"], val_samples=r["val_samples"],
                         val_tokens=r["val_tokens"], sites=json.loads(r["sites"]),
                         site_tokens=json.loads(r["site_tokens"]))

    def events(self, run_id: str) -> list[tuple[float, str, str]]:
        """The run's event log: (time, kind, message)."""
        rows = self._select(
            "SELECT ts, kind, message FROM events WHERE run_id = ? ORDER BY id", (run_id,))
        return [(r["ts"], r["kind"], r["message"]) for r in rows]

    def event(self, run_id: str, kind: str, message: str) -> None:
        """Append one entry to the run's event log."""
        with self._db() as db:
            self._event(db, run_id, kind, message)

    @staticmethod
    def _event(db: sqlite3.Connection, run_id: str, kind: str, message: str) -> None:
        db.execute(
            "INSERT INTO events (run_id, ts, kind, message) VALUES (?, ?, ?, ?)",
            (run_id, time.time(), kind, message),
        )


def _run_from_row(row: sqlite3.Row) -> RunRecord:
    data = dict(row)
    data["sites"] = json.loads(data["sites"])
    data["state"] = RunState(data["state"])
    return RunRecord(**data)
