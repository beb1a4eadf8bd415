"""SQLite plumbing of the job store: schema, connections, and the group-commit writer thread.

Why a single writer thread: SQLite allows one writer at a time anyway, and a thread that drains
everything queued while the previous transaction was committing turns N small writes into one
transaction (group commit), so the cost per job falls as load rises. Each op is a callable
applied to the writer's connection; its result (or exception) resolves an asyncio future back
on the event loop with one ``call_soon_threadsafe`` per batch.

Failure rules (what callers may rely on):
- Each op runs inside its own SAVEPOINT: an op that raises half-way has its partial writes rolled
  back and only its own future fails; the other ops of the batch commit.
- A batch whose COMMIT fails (a full disk, an I/O error) fails every op of the batch: nothing of
  it is durable, and every waiter hears so.
- Store errors reach callers as :class:`StoreWriteFailed` (UNAVAILABLE): the request may be retried
  once the store is healthy again; the raw SQLite error is the ``__cause__``.
- If the writer thread itself dies (an error outside any op), every queued and every later write
  fails at once with :class:`StoreWriteFailed` instead of waiting forever on a thread that is gone.
- ``synchronous=FULL`` by default: a commit is on disk before its waiter hears of it, so an
  operating-system crash or power loss cannot lose a delivery that was announced. ``NORMAL``
  (configurable) keeps commits across a process crash only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

from rollout.server.api.errors import Unavailable

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
    pruned_at   REAL,
    in_stage    INTEGER NOT NULL DEFAULT 0,
    crashes     INTEGER NOT NULL DEFAULT 0
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

def owner_sql(client_id: str) -> str:
    """SQL for the client a job belongs to, given the SQL of its stored client id: what
    ``rollout.server.tenancy.auth.owner_of`` computes (SubmitRollout's ``rpc:<owner>#<job>`` channel
    unwraps to ``<owner>``, an anonymous ``rpc:<job>`` to "", any other id is its own owner;
    tests/server/test_store_owner.py checks that the two agree). In SQL so the store fills
    ``jobs.owner`` itself, on insert and when it backfills rows an older release wrote."""
    return (f"CASE WHEN substr({client_id}, 1, 4) = 'rpc:' THEN"
            f" CASE WHEN instr({client_id}, '#') > 0"
            f" THEN substr({client_id}, 5, instr({client_id}, '#') - 5) ELSE '' END"
            f" ELSE {client_id} END")


# Columns added after the first release: (table, column, type). Databases created before them
# get the column on open; see ``migrate``. ``owner`` is a plain column rather than a generated
# one: SQLite adds generated columns to an existing table only as VIRTUAL, and an index on a
# virtual column is never covering, so counting a tenant's jobs by state would read every one
# of its rows instead of the index alone.
_ADDED_COLUMNS = (("jobs", "pruned_at", "REAL"), ("deliveries", "acked_at", "REAL"),
                  ("jobs", "in_stage", "INTEGER NOT NULL DEFAULT 0"),
                  ("jobs", "crashes", "INTEGER NOT NULL DEFAULT 0"),
                  ("jobs", "owner", "TEXT"))

# Indexes on the added columns (created after ``migrate`` so old databases have the columns).
# The first two are partial, so they only hold the rows retention looks at: acknowledged
# deliveries and jobs whose trajectory was already pruned. The owner indexes let a tenant's
# ListJobs pages and GetServerStatus counts read only that tenant's entries. ``seq`` is the
# rowid, which every index carries last: ``jobs_by_owner`` is (owner, seq), the owner's jobs in
# submission order from any page token; ``jobs_by_owner_state`` is (owner, state, seq), which
# answers a state filter by seeking, and the counts by state from the index alone.
INDEXES = """
CREATE INDEX IF NOT EXISTS deliveries_by_ack ON deliveries (acked_at)
    WHERE acked_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_by_pruned ON jobs (pruned_at) WHERE pruned_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_by_owner ON jobs (owner);
