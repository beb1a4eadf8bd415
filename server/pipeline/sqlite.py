"""SQLite plumbing of the job store: schema, connections, and the group-commit writer thread.

Why a single writer thread: SQLite allows one writer at a time anyway, and a thread that drains
everything queued while the previous transaction was committing turns N small writes into one
transaction (group commit), so the cost per job falls as load rises. Each op is a callable
applied to the writer's connection; its result (or exception) resolves an asyncio future back
on the event loop with one ``call_soon_threadsafe`` per batch.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id      TEXT NOT NULL UNIQUE,
    client_id   TEXT NOT NULL,
    group_id    TEXT NOT NULL DEFAULT '',
    state       TEXT NOT NULL,
    stage       TEXT,
    attempts    INTEGER NOT NULL DEFAULT 0,
    priority    INTEGER NOT NULL DEFAULT 0,
    spec        BLOB NOT NULL,
    error       TEXT,
    reward      REAL,
    timings     TEXT,
    trajectory  BLOB,
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL,
    pruned_at   REAL
);
CREATE INDEX IF NOT EXISTS jobs_by_group ON jobs (group_id, seq);
CREATE INDEX IF NOT EXISTS jobs_by_client ON jobs (client_id, seq);
CREATE TABLE IF NOT EXISTS transitions (
    job_id  TEXT NOT NULL,
    at      REAL NOT NULL,
    state   TEXT NOT NULL,
    stage   TEXT
);
CREATE INDEX IF NOT EXISTS transitions_by_job ON transitions (job_id);
CREATE TABLE IF NOT EXISTS deliveries (
    client_id   TEXT NOT NULL,
    delivery_id INTEGER NOT NULL,
    job_id      TEXT NOT NULL,
    acked       INTEGER NOT NULL DEFAULT 0,
    acked_at    REAL,
    PRIMARY KEY (client_id, delivery_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS delivery_marks (
    client_id   TEXT PRIMARY KEY,
    last_id     INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS closed_groups (
    group_id TEXT PRIMARY KEY,
    reason   TEXT NOT NULL,
    at       REAL NOT NULL
);
"""

# Columns added after the first release: (table, column, type). Databases created before them
# get the column on open; see ``migrate``.
_ADDED_COLUMNS = (("jobs", "pruned_at", "REAL"), ("deliveries", "acked_at", "REAL"))

# Indexes on the added columns (created after ``migrate`` so old databases have the columns).
# Partial, so they only hold the rows retention looks at: acknowledged deliveries and jobs whose
# trajectory was already pruned.
INDEXES = """
CREATE INDEX IF NOT EXISTS deliveries_by_ack ON deliveries (acked_at)
    WHERE acked_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_by_pruned ON jobs (pruned_at) WHERE pruned_at IS NOT NULL;
"""


def migrate(conn: sqlite3.Connection, now: float) -> None:
    """Add the columns a database from an older release lacks.

    Deliveries acknowledged before ``acked_at`` existed get ``now`` as their ack time, so
    retention starts counting for them at the upgrade instead of never.
    """
    for table, column, kind in _ADDED_COLUMNS:
        have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
        if column not in have:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
            if (table, column) == ("deliveries", "acked_at"):
                conn.execute("UPDATE deliveries SET acked_at=? WHERE acked=1", (now,))


Op = Callable[[sqlite3.Connection], Any]
Result = tuple[asyncio.Future[Any] | None, Any, BaseException | None]


class Writer(threading.Thread):
    """The single writer: applies queued ops in batches, one transaction per batch."""

    def __init__(self, path: str, loop: asyncio.AbstractEventLoop, max_batch: int) -> None:
        super().__init__(name="jobstore-writer", daemon=True)
        self._path = path
        self._loop = loop
        self._max_batch = max_batch
        self.queue: queue.SimpleQueue[tuple[Op, asyncio.Future[Any] | None] | None] = (
            queue.SimpleQueue())
        self.ready = threading.Event()
        self.startup_error: BaseException | None = None
        self.batches = 0
        self.ops = 0

    def run(self) -> None:
        try:
            conn = connect(self._path)
            if conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0] == 0:
                # A new database: let ``PRAGMA incremental_vacuum`` hand pruned pages back to
                # the OS if an operator ever wants the file smaller. Retention itself relies
                # on SQLite reusing freed pages, which bounds the file without moving pages.
                conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
            conn.executescript(SCHEMA)
            migrate(conn, time.time())
            conn.executescript(INDEXES)
        except BaseException as exc:  # reported to open()
            self.startup_error = exc
            self.ready.set()
            return
        self.ready.set()
        stop = False
        while not stop:
            item = self.queue.get()
            batch = []
            while item is not None:
                batch.append(item)
                if len(batch) >= self._max_batch:
                    break
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
            else:
                stop = True
            if batch:
                self._apply(conn, batch)
        conn.close()

    def _apply(self, conn: sqlite3.Connection,
               batch: list[tuple[Op, asyncio.Future[Any] | None]]) -> None:
        results: list[Result] = []
        try:
            conn.execute("BEGIN")
            for op, fut in batch:
                try:
                    results.append((fut, op(conn), None))
                except Exception as exc:  # one bad op must not sink the batch
                    log.exception("job store write failed")
                    results.append((fut, None, exc))
            conn.execute("COMMIT")
        except Exception as exc:
            log.exception("job store commit failed")
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            results = [(fut, None, exc) for _, fut in batch]
        self.batches += 1
        self.ops += len(batch)
        if any(fut is not None for fut, _, _ in results):
            try:
                self._loop.call_soon_threadsafe(resolve_batch, results)
            except RuntimeError:  # loop closed during shutdown
                pass



def resolve_batch(results: list[Result]) -> None:
    for fut, value, exc in results:
        if fut is None or fut.done():
            continue
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)


def connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA foreign_keys=OFF")
    return conn
