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
  read that tenant's index entries instead of the whole job list (``server/tenant_status.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from rollout.runtime.types import (
    JobError,
    JobSpec,
    JobState,
    Stage,
    StageTimings,
    Trajectory,
)
from rollout.server.proto_convert import (
    spec_from_bytes,
    spec_to_bytes,
    trajectory_from_bytes,
    trajectory_to_bytes,
)
from rollout.server.store import file as store_file
from rollout.server.store.sqlite import Op, StoreWriteFailed, Writer, connect, owner_sql

log = logging.getLogger(__name__)
T = TypeVar("T")

_LIVE = (JobState.QUEUED.value, JobState.RUNNING.value)


@dataclass(frozen=True)
class Transition:
    """One entry of a job's history: it entered ``state`` (and ``stage``) at ``at``."""

    at: float
    state: JobState
    stage: Stage | None


@dataclass(frozen=True)
class StoredJob:
    """A job row as read back from the store."""

    seq: int
    job_id: str
    client_id: str
    group_id: str
    state: JobState
    stage: Stage | None
    attempts: int
    priority: int
    spec: JobSpec
    error: JobError | None
    reward: float | None
    timings: StageTimings
    created_at: float
    updated_at: float
    crashes: int = 0
    """Times a process died while this job was inside a stage."""
    in_stage: bool = False
    """The job was executing a stage when the row was last written (not waiting in a queue)."""


@dataclass(frozen=True)
class StoredDelivery:
    """An unacknowledged delivery: the finished job's row plus its trajectory."""

    delivery_id: int
    job: StoredJob
    trajectory: Trajectory | None


@dataclass(frozen=True)
class FinishRecord:
    """Everything written when a job reaches a terminal state, in one statement group."""

    job_id: str
    client_id: str
    state: JobState
    stage: Stage | None
    error: JobError | None
    reward: float | None
    timings: StageTimings
    trajectory: Trajectory | None
    at: float


@dataclass
class PruneStats:
    """What one retention pass removed."""

    trajectories: int = 0
    """Acknowledged deliveries whose trajectory, delivery and transition rows were dropped."""
    jobs: int = 0
    """Job rows forgotten entirely (past the second retention window)."""
    channels: int = 0
    """Delivery counters of finished ``SubmitRollout`` channels (``rpc:...``) forgotten."""


@dataclass(frozen=True)
class OwnerJobCounts:
    """One client's jobs by stored state (:meth:`JobStore.owner_counts`)."""

    by_state: dict[JobState, int]
    """Every job the client owns, counted by the state its row holds."""
    live: dict[str, JobState]
    """The client's jobs whose row says QUEUED or RUNNING, by job id, with that state."""


class StoreClosed(RuntimeError):
    """The store was closed while an operation was pending."""


__all__ = ["FinishRecord", "JobStore", "OwnerJobCounts", "PruneStats", "StoreClosed",
           "StoreWriteFailed", "StoredDelivery", "StoredJob", "Transition", "now"]


def error_to_json(err: JobError | None) -> str | None:
    if err is None:
        return None
    return json.dumps({"code": err.code, "reason": err.reason, "message": err.message,
                       "stage": err.stage.value if err.stage else None})


def error_from_json(text: str | None) -> JobError | None:
    if not text:
        return None
    d = json.loads(text)
    return JobError(d["code"], d["reason"], d["message"], Stage(d["stage"]) if d["stage"] else None)


