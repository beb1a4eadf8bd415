"""Client subscriptions: the events a trainer's session receives, in order, with flow control.

Why it works this way:
- Trajectories are durable: a delivery is published only after its row committed, and a client
  that re-attaches first gets every unacknowledged delivery replayed from the store in
  ``delivery_id`` order. Live deliveries that race with the replay are buffered during it and
  de-duplicated by ``delivery_id``, so nothing arrives twice and nothing is skipped.
- Progress events are ephemeral: a detached client misses them, and a consumer that falls far
  behind loses the oldest progress events rather than growing memory without bound.
- Flow control (``max_unacked``): once that many deliveries are outstanding, further deliveries
  wait here (progress still flows) until acks arrive, like Pub/Sub StreamingPull's
  max-outstanding-messages.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout.runtime.types import JobError, JobState, Stage, Trajectory


@dataclass(frozen=True, slots=True)
class JobAccepted:
    """A submitted job was committed to the store (``duplicate``: it already existed)."""

    job_id: str
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class StageProgress:
    """``event`` is ``started`` / ``finished`` for a stage, or a handler's own (e.g. ``turn``)."""

    job_id: str
    stage: Stage
    event: str
    detail: Mapping[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0
    """Seconds since the stage started."""


@dataclass(frozen=True, slots=True)
class TrajectoryReady:
    """A finished job's trajectory; acknowledge ``delivery_id`` once it is safely consumed."""

    delivery_id: int
    job_id: str
    trajectory: Trajectory
    replayed: bool = False
    """True when re-sent from the store on attach (it may have been seen before a crash)."""


@dataclass(frozen=True, slots=True)
class JobFinished:
    """Always follows the job's :class:`TrajectoryReady` (same ``delivery_id``)."""

    job_id: str
    state: JobState
    error: JobError | None
    reward: float | None
    delivery_id: int = 0


Event = JobAccepted | StageProgress | TrajectoryReady | JobFinished


class Subscription:
    """One attached client's ordered event stream (an async iterator)."""

    def __init__(self, client_id: str, *, max_unacked: int = 0, max_buffered: int = 10_000,
                 on_close: Callable[[Subscription], None] | None = None,
                 progress: bool = True) -> None:
        self.client_id = client_id
        self.progress = progress
        """Whether StageProgress events are wanted at all."""
        self.max_unacked = max_unacked
        """0 means unlimited."""
        self._max_buffered = max_buffered
        self._events: deque[Event] = deque()
        self._held: deque[tuple[TrajectoryReady, JobFinished]] = deque()
        self._outstanding: set[int] = set()
        self._replaying = True
        self._early: list[Event | tuple[TrajectoryReady, JobFinished]] = []
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._on_close = on_close
        self.dropped_progress = 0
        self.replaying = 0
        """How many stored deliveries were replayed on attach."""

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def outstanding(self) -> int:
        """Deliveries sent (or queued to send) and not yet acknowledged."""
        return len(self._outstanding)

    @property
    def buffered(self) -> int:
        """Events published but not yet taken by the consumer."""
        return len(self._events)

    @property
    def unacked(self) -> int:
        """Outstanding deliveries plus those held back by ``max_unacked``."""
        return len(self._outstanding) + len(self._held)

    # -- producer side (scheduler, on the event loop) ---------------------------------------

    def publish(self, event: Event) -> None:
        if self._closed:
            return
        if isinstance(event, StageProgress) and (
                not self.progress or len(self._events) >= self._max_buffered):
            self.dropped_progress += self.progress
            return
        if self._replaying:
            self._early.append(event)
            return
        self._events.append(event)
        self._wake()

    def publish_delivery(self, ready: TrajectoryReady, finished: JobFinished) -> None:
        if self._closed:
            return
        if self._replaying:
            self._early.append((ready, finished))
            return
        self._held.append((ready, finished))
        self._release_held()

    def finish_replay(self, replay: Iterable[tuple[TrajectoryReady, JobFinished]],
                      acked_through: int) -> None:
        """Queue the stored deliveries, then whatever arrived live meanwhile (de-duplicated)."""
        if self._closed:  # a newer attach of the same client took over meanwhile
            return
        seen: set[int] = set()
        for pair in replay:
            self.replaying += 1
            seen.add(pair[0].delivery_id)
            self._held.append(pair)
        self._replaying = False
        early, self._early = self._early, []
        for item in early:
            if isinstance(item, tuple):
                did = item[0].delivery_id
                if did in seen or did <= acked_through:
                    continue
                self._held.append(item)
            else:
                self._events.append(item)
        self._release_held()
        self._wake()

    def acked(self, delivery_ids: Iterable[int] = (), through: int = 0) -> None:
        for d in delivery_ids:
            self._outstanding.discard(d)
        if through:
            self._outstanding = {d for d in self._outstanding if d > through}
        self._release_held()

    def _release_held(self) -> None:
        moved = False
        while self._held and (not self.max_unacked
                              or len(self._outstanding) < self.max_unacked):
            ready, finished = self._held.popleft()
            self._outstanding.add(ready.delivery_id)
            self._events.append(ready)
            self._events.append(finished)
            moved = True
        if moved:
            self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- consumer side (servicer) ------------------------------------------------------------

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Event:
        while True:
            if self._events:
                return self._events.popleft()
            if self._closed:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def drain(self) -> list[Event]:
        """Everything ready to send now, without waiting (lets a servicer batch writes)."""
        out = list(self._events)
        self._events.clear()
        return out

    async def close(self) -> None:
        self.close_nowait()

    def close_nowait(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._events.clear()
        self._held.clear()
        self._early.clear()
        self._wake()
        if self._on_close is not None:
            self._on_close(self)
