"""The registry's SQLite tables, and the migration of a registry an older xffl wrote."""

from __future__ import annotations

import sqlite3

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, job_path TEXT NOT NULL, run_dir TEXT NOT NULL,
    state TEXT NOT NULL, rounds_total INTEGER NOT NULL, rounds_done INTEGER NOT NULL DEFAULT 0,
    sites TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL,
    started REAL, ended REAL, runner_pid INTEGER, message TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS rounds (
    run_id TEXT NOT NULL, round INTEGER NOT NULL, state TEXT NOT NULL,
    started REAL, ended REAL, aggregate_seconds REAL, global_path TEXT, global_digest TEXT,
    num_samples INTEGER, loss REAL, val_loss REAL, val_samples INTEGER, val_tokens INTEGER,
    PRIMARY KEY (run_id, round)
);
CREATE TABLE IF NOT EXISTS site_rounds (
    run_id TEXT NOT NULL, round INTEGER NOT NULL, site TEXT NOT NULL, state TEXT NOT NULL,
    num_samples INTEGER, num_tokens INTEGER, loss REAL, train_seconds REAL,
    reason TEXT NOT NULL DEFAULT '', attempts INTEGER NOT NULL DEFAULT 1,
    delivered_seconds REAL, startup_seconds REAL, val_loss REAL, val_loss_update REAL,
    val_samples INTEGER, val_tokens INTEGER, staleness INTEGER, staleness_weight REAL,
    late_job_id TEXT, device TEXT, gpus INTEGER, tokens_per_s_per_gpu REAL, tflops REAL,
    mfu REAL, peak_memory_gib REAL, save_seconds REAL, group_bytes_per_step REAL,
    group_bytes_round REAL, PRIMARY KEY (run_id, round, site)
);
CREATE TABLE IF NOT EXISTS transfers (
    run_id TEXT NOT NULL, site TEXT NOT NULL, direction TEXT NOT NULL,
    started REAL NOT NULL, ended REAL NOT NULL, bytes INTEGER
);
CREATE TABLE IF NOT EXISTS slurm_jobs (
    run_id TEXT NOT NULL, round INTEGER NOT NULL, site TEXT NOT NULL, job_id TEXT NOT NULL,
    state TEXT NOT NULL, queue_wait_s REAL, run_s REAL, updated REAL NOT NULL,
    name TEXT NOT NULL DEFAULT '', nodes TEXT NOT NULL DEFAULT '',
    step_from INTEGER, step_to INTEGER,
    PRIMARY KEY (run_id, round, site, job_id)
);
CREATE TABLE IF NOT EXISTS evaluations (
    run_id TEXT NOT NULL, round INTEGER NOT NULL, data_site TEXT NOT NULL, model TEXT NOT NULL,
    loss REAL NOT NULL, samples INTEGER NOT NULL, recorded REAL NOT NULL,
    PRIMARY KEY (run_id, round, data_site, model)
);
CREATE TABLE IF NOT EXISTS final_losses (
    run_id TEXT PRIMARY KEY, round INTEGER NOT NULL, val_loss REAL NOT NULL,
    val_loss_median REAL NOT NULL, val_samples INTEGER NOT NULL, val_tokens INTEGER NOT NULL,
    sites TEXT NOT NULL, site_tokens TEXT NOT NULL, recorded REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS queue_estimates (
    run_id TEXT NOT NULL, site TEXT NOT NULL, queue_wait_s REAL NOT NULL,
    source TEXT NOT NULL, recorded REAL NOT NULL, PRIMARY KEY (run_id, site)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, ts REAL NOT NULL,
    kind TEXT NOT NULL, message TEXT NOT NULL
);
"""


# columns added to SCHEMA's tables since the first registry, with their SQL types
_ADDED_COLUMNS = {
    "site_rounds": [("attempts", "INTEGER NOT NULL DEFAULT 1"), ("delivered_seconds", "REAL"),
                    ("startup_seconds", "REAL"), ("val_loss", "REAL"),
                    ("val_loss_update", "REAL"), ("val_samples", "INTEGER"),
                    ("val_tokens", "INTEGER"), ("staleness", "INTEGER"),
                    ("staleness_weight", "REAL"), ("late_job_id", "TEXT"), ("device", "TEXT"),
                    ("gpus", "INTEGER"), ("tokens_per_s_per_gpu", "REAL"), ("tflops", "REAL"),
                    ("mfu", "REAL"), ("peak_memory_gib", "REAL"), ("save_seconds", "REAL"),
                    ("group_bytes_per_step", "REAL"), ("group_bytes_round", "REAL")],
    "rounds": [("val_loss", "REAL"), ("val_samples", "INTEGER"), ("val_tokens", "INTEGER")],
    "transfers": [("bytes", "INTEGER")],
    "slurm_jobs": [("name", "TEXT NOT NULL DEFAULT ''"), ("nodes", "TEXT NOT NULL DEFAULT ''"),
                   ("step_from", "INTEGER"), ("step_to", "INTEGER")],
}


def migrate(conn: sqlite3.Connection) -> None:
    """Bring a registry written by an older xffl up to SCHEMA (columns added since)."""
    for table, added in _ADDED_COLUMNS.items():
        columns = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        for column, kind in added:
            if column not in columns:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