class JobStore:
    """Jobs, their transitions, and per-client deliveries of finished trajectories."""

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

    async def flush(self) -> None:
        """Wait until every write queued before this call is committed."""
        fut = self._write(lambda c: None, wait=True)
        assert fut is not None
        await fut

    # -- writes ------------------------------------------------------------------------------

    async def insert_jobs(self, jobs: Sequence[tuple[JobSpec, str]],
                          now: float) -> list[int | None]:
        """Insert (spec, client_id) pairs; returns, per job, its ``seq`` (submission order) or
        None when the id already existed.

        Duplicates are detected by the UNIQUE constraint inside the writer, so two concurrent
        submits of one id can never both win.
        """
        rows = [(s.job_id, cid, s.group_id, JobState.QUEUED.value, s.priority, s, now)
                for s, cid in jobs]

        def op(c: sqlite3.Connection) -> list[int | None]:
            out: list[int | None] = []
            for job_id, cid, gid, state, prio, spec, ts in rows:
                cur = c.execute(_INSERT_JOB, (job_id, cid, gid, state, prio,
                                              spec_to_bytes(spec), ts))
                if cur.rowcount == 1:
                    c.execute("INSERT INTO transitions VALUES (?,?,?,NULL)", (job_id, ts, state))
                    out.append(cur.lastrowid)
                else:
                    out.append(None)
            return out

        fut = self._write(op, wait=True)
        assert fut is not None
        return list(await fut)

    def record_stage(self, job_id: str, stage: Stage, attempts: int, at: float) -> None:
        """The job entered ``stage`` and is executing it (fire-and-forget; ordering is kept by
        the writer queue). A process death before the matching :meth:`record_waiting` or
        finish is charged to the job as a crash at the next start."""
        running = JobState.RUNNING.value

        def op(c: sqlite3.Connection) -> None:
            c.execute("UPDATE jobs SET state=?, stage=?, attempts=?, in_stage=1, updated_at=?"
                      " WHERE job_id=?", (running, stage.value, attempts, at, job_id))
            c.execute("INSERT INTO transitions VALUES (?,?,?,?)",
                      (job_id, at, running, stage.value))

        self._write(op, wait=False)

    def record_waiting(self, job_ids: Iterable[str], *,
                       wait: bool = True) -> asyncio.Future[Any] | None:
        """The jobs left their stage without failing (queued for the next one, or stopped by a
        graceful shutdown): a process death now is not their fault."""
        ids = [(j,) for j in job_ids]
        return self._write(lambda c: c.executemany(
            "UPDATE jobs SET in_stage=0 WHERE job_id=?", ids), wait=wait)

    def recover(self, jobs: Iterable[tuple[str, int]], at: float) -> asyncio.Future[Any]:
        """Mark jobs interrupted by the last process QUEUED again with their crash counts."""
        rows = list(jobs)
        queued = JobState.QUEUED.value

        def op(c: sqlite3.Connection) -> None:
            c.executemany("UPDATE jobs SET state=?, stage=NULL, in_stage=0, crashes=?,"
                          " updated_at=? WHERE job_id=?",
                          [(queued, crashes, at, j) for j, crashes in rows])
            c.executemany("INSERT INTO transitions VALUES (?,?,?,NULL)",
                          [(j, at, queued) for j, _ in rows])

        fut = self._write(op, wait=True)
        assert fut is not None
        return fut

    async def next_delivery_id(self, client_id: str) -> int:
        """The id the client's next delivery will get (ids only grow, even across pruning)."""
        row = await self._read(lambda c: c.execute(
            "SELECT last_id FROM delivery_marks WHERE client_id=?", (client_id,)).fetchone())
        return int(row[0]) + 1 if row else 1

    def finish(self, rec: FinishRecord, *, deliver: bool = True) -> asyncio.Future[Any]:
        """Write the terminal state, the trajectory and (with ``deliver``) its delivery in one
        savepoint; the future resolves to the delivery id, assigned inside that transaction
        (None without ``deliver``). If it fails, nothing of it was written and no id was used.

        The trajectory is encoded in the writer thread, off the event loop.
        """
        def op(c: sqlite3.Connection) -> int | None:
            timings = json.dumps(asdict(rec.timings))
            err = error_to_json(rec.error)
            blob = trajectory_to_bytes(rec.trajectory) if rec.trajectory is not None else None
            c.execute(
                "UPDATE jobs SET state=?, stage=?, error=?, reward=?, timings=?, trajectory=?,"
                " in_stage=0, updated_at=? WHERE job_id=?",
                (rec.state.value, rec.stage.value if rec.stage else None, err, rec.reward,
                 timings, blob, rec.at, rec.job_id))
            c.execute("INSERT INTO transitions VALUES (?,?,?,?)",
                      (rec.job_id, rec.at, rec.state.value,
                       rec.stage.value if rec.stage else None))
            return _deliver(c, rec.client_id, rec.job_id) if deliver else None

        fut = self._write(op, wait=True)
        assert fut is not None
        return fut

    async def ack(self, client_id: str, delivery_ids: Sequence[int] = (),
                  through: int = 0) -> None:
        """Mark deliveries acknowledged: the listed ids, and every id <= ``through``."""
        ids = list(delivery_ids)

        def op(c: sqlite3.Connection) -> None:
            at = now()  # retention counts from here
            if through > 0:
                c.execute("UPDATE deliveries SET acked=1, acked_at=? WHERE client_id=?"
                          " AND delivery_id<=? AND acked=0", (at, client_id, through))
            if ids:
                c.executemany("UPDATE deliveries SET acked=1, acked_at=? WHERE client_id=?"
                              " AND delivery_id=? AND acked=0",
                              [(at, client_id, i) for i in ids])

        fut = self._write(op, wait=True)
        assert fut is not None
        await fut

    async def close_group(self, group_id: str, reason: str, at: float) -> None:
        fut = self._write(lambda c: c.execute(
            "INSERT OR IGNORE INTO closed_groups VALUES (?,?,?)", (group_id, reason, at)), True)
        assert fut is not None
        await fut

    async def prune(self, acked_before: float, forget_before: float | None = None, *,
                    batch: int = 1000) -> PruneStats:
        """Drop what retention no longer needs; returns how much went.

        - Deliveries acknowledged at or before ``acked_before``: the delivery row, the job's
          trajectory blob and its transition rows go; the job row stays (state, reward, error,
          timings, timestamps) with ``pruned_at`` set.
        - With ``forget_before``: job rows whose trajectory was pruned at or before it go too.

        Unacknowledged deliveries are never touched, so they can always be replayed; except on
        SubmitRollout's per-job channels (``rpc:...``), whose retry of a finished job is answered
        from the job row, not from a delivery: there a delivery its caller never took counts as
        acknowledged when the job ended, so it goes ``retention_s`` later. Each batch
        of at most ``batch`` rows is one op of the writer thread, awaited before the next, so the
        hot path's writes interleave with a long prune instead of waiting behind it.
        """
        stats = PruneStats()
        live = _LIVE

        def drop_trajectories(c: sqlite3.Connection) -> int:
            rows = c.execute(
                "SELECT client_id, delivery_id, job_id FROM deliveries"
                " WHERE acked_at IS NOT NULL AND acked_at <= ? LIMIT ?",
                (acked_before, batch)).fetchall()
            marks: dict[str, int] = {}
            for cid, did, _ in rows:
                marks[cid] = max(marks.get(cid, 0), did)
            c.executemany(
                "INSERT INTO delivery_marks VALUES (?,?) ON CONFLICT(client_id)"
                " DO UPDATE SET last_id=MAX(last_id, excluded.last_id)", list(marks.items()))
            c.executemany("DELETE FROM deliveries WHERE client_id=? AND delivery_id=?",
                          [(cid, did) for cid, did, _ in rows])
            at = now()
            # A job re-delivered on a re-submit may still owe another delivery: keep its data.
            kept = " AND job_id NOT IN (SELECT job_id FROM deliveries WHERE acked=0)"
            c.executemany(
                "UPDATE jobs SET trajectory=NULL, pruned_at=? WHERE job_id=?"
                " AND state NOT IN (?,?)" + kept, [(at, j, *live) for _, _, j in rows])
            c.executemany("DELETE FROM transitions WHERE job_id=?" + kept,
                          [(j,) for _, _, j in rows])
            return len(rows)

        def forget_jobs(c: sqlite3.Connection) -> int:
            ids = c.execute("SELECT job_id FROM jobs WHERE pruned_at IS NOT NULL"
                            " AND pruned_at <= ? LIMIT ?", (forget_before, batch)).fetchall()
            c.executemany("DELETE FROM jobs WHERE job_id=?", ids)
            c.executemany("DELETE FROM transitions WHERE job_id=?", ids)
            return len(ids)

        def forget_channels(c: sqlite3.Connection) -> int:
            # SubmitRollout's per-job channels (rpc:...) never resume with acked_through: the
            # server acks each id it sent. Their counters may go with their last job row; a
            # trainer's own client id keeps its counter forever (see delivery_marks above).
            rows = c.execute(
                "SELECT client_id FROM delivery_marks m WHERE client_id LIKE 'rpc:%'"
                " AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.client_id = m.client_id)"
                " AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.client_id = m.client_id)"
                " LIMIT ?", (batch,)).fetchall()
            c.executemany("DELETE FROM delivery_marks WHERE client_id=?", rows)
            return len(rows)

        async def drain(op: Op) -> int:
            total = 0
            while True:
                fut = self._write(op, wait=True)
                assert fut is not None
                n = int(await fut)
                total += n
                if n < batch:
                    return total

        def expire_channels(c: sqlite3.Connection) -> int:
            # The range (not LIKE) keeps this on the primary key: ';' follows ':' in ASCII.
            rows = c.execute(
                "SELECT d.client_id, d.delivery_id, j.updated_at FROM deliveries d"
                " JOIN jobs j ON j.job_id = d.job_id WHERE d.client_id >= 'rpc:'"
                " AND d.client_id < 'rpc;' AND d.acked=0 AND j.updated_at <= ? LIMIT ?",
                (acked_before, batch)).fetchall()
            c.executemany("UPDATE deliveries SET acked=1, acked_at=? WHERE client_id=?"
                          " AND delivery_id=?", [(at, cid, did) for cid, did, at in rows])
            return len(rows)

        await drain(expire_channels)
        stats.trajectories = await drain(drop_trajectories)
        if forget_before is not None:
            stats.jobs = await drain(forget_jobs)
            stats.channels = await drain(forget_channels)
        return stats

    # -- reads -------------------------------------------------------------------------------

    async def get(self, job_id: str) -> StoredJob | None:
        row = await self._read(lambda c: c.execute(
            f"SELECT {_COLS} FROM jobs WHERE job_id=?", (job_id,)).fetchone())
        return _row_to_job(row) if row else None

    async def history(self, job_id: str) -> list[Transition]:
        rows = await self._read(lambda c: c.execute(
            "SELECT at, state, stage FROM transitions WHERE job_id=? ORDER BY rowid",
            (job_id,)).fetchall())
        return [Transition(at, JobState(st), Stage(sg) if sg else None) for at, st, sg in rows]

    async def get_trajectory(self, job_id: str) -> Trajectory | None:
        """The stored trajectory of a finished job (decoded on the reader thread); None once
        retention pruned it (server/pipeline/retention.py)."""
        def q(c: sqlite3.Connection) -> Trajectory | None:
            row = c.execute("SELECT trajectory FROM jobs WHERE job_id=?", (job_id,)).fetchone()
            return trajectory_from_bytes(row[0]) if row and row[0] is not None else None
        return await self._read(q)

    async def list_jobs(self, *, after_seq: int, limit: int, state: JobState | None = None,
                        group_id: str | None = None, client_id: str | None = None,
                        owner: str | None = None) -> list[StoredJob]:
        """Jobs in submission order (``seq``), starting after ``after_seq``.

        ``client_id`` matches one stored client id exactly; ``owner`` matches every job the
        client owns, its SubmitRollout channels included (``rpc:<owner>#<job>``), through the
        owner index, so a page costs its own rows however many other jobs lie between them.
        """
        sql, args = list_sql(after_seq=after_seq, limit=limit, state=state, group_id=group_id,
                             client_id=client_id, owner=owner)
        rows = await self._read(lambda c: c.execute(sql, args).fetchall())
        return [_row_to_job(r) for r in rows]

    async def owner_counts(self, owner: str) -> OwnerJobCounts:
        """How many jobs ``owner`` has in each stored state, and its jobs stored live.

        Counted on ``jobs_by_owner_state`` alone (no table rows read). The stored state of a
        live job lags its in-memory one (stage entries are written fire-and-forget), so the
        live rows come back by id for the caller to correct; both reads see one snapshot.
        """
        def q(c: sqlite3.Connection) -> OwnerJobCounts:
            c.execute("BEGIN")
            try:
                counts = c.execute(OWNER_COUNTS_SQL, (owner,)).fetchall()
                live = c.execute(OWNER_LIVE_SQL, (owner, *_LIVE)).fetchall()
            finally:
                c.execute("COMMIT")
            return OwnerJobCounts({JobState(st): int(n) for st, n in counts},
                               {job_id: JobState(st) for job_id, st in live})

        return await self._read(q)

    async def live_jobs(self, job_ids: Sequence[str] | None = None) -> list[StoredJob]:
        """Jobs stored QUEUED or RUNNING (all, or those of ``job_ids``), in submit order."""
        if job_ids is None:
            rows = await self._read(lambda c: c.execute(
                f"SELECT {_COLS} FROM jobs WHERE state IN (?,?) ORDER BY seq", _LIVE).fetchall())
            return [_row_to_job(r) for r in rows]
        ids = list(job_ids)

        def q(c: sqlite3.Connection) -> list[Any]:
            out = []
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                out += c.execute(
                    f"SELECT {_COLS} FROM jobs WHERE state IN (?,?) AND job_id IN"
                    f" ({','.join('?' * len(chunk))})", (*_LIVE, *chunk)).fetchall()
            return sorted(out, key=lambda r: r[0])

        return [_row_to_job(r) for r in await self._read(q)]

    async def unacked(self, client_id: str, *, after: int = 0,
                      limit: int = -1) -> list[StoredDelivery]:
        """Unacknowledged deliveries with ids above ``after``, oldest first, at most ``limit``
        (-1: all). Replay pages through this so memory never holds more than one page."""
        cols = ", ".join(f"j.{c.strip()}" for c in _COLS.split(","))

        def q(c: sqlite3.Connection) -> list[StoredDelivery]:
            rows = c.execute(
                f"SELECT d.delivery_id, j.trajectory, {cols} FROM deliveries d"
                " JOIN jobs j ON j.job_id = d.job_id"
                " WHERE d.client_id=? AND d.delivery_id>? AND d.acked=0"
                " ORDER BY d.delivery_id LIMIT ?", (client_id, after, limit)).fetchall()
            return [StoredDelivery(r[0], _row_to_job(r[2:]),
                                   trajectory_from_bytes(r[1]) if r[1] is not None else None)
                    for r in rows]

        return await self._read(q)

    async def unacked_summary(self, client_id: str, after: int = 0) -> tuple[int, int]:
        """(count, highest id) of the client's unacknowledged deliveries above ``after``."""
        row = await self._read(lambda c: c.execute(
            "SELECT COUNT(*), COALESCE(MAX(delivery_id), 0) FROM deliveries"
            " WHERE client_id=? AND delivery_id>? AND acked=0", (client_id, after)).fetchone())
        return int(row[0]), int(row[1])

    async def closed_groups(self) -> dict[str, str]:
        rows = await self._read(lambda c: c.execute(
            "SELECT group_id, reason FROM closed_groups").fetchall())
        return dict(rows)

    async def succeeded_counts(self, group_ids: Sequence[str]) -> dict[str, int]:
        ids = [g for g in group_ids if g]
        if not ids:
            return {}

        def q(c: sqlite3.Connection) -> dict[str, int]:
            # Only the group's current generation counts: a group id is reused once all its
            # jobs ended, so a job created after every earlier job of the group had finished
            # starts a new group whose finish_after counts from zero.
            out: dict[str, int] = {}
            live = set(_LIVE)
            for gid in ids:
                rows = c.execute("SELECT created_at, updated_at, state FROM jobs"
                                 " WHERE group_id=? ORDER BY seq", (gid,)).fetchall()
                open_until, n = float("-inf"), 0
                for created, updated, state in rows:
                    if created > open_until:
                        open_until, n = float("-inf"), 0
                    open_until = max(open_until,
                                     float("inf") if state in live else float(updated))
                    n += state == JobState.SUCCEEDED.value
                if n:
                    out[gid] = n
            return out

        return await self._read(q)

    # -- protocol support (store identity, ack confirmation, re-delivery, group reuse) -------

    async def store_id(self) -> str:
        """A random id made once per store file: a client that sees it change knows the
        server's state (jobs, delivery ids) was lost, and must not send old delivery ids."""
        def op(c: sqlite3.Connection) -> str:
            c.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
            c.execute("INSERT OR IGNORE INTO meta VALUES ('store_id', ?)",
                      (uuid.uuid4().hex,))
            return str(c.execute("SELECT value FROM meta WHERE key='store_id'").fetchone()[0])

        fut = self._write(op, wait=True)
        assert fut is not None
        return str(await fut)

    async def acked_through(self, client_id: str) -> int:
        """The highest delivery id d of a client such that every committed delivery <= d is
        acknowledged. Uncommitted ids are higher than every committed one (ids are issued in
        order and written FIFO), so they can never be counted as acknowledged."""
        def q(c: sqlite3.Connection) -> int:
            low = c.execute("SELECT MIN(delivery_id) FROM deliveries WHERE client_id=?"
                            " AND acked=0", (client_id,)).fetchone()[0]
            if low is not None:
                return int(low) - 1
            high = c.execute(
                "SELECT MAX(mx) FROM (SELECT MAX(delivery_id) AS mx FROM deliveries"
                " WHERE client_id=? UNION ALL SELECT last_id FROM delivery_marks"
                " WHERE client_id=?)", (client_id, client_id)).fetchone()[0]
            return int(high or 0)
        return await self._read(q)

    async def unacked_delivery(self, client_id: str, job_id: str) -> int | None:
        """The id of a delivery of ``job_id`` to ``client_id`` still unacknowledged, if any."""
        row = await self._read(lambda c: c.execute(
            "SELECT MIN(delivery_id) FROM deliveries WHERE client_id=? AND job_id=?"
            " AND acked=0", (client_id, job_id)).fetchone())
        return int(row[0]) if row and row[0] is not None else None

    async def add_delivery(self, client_id: str, job_id: str) -> int:
        """One more delivery of a finished job's stored trajectory (a re-submit asked for it);
        returns its id, assigned in the same transaction (see :meth:`finish`)."""
        fut = self._write(lambda c: _deliver(c, client_id, job_id), True)
        assert fut is not None
        return int(await fut)

    async def reopen_group(self, group_id: str) -> None:
        """Forget a group's closure once none of its jobs is live: the id may be used again."""
        fut = self._write(lambda c: c.execute(
            "DELETE FROM closed_groups WHERE group_id=?", (group_id,)), True)
        assert fut is not None
        await fut

    async def group_exists(self, group_id: str) -> bool:
        row = await self._read(lambda c: c.execute(
            "SELECT 1 FROM jobs WHERE group_id=? LIMIT 1", (group_id,)).fetchone())
        return row is not None


