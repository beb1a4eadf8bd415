"""A client's own jobs by state, for GetServerStatus (a tenant's ListJobs pages use the store's
owner filter directly: ``Scheduler.list(owner=...)``).

A client's jobs are stored under two kinds of client id: its own (jobs of its StreamRollouts
sessions) and one private delivery channel per job it submitted with SubmitRollout
(``rpc:<owner>#<job>``, see ``server/tenancy/auth.py``). The store keeps the owner of each row in
its
own indexed column, so counting one tenant's jobs reads that tenant's index entries, never the
job list.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from rollout.runtime.types import JobState
from rollout.server.store import JobStore

LiveState = Callable[[str], JobState | None]
"""The in-memory state of a job the scheduler still runs, None for any other job."""


class OwnerCounts:
    """Job counts by state of one owner; concurrent requests for the same owner share one
    store read, so a client polling status cannot queue reads up behind each other."""

    def __init__(self, store: JobStore, live_state: LiveState) -> None:
        self._store = store
        self._live_state = live_state
        self._running: dict[str, asyncio.Future[dict[JobState, int]]] = {}

    async def get(self, owner: str) -> dict[JobState, int]:
        fut = self._running.get(owner)
        if fut is None:
            fut = self._running[owner] = asyncio.ensure_future(self._count(owner))
            fut.add_done_callback(lambda _: self._running.pop(owner, None))
        return await asyncio.shield(fut)

    async def _count(self, owner: str) -> dict[JobState, int]:
        stored = await self._store.owner_counts(owner)
        counts = dict(stored.by_state)
        # A live job's row lags what it is doing (stage entries are written without waiting),
        # so its state is taken from the scheduler, as GetJob and ListJobs report it.
        for job_id, was in stored.live.items():
            now = self._live_state(job_id)
            if now is not None and now is not was:
                counts[was] -= 1
                counts[now] = counts.get(now, 0) + 1
        return {state: n for state, n in counts.items() if n}
