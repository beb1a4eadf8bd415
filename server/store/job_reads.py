"""The job store's reads: queries on a reader thread with its own connection.

WAL lets them run beside the writer; each method hands ``_read``
(:meth:`rollout.server.store.job_store.JobStore._read`) a function of the reader's connection.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from rollout.runtime.types import JobState, Stage, Trajectory
from rollout.server.api.proto_convert import trajectory_from_bytes
from rollout.server.store.records import (
    JOB_COLUMNS,
    LIVE_STATES,
    JobRecord,
    OwnerJobCounts,
    StoredDelivery,
    Transition,
    row_to_job,
)

T = TypeVar("T")


class JobReads:
    """Jobs, histories, trajectories and deliveries, read back."""

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        raise NotImplementedError

    async def next_delivery_id(self, client_id: str) -> int:
        """The id the client's next delivery will get (ids only grow, even across pruning)."""
        row = await self._read(lambda c: c.execute(
            "SELECT last_id FROM delivery_marks WHERE client_id=?", (client_id,)).fetchone())
        return int(row[0]) + 1 if row else 1

    async def get(self, job_id: str) -> JobRecord | None:
        row = await self._read(lambda c: c.execute(
            f"SELECT {JOB_COLUMNS} FROM jobs WHERE job_id=?", (job_id,)).fetchone())
        return row_to_job(row) if row else None

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
                        owner: str | None = None) -> list[JobRecord]:
        """Jobs in submission order (``seq``), starting after ``after_seq``.

        ``client_id`` matches one stored client id exactly; ``owner`` matches every job the
        client owns, its SubmitRollout channels included (``rpc:<owner>#<job>``), through the
        owner index, so a page costs its own rows however many other jobs lie between them.
        """
        sql, args = list_sql(after_seq=after_seq, limit=limit, state=state, group_id=group_id,
                             client_id=client_id, owner=owner)
        rows = await self._read(lambda c: c.execute(sql, args).fetchall())
        return [row_to_job(r) for r in rows]

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
                live = c.execute(OWNER_LIVE_SQL, (owner, *LIVE_STATES)).fetchall()
            finally:
                c.execute("COMMIT")
            return OwnerJobCounts({JobState(st): int(n) for st, n in counts},
                               {job_id: JobState(st) for job_id, st in live})

        return await self._read(q)

    async def live_jobs(self, job_ids: Sequence[str] | None = None) -> list[JobRecord]:
        """Jobs stored QUEUED or RUNNING (all, or those of ``job_ids``), in submit order."""
        if job_ids is None:
            rows = await self._read(lambda c: c.execute(
                f"SELECT {JOB_COLUMNS} FROM jobs WHERE state IN (?,?) ORDER BY seq",
                LIVE_STATES).fetchall())
            return [row_to_job(r) for r in rows]
        ids = list(job_ids)

        def q(c: sqlite3.Connection) -> list[Any]:
            out = []
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                out += c.execute(
                    f"SELECT {JOB_COLUMNS} FROM jobs WHERE state IN (?,?) AND job_id IN"
                    f" ({','.join('?' * len(chunk))})", (*LIVE_STATES, *chunk)).fetchall()
            return sorted(out, key=lambda r: r[0])

        return [row_to_job(r) for r in await self._read(q)]

    async def unacked(self, client_id: str, *, after: int = 0,
                      limit: int = -1) -> list[StoredDelivery]:
        """Unacknowledged deliveries with ids above ``after``, oldest first, at most ``limit``
        (-1: all). Replay pages through this so memory never holds more than one page."""
        cols = ", ".join(f"j.{c.strip()}" for c in JOB_COLUMNS.split(","))

        def q(c: sqlite3.Connection) -> list[StoredDelivery]:
            rows = c.execute(
                f"SELECT d.delivery_id, j.trajectory, {cols} FROM deliveries d"
                " JOIN jobs j ON j.job_id = d.job_id"
                " WHERE d.client_id=? AND d.delivery_id>? AND d.acked=0"
                " ORDER BY d.delivery_id LIMIT ?", (client_id, after, limit)).fetchall()
            return [StoredDelivery(r[0], row_to_job(r[2:]),
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
            live = set(LIVE_STATES)
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

    async def group_exists(self, group_id: str) -> bool:
        row = await self._read(lambda c: c.execute(
            "SELECT 1 FROM jobs WHERE group_id=? LIMIT 1", (group_id,)).fetchone())
        return row is not None


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
    sql = f"SELECT {JOB_COLUMNS} FROM jobs WHERE {' AND '.join(where)} ORDER BY seq LIMIT ?"
    return sql, (*args, limit)