_COLS = ("seq, job_id, client_id, group_id, state, stage, attempts, priority, spec, error,"
         " reward, timings, created_at, updated_at, crashes, in_stage")
_INSERT_JOB = ("INSERT OR IGNORE INTO jobs (job_id, client_id, group_id, state, priority, spec,"
               " created_at, updated_at, owner) VALUES (?1,?2,?3,?4,?5,?6,?7,?7,"
               f" {owner_sql('?2')})")
OWNER_COUNTS_SQL = "SELECT state, COUNT(*) FROM jobs WHERE owner = ? GROUP BY state"
OWNER_LIVE_SQL = "SELECT job_id, state FROM jobs WHERE owner = ? AND state IN (?, ?)"


def list_sql(*, after_seq: int, limit: int, state: JobState | None = None,
             group_id: str | None = None, client_id: str | None = None,
             owner: str | None = None) -> tuple[str, tuple[Any, ...]]:
    """The statement :meth:`JobStore.list_jobs` runs, with its arguments (tests read its
    query plan)."""
    where: list[str] = ["seq > ?"]
    args: list[Any] = [after_seq]
    for column, value in (("state", state.value if state is not None else None),
                          ("group_id", group_id), ("client_id", client_id),
                          ("owner", owner)):
        if value is not None:
            where.append(f"{column} = ?")
            args.append(value)
    sql = f"SELECT {_COLS} FROM jobs WHERE {' AND '.join(where)} ORDER BY seq LIMIT ?"
    return sql, (*args, limit)


