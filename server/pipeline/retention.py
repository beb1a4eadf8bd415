"""Retention: a background task that prunes acknowledged trajectories from the job store.

Why: the store keeps every finished job's trajectory until its client acknowledges it, and used
to keep it forever after; a trainer running millions of rollouts grew the database without
bound. Two windows, both counted on wall-clock time so they survive restarts:

- ``retention_s`` after a delivery is acknowledged, its trajectory blob, delivery row and the
  job's transition rows are dropped. The job row stays (state, reward, error, timings,
  timestamps), so GetJob still answers; it just has no trajectory any more.
- ``job_retention_s`` after that, the job row itself goes: GetJob answers NOT_FOUND and the id
  may be submitted again as a new job.

Unacknowledged deliveries are never pruned: a client that has not acknowledged a result gets it
replayed on attach no matter how old it is. Freed pages go to SQLite's freelist and are reused
by new writes, so under steady load the file stops growing instead of shrinking and regrowing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from rollout.server.store import JobStore, PruneStats, now

log = logging.getLogger(__name__)


class Retention:
    """Runs :meth:`JobStore.prune` every ``interval_s`` while started."""

    def __init__(self, store: JobStore, *, retention_s: float, job_retention_s: float,
                 interval_s: float, batch: int = 1000,
                 clock: Callable[[], float] = now) -> None:
        if retention_s < 0 or job_retention_s < 0 or interval_s <= 0 or batch < 1:
            raise ValueError("retention windows must be >= 0, the interval and batch > 0")
        self.store = store
        self.retention_s = retention_s
        self.job_retention_s = job_retention_s
        self.interval_s = interval_s
        self.batch = batch
        self.clock = clock
        self.passes = 0
        self.totals = PruneStats()
        self._task: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        """``retention_s == 0`` keeps everything forever."""
        return self.retention_s > 0

    async def run_once(self) -> PruneStats:
        """One pass: everything due now, in batches of ``batch`` rows."""
        if not self.enabled:
            return PruneStats()
        t = self.clock()
        forget = t - self.job_retention_s if self.job_retention_s > 0 else None
        stats = await self.store.prune(t - self.retention_s, forget, batch=self.batch)
        self.passes += 1
        self.totals.trajectories += stats.trajectories
        self.totals.jobs += stats.jobs
        if stats.trajectories or stats.jobs:
            log.info("retention pruned %d trajectories and %d job rows", stats.trajectories,
                     stats.jobs)
        return stats

    def start(self) -> None:
        if self.enabled and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="job-retention")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _loop(self) -> None:
        while True:
            try:
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed pass is retried next interval, never fatal
                log.exception("retention pass failed")
            await asyncio.sleep(self.interval_s)
