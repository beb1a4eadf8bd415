"""The job store's retention pass: what an acknowledged delivery leaves behind, removed in
batches (the policy, when and how long, is ``server/pipeline/retention.py``'s)."""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

from rollout.server.store.records import LIVE_STATES, PruneStats, now
from rollout.server.store.sqlite import Op


class JobPruning:
    """Deletes of delivered trajectories, forgotten jobs and finished delivery channels."""

    def _write(self, op: Op, wait: bool) -> asyncio.Future[Any] | None:
        raise NotImplementedError

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
        live = LIVE_STATES

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