def _deliver(c: sqlite3.Connection, client_id: str, job_id: str) -> int:
    """Insert a delivery under the client's next id (writer thread, inside the caller's
    savepoint: if anything after this fails, the id goes back with the rollback)."""
    delivery_id = int(c.execute(
        "INSERT INTO delivery_marks VALUES (?, 1) ON CONFLICT(client_id)"
        " DO UPDATE SET last_id=last_id+1 RETURNING last_id", (client_id,)).fetchone()[0])
    c.execute("INSERT INTO deliveries (client_id, delivery_id, job_id, acked) VALUES (?,?,?,0)",
              (client_id, delivery_id, job_id))
    return delivery_id


def _row_to_job(r: Sequence[Any]) -> StoredJob:
    timings = StageTimings(**json.loads(r[11])) if r[11] else StageTimings()
    return StoredJob(
        seq=r[0], job_id=r[1], client_id=r[2], group_id=r[3], state=JobState(r[4]),
        stage=Stage(r[5]) if r[5] else None, attempts=r[6], priority=r[7],
        spec=spec_from_bytes(r[8]), error=error_from_json(r[9]), reward=r[10],
        timings=timings, created_at=r[12], updated_at=r[13], crashes=r[14],
        in_stage=bool(r[15]))


def now() -> float:
    """Wall-clock seconds; stored timestamps are wall time so they survive restarts."""
    return time.time()
