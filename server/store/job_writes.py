"""The job store's writes: every change goes to the writer thread as one op (group commit).

Each method builds an op (a function of the writer's connection) and hands it to ``_write``
(:meth:`rollout.server.store.job_store.JobStore._write`); callers that need durability await
the future it returns, bookkeeping writes are fire-and-forget. Ops run in submission order, so
"stage started" never overtakes "job finished" for the same job.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from typing import Any

from rollout.runtime.types import JobSpec, JobState, Stage
from rollout.server.api.proto_convert import spec_to_bytes, trajectory_to_bytes
from rollout.server.store.records import FinishRecord, GroupTaken, error_to_json, now
from rollout.server.store.sqlite import Op, owner_sql


class JobWrites:
    """Jobs, transitions, deliveries and group closures, written through one writer."""

    def _write(self, op: Op, wait: bool) -> asyncio.Future[Any] | None:
        raise NotImplementedError

    async def flush(self) -> None:
        """Wait until every write queued before this call is committed."""
        fut = self._write(lambda c: None, wait=True)
        assert fut is not None
        await fut

    async def insert_jobs(self, jobs: Sequence[tuple[JobSpec, str]], now: float, *,
                          own_groups: bool = False) -> list[int | GroupTaken | None]:
        """Insert (spec, client_id) pairs; returns, per job, its ``seq`` (submission order),
        None when the id already existed, or :class:`GroupTaken` (``own_groups``: the job's
        group already holds a job of another owner, so it was not inserted).

        Duplicates are detected by the UNIQUE constraint inside the writer, and group owners
        in the same transaction as the insert, so of two concurrent submits of one id, or of
        two tenants' first jobs of one group id, exactly one wins.
        """
        rows = [(s.job_id, cid, s.group_id, JobState.QUEUED.value, s.priority, s, now)
                for s, cid in jobs]

        def op(c: sqlite3.Connection) -> list[int | GroupTaken | None]:
            out: list[int | GroupTaken | None] = []
            for job_id, cid, gid, state, prio, spec, ts in rows:
                if own_groups and gid and c.execute(_OTHER_OWNER_IN_GROUP, (gid, cid)
                                                    ).fetchone() is not None:
                    out.append(GroupTaken(gid))
                    continue
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

    def finish(self, rec: FinishRecord, *, deliver: bool = True,
               encoded: Callable[[bytes], None] | None = None) -> asyncio.Future[Any]:
        """Write the terminal state, the trajectory and (with ``deliver``) its delivery in one
        savepoint; the future resolves to the delivery id, assigned inside that transaction
        (None without ``deliver``). If it fails, nothing of it was written and no id was used.

        The trajectory is encoded in the writer thread, off the event loop; ``encoded`` is
        handed those bytes there, before the future resolves, so whoever sends the trajectory
        on does not encode it a second time.
        """
        def op(c: sqlite3.Connection) -> int | None:
            timings = json.dumps(asdict(rec.timings))
            err = error_to_json(rec.error)
            blob = trajectory_to_bytes(rec.trajectory) if rec.trajectory is not None else None
            if blob is not None and encoded is not None:
                encoded(blob)
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



_OTHER_OWNER_IN_GROUP = ("SELECT 1 FROM jobs WHERE group_id = ?1 AND owner IS NOT"
                         f" {owner_sql('?2')} LIMIT 1")
_INSERT_JOB = ("INSERT OR IGNORE INTO jobs (job_id, client_id, group_id, state, priority, spec,"
               " created_at, updated_at, owner) VALUES (?1,?2,?3,?4,?5,?6,?7,?7,"
               f" {owner_sql('?2')})")


def _deliver(c: sqlite3.Connection, client_id: str, job_id: str) -> int:
    """Insert a delivery under the client's next id (writer thread, inside the caller's
    savepoint: if anything after this fails, the id goes back with the rollback)."""
    delivery_id = int(c.execute(
        "INSERT INTO delivery_marks VALUES (?, 1) ON CONFLICT(client_id)"
        " DO UPDATE SET last_id=last_id+1 RETURNING last_id", (client_id,)).fetchone()[0])
    c.execute("INSERT INTO deliveries (client_id, delivery_id, job_id, acked) VALUES (?,?,?,0)",
              (client_id, delivery_id, job_id))
    return delivery_id
