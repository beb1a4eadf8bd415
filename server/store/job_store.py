"""Durable job store: SQLite in WAL mode, one writer thread with group commit.

Why this shape:
- WAL with ``synchronous=FULL`` (the default; ``NORMAL`` is configurable): a transaction is on
  disk before anyone hears it committed, so even an OS crash cannot take back an announced
  delivery. Group commit pays the fsync once per batch, not once per job.
- Every write goes through ONE writer thread that drains whatever has queued up while the last
  transaction was committing and applies it all in one transaction (group commit). Throughput
  then grows with load instead of being capped by one commit per job, and the event loop never
  blocks on SQLite.
- Reads use a second connection on a reader thread; WAL lets them run beside the writer.
- Writes keep their submission order (one FIFO), so "stage started" can never overtake
  "job finished" for the same job. Callers that need durability (submit, a finished job's
  delivery, acks) await the returned future; progress bookkeeping is fire-and-forget.
- Delivery ids are assigned inside the transaction that writes the delivery (a per-client
  counter row in ``delivery_marks``), so ids follow commit order and an id exists only if its
  delivery committed: a failed finish leaves no id behind that a later job could be given. The
  scheduler announces a delivery only after that transaction committed.
- ``attempts`` counts INIT starts (what GetJob reports); ``crashes`` counts the times the process
  died while the job was inside a stage (``in_stage``), the only thing ``max_attempts`` limits.
  A job waiting in a queue, or stopped by a graceful shutdown, is not charged.
- ``owner`` (the client a job belongs to, SubmitRollout's ``rpc:<owner>#<job>`` channels
  unwrapped) is a column the store fills itself, indexed, so a tenant's list pages and counts
  read that tenant's index entries instead of the whole job list
  (``server/tenancy/tenant_status.py``).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from rollout.server.store import file as store_file
from rollout.server.store.job_pruning import JobPruning
from rollout.server.store.job_reads import JobReads
from rollout.server.store.job_writes import JobWrites
from rollout.server.store.records import StoreClosed
from rollout.server.store.sqlite import Op, StoreWriteFailed, Writer, connect

log = logging.getLogger(__name__)
T = TypeVar("T")


class JobStore(JobWrites, JobReads, JobPruning):
    """Jobs, their transitions, and per-client deliveries of finished trajectories.

    This class owns the connections (the writer thread, the reader thread) and the two
    primitives the parts use: ``_write`` for :class:`JobWrites` and :class:`JobPruning`,
    ``_read`` for :class:`JobReads`. The parts hold no state of their own.
    """
    def __init__(self, path: str | Path, *, max_batch: int = 2048,
                 synchronous: str = "FULL") -> None:
        self.path = str(path)
        self._max_batch = max_batch
        self._synchronous = synchronous
        self._writer: Writer | None = None
        self._reader: ThreadPoolExecutor | None = None
        self._reader_local = threading.local()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        stamp = False
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            stamp = await asyncio.to_thread(store_file.check_store_file, Path(self.path))
        self._loop = asyncio.get_running_loop()
        self._writer = Writer(self.path, self._loop, self._max_batch, self._synchronous)
        self._writer.start()
        await asyncio.to_thread(self._writer.ready.wait)
        if self._writer.startup_error is not None:
            err = self._writer.startup_error
            self._writer = None
            if isinstance(err, sqlite3.DatabaseError):
                raise store_file.damaged(Path(self.path), err) from None
            raise err
        if stamp:
            fut = self._write(lambda c: c.execute(
                f"PRAGMA application_id={store_file.APPLICATION_ID}"), True)
            assert fut is not None
            await fut
        # delivery_marks holds each client's highest delivery id ever issued (ids must never be
        # reused, or a client's ``acked_through`` would acknowledge deliveries it has not seen).
        # Stores written before the counter lived there get it from their deliveries once.
        fut = self._write(lambda c: c.execute(
            "INSERT INTO delivery_marks SELECT client_id, MAX(delivery_id) FROM deliveries"
            " WHERE true GROUP BY client_id ON CONFLICT(client_id)"
            " DO UPDATE SET last_id=MAX(last_id, excluded.last_id)"), True)
        assert fut is not None
        await fut
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="jobstore-reader")

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.stop()
            await asyncio.to_thread(self._writer.join)
            self._writer = None
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None

    @property
    def write_stats(self) -> tuple[int, int]:
        """(transactions, ops) committed so far; ops/transactions is the group-commit factor."""
        w = self._writer
        return (w.batches, w.ops) if w else (0, 0)

    # -- plumbing ----------------------------------------------------------------------------

    def _write(self, op: Op, wait: bool) -> asyncio.Future[Any] | None:
        if self._writer is None or self._loop is None:
            raise StoreClosed("job store is not open")
        fut = self._loop.create_future() if wait else None
        try:
            self._writer.submit(op, fut)  # raises StoreWriteFailed at once if the writer died
        except StoreWriteFailed:
            if wait:
                raise
            # Fire-and-forget writes are bookkeeping (stage entered, left a stage); losing one
            # never loses a job, and raising would strand the caller's job mid-flight.
            log.warning("job store writer is dead; a bookkeeping write was dropped")
        return fut

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._reader is None:
            raise StoreClosed("job store is not open")

        def call() -> T:
            conn = getattr(self._reader_local, "conn", None)
            if conn is None:
                conn = self._reader_local.conn = connect(self.path)
            return fn(conn)

        return await asyncio.get_running_loop().run_in_executor(self._reader, call)