CREATE INDEX IF NOT EXISTS jobs_by_owner_state ON jobs (owner, state);
"""


def migrate(conn: sqlite3.Connection, now: float) -> None:
    """Add the columns a database from an older release lacks.

    Deliveries acknowledged before ``acked_at`` existed get ``now`` as their ack time, so
    retention starts counting for them at the upgrade instead of never. Jobs without an
    ``owner`` get theirs; see :func:`backfill_owners`.
    """
    for table, column, kind in _ADDED_COLUMNS:
        # table_xinfo: table_info leaves generated columns out.
        have = {r[1] for r in conn.execute(f"PRAGMA table_xinfo({table})")}
        if column not in have:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
            if (table, column) == ("deliveries", "acked_at"):
                conn.execute("UPDATE deliveries SET acked_at=? WHERE acked=1", (now,))

    backfill_owners(conn)


def backfill_owners(conn: sqlite3.Connection) -> int:
    """Fill ``jobs.owner`` where it is NULL: every row of a store from before the column, and
    rows an older release inserted after an upgrade and a downgrade. Runs on every open; once
    ``jobs_by_owner`` exists the NULLs are found on the index (they sort first), so an
    up-to-date store pays one index probe. Returns the rows filled."""
    return conn.execute(
        f"UPDATE jobs SET owner = {owner_sql('client_id')} WHERE owner IS NULL").rowcount


Op = Callable[[sqlite3.Connection], Any]
Result = tuple[asyncio.Future[Any] | None, Any, BaseException | None]
SYNCHRONOUS = ("FULL", "NORMAL")
"""Values accepted for ``synchronous`` (config key ``store.synchronous``); OFF is not offered:
a power cut can then corrupt the store, not just lose its last commits."""


class StoreWriteFailed(Unavailable):
    """A write did not commit (full disk, I/O error, dead writer). Nothing of it is durable."""

    default_reason = "STORE_WRITE_FAILED"


def _failed(exc: BaseException, what: str) -> StoreWriteFailed:
    if isinstance(exc, StoreWriteFailed):
        return exc
    err = StoreWriteFailed(f"the job store could not {what}: {exc}. Nothing of this request was "
                           "stored; retry once the server's state directory is writable again")
    err.__cause__ = exc
    return err


class Writer(threading.Thread):
    """The single writer: applies queued ops in batches, one transaction per batch."""

    def __init__(self, path: str, loop: asyncio.AbstractEventLoop, max_batch: int,
                 synchronous: str = "FULL") -> None:
        super().__init__(name="jobstore-writer", daemon=True)
        if synchronous not in SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {', '.join(SYNCHRONOUS)}")
        self._path = path
        self._synchronous = synchronous
        self._loop = loop
        self._max_batch = max_batch
        self.queue: queue.SimpleQueue[tuple[Op, asyncio.Future[Any] | None] | None] = (
            queue.SimpleQueue())
        self.ready = threading.Event()
        self.startup_error: BaseException | None = None
        self.batches = 0
        self.ops = 0
        self.dead: BaseException | None = None
        """Why the thread stopped serving writes; set once, under ``_lock``."""
        self._lock = threading.Lock()

    def submit(self, op: Op, fut: asyncio.Future[Any] | None) -> None:
        """Queue ``op``; raises StoreWriteFailed at once if the writer is dead.

        The lock makes "check dead, then enqueue" atomic with "mark dead, then drain", so no
        write can slip into the queue after the dying thread emptied it.
        """
        with self._lock:
            if self.dead is not None:
                raise _failed(self.dead, "write (its writer thread stopped)")
            self.queue.put((op, fut))

    def stop(self) -> None:
        with self._lock:
            if self.dead is None:
                self.queue.put(None)

    def run(self) -> None:
        try:
            conn = connect(self._path, self._synchronous)
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
        batch: list[tuple[Op, asyncio.Future[Any] | None]] = []
        try:
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
                    batch = []
        except BaseException as exc:
            log.critical("job store writer thread died; every write now fails", exc_info=True)
            self._die(exc, batch)
        finally:
            conn.close()

    def _die(self, exc: BaseException, batch: list[tuple[Op, asyncio.Future[Any] | None]]
             ) -> None:
        """Fail the batch in hand and everything queued behind it, in one go."""
        with self._lock:
            self.dead = exc
            pending = list(batch)
            while True:
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    pending.append(item)
        err = _failed(exc, "write (its writer thread stopped)")
        self._resolve([(fut, None, err) for _, fut in pending])

    def _apply(self, conn: sqlite3.Connection,
               batch: list[tuple[Op, asyncio.Future[Any] | None]]) -> None:
        results = self._apply_whole(conn, batch) if len(batch) > 1 else None
        if results is None:
            results = self._apply_each(conn, batch)
        self.batches += 1
        self.ops += len(batch)
        self._resolve(results)

    def _apply_whole(self, conn: sqlite3.Connection,
                     batch: list[tuple[Op, asyncio.Future[Any] | None]]) -> list[Result] | None:
        """The batch in one transaction without a savepoint per op (two statements fewer
        per op, most of a bookkeeping op's cost); None when an op raised, after rolling
        everything back, so :meth:`_apply_each` runs the batch again op by op. Ops only touch
        the database, so running them twice is safe: the first run left nothing."""
        try:
            conn.execute("BEGIN")
            values: list[Result] = [(fut, op(conn), None) for op, fut in batch]
        except Exception:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            return None
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            log.error("job store commit failed (%d ops lost): %s", len(batch), exc)
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            err = _failed(exc, "commit")
            return [(fut, None, err) for _, fut in batch]
        return values

    def _apply_each(self, conn: sqlite3.Connection,
                    batch: list[tuple[Op, asyncio.Future[Any] | None]]) -> list[Result]:
        results: list[Result] = []
        try:
            conn.execute("BEGIN")
            for op, fut in batch:
                # One savepoint per op: an op that raises half-way takes back exactly its own
                # writes; the rest of the batch commits.
                conn.execute("SAVEPOINT op")
                try:
                    value = op(conn)
                except Exception as exc:  # one bad op must not sink (or half-commit) the batch
                    log.warning("job store write failed: %s", exc)
                    conn.execute("ROLLBACK TO op")
                    conn.execute("RELEASE op")
                    results.append((fut, None, _failed(exc, "write") if isinstance(
                        exc, sqlite3.Error) else exc))
                else:
                    conn.execute("RELEASE op")
                    results.append((fut, value, None))
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            log.error("job store commit failed: %d write(s) of this batch were not stored and "
                      "their callers are told so (a finished job's result is written again, "
                      "a client's request is answered UNAVAILABLE for it to retry): %s",
                      len(batch), exc)
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            err = _failed(exc, "commit")
            results = [(fut, None, err) for _, fut in batch]
        return results

    def _resolve(self, results: list[Result]) -> None:
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


def connect(path: str, synchronous: str = "FULL") -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute("PRAGMA foreign_keys=OFF")
    return conn
