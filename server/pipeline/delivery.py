"""Delivery: client sessions and what the server owes them (events, trajectories, acks).

Why it is its own object: the stage pipeline only *produces* events (a stage started, a job's
end is durable); who is listening, how far behind they are, what was acknowledged and what a
reconnecting client must be replayed is a separate concern with its own state — the
subscriptions by client id — and its own store calls (acks, replay pages, re-deliveries).
Keeping them here means the pipeline never touches a session, and a session never touches a
pool.

Rules it keeps (server/pipeline/subscription.py has the flow-control side):
- One subscription per client id: a new attach closes the old one.
- A delivery is published only by :meth:`deliver`, which the pipeline calls after the store
  committed it, or by the function :meth:`redeliver` returns, after the delivery committed.
- Progress events are built only for a subscriber that asked for them.
- Observers (the web dashboard's live pages) are told which job every event of every client is
  about, synchronously and on the event loop: each must be O(1) and never block or raise (the
  dashboard appends to a bounded log and returns).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollout.runtime.types import Stage
from rollout.server.pipeline.delivery_budget import DeliveryBudget
from rollout.server.pipeline.subscription import (
    Event,
    JobFinished,
    StageProgress,
    Subscription,
    TrajectoryReady,
)
from rollout.server.store import JobStore

Observer = Callable[[str, str], None]
"""``observer(stored_client_id, job_id)``: an event about that job happened (one the sessions
get, or would get: clients with no session attached included)."""

log = logging.getLogger(__name__)


class Delivery:
    """Subscriptions by client id, acks, replay from the store, re-deliveries."""

    def __init__(self, store: JobStore, *, replay_page: int,
                 budget: DeliveryBudget | None = None) -> None:
        self._store = store
        self._replay_page = replay_page
        self.budget = budget
        """Memory for undelivered trajectories across every session (None: unbounded)."""
        self._subs: dict[str, Subscription] = {}
        self._observers: list[Observer] = []

    def observe(self, observer: Observer) -> Callable[[], None]:
        """Add an observer; returns the function that removes it."""
        self._observers.append(observer)
        return lambda: self._observers.remove(observer) if observer in self._observers else None

    def _tell(self, client_id: str, job_id: str) -> None:
        for observer in list(self._observers):
            try:
                observer(client_id, job_id)
            except Exception:  # an observer's bug must not break a client's session
                log.exception("delivery observer failed")

    @property
    def sessions(self) -> int:
        return len(self._subs)

    # -- what the pipeline and the submit path publish ---------------------------------------

    def emit(self, client_id: str, event: Event) -> None:
        if self._observers:
            self._tell(client_id, event.job_id)
        sub = self._subs.get(client_id)
        if sub is not None:
            sub.publish(event)

    def progress(self, client_id: str, job_id: str, stage: Stage, event: str,
                 detail: Mapping[str, Any], elapsed_s: float) -> None:
        if self._observers:
            self._tell(client_id, job_id)
        sub = self._subs.get(client_id)
        if sub is not None and sub.progress:  # built only when someone wants it
            sub.publish(StageProgress(job_id, stage, event, detail, elapsed_s))

    def deliver(self, client_id: str, ready: TrajectoryReady, finished: JobFinished) -> None:
        """Announce a delivery whose store transaction committed."""
        if self._observers:
            self._tell(client_id, finished.job_id)
        sub = self._subs.get(client_id)
        if sub is not None:
            sub.publish_delivery(ready, finished)

    # -- sessions ----------------------------------------------------------------------------

    async def attach(self, client_id: str, acked_through: int = 0, *,
                     max_unacked: int = 0, progress: bool = True) -> Subscription:
        old = self._subs.get(client_id)
        if old is not None:
            old.close_nowait()
        sub = Subscription(client_id, max_unacked=max_unacked, on_close=self._detached,
                           progress=progress, fetch=lambda after, limit: self._page(
                               client_id, after, limit), page_size=self._replay_page,
                           budget=self.budget)
        self._subs[client_id] = sub
        if acked_through > 0:
            await self._store.ack(client_id, through=acked_through)
        waiting, upto = await self._store.unacked_summary(client_id, acked_through)
        await sub.start(waiting, upto, acked_through)
        return sub

    async def _page(self, client_id: str, after: int,
                    limit: int) -> Sequence[tuple[TrajectoryReady, JobFinished]]:
        """One page of a client's stored, unacknowledged deliveries (replay is paged so a long
        outage never loads every trajectory at once)."""
        out = []
        for d in await self._store.unacked(client_id, after=after, limit=limit):
            traj = d.trajectory
            if traj is None:  # cannot happen (unacked are never pruned); skip, never stall
                continue
            out.append((TrajectoryReady(d.delivery_id, d.job.job_id, traj),
                        JobFinished(d.job.job_id, d.job.state, d.job.error, d.job.reward,
                                    d.delivery_id)))
        return out

    def _detached(self, sub: Subscription) -> None:
        if self._subs.get(sub.client_id) is sub:
            del self._subs[sub.client_id]

    def close_all(self) -> None:
        for sub in list(self._subs.values()):
            sub.close_nowait()

    async def ack(self, client_id: str, delivery_ids: Sequence[int] = (),
                  through: int = 0) -> None:
        await self._store.ack(client_id, delivery_ids, through)
        sub = self._subs.get(client_id)
        if sub is not None:
            sub.acked(delivery_ids, through)
            await sub.refill()

    @property
    def starved_sessions(self) -> int:
        """Sessions whose next deliveries wait in the store for want of memory."""
        return sum(1 for sub in self._subs.values() if sub.starved)

    def unacked(self, client_id: str) -> tuple[int, int]:
        """(deliveries not yet acknowledged, of which held back by flow control) of a client's
        session; (0, 0) without one."""
        sub = self._subs.get(client_id)
        return (sub.unacked, sub.unacked - sub.outstanding) if sub is not None else (0, 0)

    async def redeliver(self, job_id: str,
                        client_id: str) -> tuple[int, Callable[[], None] | None] | None:
        """See :meth:`rollout.server.scheduler.Scheduler.redeliver`."""
        pending = await self._store.unacked_delivery(client_id, job_id)
        if pending is not None:
            return pending, None
        stored = await self._store.get(job_id)
        traj = await self._store.get_trajectory(job_id)
        if stored is None or traj is None or not stored.state.terminal:
            return None
        did = await self._store.add_delivery(client_id, job_id)  # durable before announced
        ready = TrajectoryReady(did, job_id, traj, replayed=True)
        finished = JobFinished(job_id, stored.state, stored.error, stored.reward, did)
        return did, lambda: self.deliver(client_id, ready, finished)
