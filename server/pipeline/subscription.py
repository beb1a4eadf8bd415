"""Client subscriptions: the events a trainer's session receives, in order, with flow control.

Why it works this way:
- Trajectories are durable: a delivery is published only after its row committed, so the store
  always holds every delivery a subscription has not sent yet. A subscription therefore never
  buffers deliveries it cannot send now: when it is "behind" (replaying on attach, or held back
  by flow control) it drops live ones and later reads pages from the store in ``delivery_id``
  order, ``page_size`` at a time and only as fast as the consumer takes them. Memory per client
  is one page and the ids of outstanding deliveries, however large the backlog.
- Ids follow commit order, so a page ending below a dropped live id means more is waiting; a live
  delivery at or below the cursor is one a page already carried (nothing arrives twice).
- Progress events are ephemeral: a detached client misses them, and a consumer that falls far
  behind loses the progress events that arrive while its backlog is full rather than growing
  memory without bound (the events it does get are still in order per job, with gaps). The
  servicer may write many of them in one frame.
- Flow control (``max_unacked``): once that many deliveries are outstanding, further deliveries
  wait (progress still flows) until acks arrive, like Pub/Sub StreamingPull's
  max-outstanding-messages. They wait in memory while the memory budget allows (held back,
  released in order as acks come), else in the store: a client that acks in batches behind a
  fast pipeline would otherwise have each of them written, dropped and read back and decoded
  again, which cost the server more than the job itself did.
- Memory (``budget``, server/pipeline/delivery_budget.py): a delivery is taken into memory only
  while the session's share and the server's total allow; it is released once the servicer has
  written it to the client (:meth:`Subscription.sent`). A session that does not read holds at
  most its share; what finishes for it meanwhile waits in the store and is paged in as it reads.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rollout.runtime.types import JobError, JobState, Stage, Trajectory
from rollout.server.pipeline.delivery_budget import DeliveryBudget, held_bytes


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
    encoded: bytes = b""
    """The trajectory exactly as the store wrote it (a serialized ``rollout.v1.Trajectory``),
    when at hand: a session sends it as it is instead of converting ``trajectory`` again.
    Empty: convert."""


@dataclass(frozen=True, slots=True)
class JobFinished:
    """Always follows the job's :class:`TrajectoryReady` (same ``delivery_id``)."""

    job_id: str
    state: JobState
    error: JobError | None
    reward: float | None
    delivery_id: int = 0


Event = JobAccepted | StageProgress | TrajectoryReady | JobFinished
Delivery = tuple[TrajectoryReady, JobFinished]
Fetch = Callable[[int, int], Awaitable[Sequence[Delivery]]]
"""``fetch(after_id, limit)``: the client's unacknowledged deliveries above ``after_id``."""

log = logging.getLogger(__name__)


class Subscription:
    """One attached client's ordered event stream (an async iterator)."""

    def __init__(self, client_id: str, *, max_unacked: int = 0, max_buffered: int = 10_000,
                 on_close: Callable[[Subscription], None] | None = None,
                 progress: bool = True, fetch: Fetch | None = None,
                 page_size: int = 256, budget: DeliveryBudget | None = None) -> None:
        self.client_id = client_id
        self.progress = progress
        """Whether StageProgress events are wanted at all."""
        self.max_unacked = max_unacked
        """0 means unlimited."""
        self._max_buffered = max_buffered
        self._fetch = fetch
        self._page_size = page_size
        self._events: deque[Event] = deque()
        self._held_back: deque[tuple[TrajectoryReady, JobFinished]] = deque()
        """Deliveries taken into memory (charged to the budget) that flow control holds until
        acks make room; all above what ``_events`` holds, all below what the store holds."""
        self._outstanding: set[int] = set()
        self._cursor = 0
        """Highest delivery id queued to the consumer (or acknowledged before attach)."""
        self._behind = fetch is not None
        """Deliveries above the cursor wait in the store; live ones are dropped meanwhile."""
        self._dropped_max = 0
        """Highest live delivery id dropped while behind: a page must reach it to catch up."""
        self._in_store = 0
        """Deliveries known to wait in the store (approximate; for heartbeats only)."""
        self._replay_upto = 0
        self._waiter: asyncio.Future[None] | None = None
        self._filling = asyncio.Lock()
        self._closed = False
        self._on_close = on_close
        self._budget = budget
        self._held: dict[int, int] = {}
        """Bytes charged to the budget per delivery id, until its frame is written."""
        self.held_bytes = 0
        self._starved = False
        """The budget refused a delivery; nothing is paged in until bytes are released."""
        self._avg_size = 0
        """Running mean of delivery sizes: how many fit in the room a page may fill."""
        self.budget_waits = 0
        """Deliveries left in the store for want of memory (a count of refusals)."""
        self.dropped_progress = 0
        self.replaying = 0
        """How many stored deliveries were waiting for this client when it attached."""

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def starved(self) -> bool:
        """Deliveries wait in the store because this session's memory share (or the server's
        budget) is full."""
        return self._starved and self._behind

    @property
    def outstanding(self) -> int:
        """Deliveries sent (or queued to send) and not yet acknowledged."""
        return len(self._outstanding)

    @property
    def buffered(self) -> int:
        """Events not yet taken by the consumer, counting deliveries the store holds for it
        that flow control would let through now."""
        return len(self._events) + (self._in_store if self._behind and self._room()
                                    and not self._starved else 0)

    @property
    def in_memory(self) -> int:
        """Events held in memory now (what paging bounds; a held-back delivery is two)."""
        return len(self._events) + 2 * len(self._held_back)

    @property
    def unacked(self) -> int:
        """Outstanding deliveries plus those waiting in the store (held back)."""
        return (len(self._outstanding) + len(self._held_back)
                + (self._in_store if self._behind else 0))

    def _room(self) -> int:
        if not self.max_unacked:
            return self._page_size
        return max(0, min(self._page_size, self.max_unacked - len(self._outstanding)))

    # -- producer side (scheduler, on the event loop) ---------------------------------------

    def publish(self, event: Event) -> None:
        if self._closed:
            return
        if isinstance(event, StageProgress) and (
                not self.progress or len(self._events) >= self._max_buffered):
            self.dropped_progress += self.progress
            return
        self._events.append(event)
        self._wake()

    def publish_delivery(self, ready: TrajectoryReady, finished: JobFinished) -> None:
        """A delivery that just committed. Queued now when nothing older waits in the store
        and flow control allows; otherwise left to the store (where it already is)."""
        if self._closed:
            return
        did = ready.delivery_id
        if did <= self._cursor:
            return  # a page from the store carried it already
        size = held_bytes(ready.trajectory) + len(ready.encoded)
        if self._behind or not self._fits(size):
            self._behind = True
            self._in_store += 1
            self._dropped_max = max(self._dropped_max, did)
            self._wake()
            return
        if self._held_back or not self._room():
            self._charge(ready, size)  # in memory, but not sent until acks make room
            self._held_back.append((ready, finished))
            return
        self._queue(ready, finished, size)
        self._wake()

    async def start(self, waiting: int, waiting_upto: int, acked_through: int) -> None:
        """Begin after attach: ``waiting`` deliveries (ids up to ``waiting_upto``) are stored
        for this client; read the first page now so it is ready before the first frame."""
        self.replaying = waiting
        self._in_store = waiting
        self._replay_upto = waiting_upto
        self._cursor = max(self._cursor, acked_through)
        await self._fill()

    def _queue(self, ready: TrajectoryReady, finished: JobFinished, size: int) -> None:
        self._charge(ready, size)
        self._send(ready, finished)

    def _send(self, ready: TrajectoryReady, finished: JobFinished) -> None:
        self._outstanding.add(ready.delivery_id)
        self._events.append(ready)
        self._events.append(finished)

    def _release_held_back(self) -> None:
        """Move held-back deliveries to the consumer, oldest first, as flow control allows."""
        moved = False
        while self._held_back and self._room():
            self._send(*self._held_back.popleft())
            moved = True
        if moved:
            self._wake()

    def _charge(self, ready: TrajectoryReady, size: int) -> None:
        self._cursor = ready.delivery_id
        if self._budget is not None:
            self._held[ready.delivery_id] = self._held.get(ready.delivery_id, 0) + size
            self.held_bytes += size
            self._budget.charge(size)
            self._avg_size = size if not self._avg_size else (3 * self._avg_size + size) // 4

    def _fits(self, size: int) -> bool:
        """Whether the budget lets this session take ``size`` more bytes now; if not, the
        session waits for bytes to be released (its own, or for the total, anyone's)."""
        why = self._budget.refusal(self.held_bytes, size) if self._budget is not None else ""
        if not why:
            return True
        self._starved = True
        self.budget_waits += 1
        if why == "total" and self._budget is not None:
            self._budget.wait_for_room(id(self), self._room_freed)
        return False

    def _room_freed(self) -> None:
        self._starved = False
        if self._behind:
            self._wake()

    def _page_limit(self, room: int) -> int:
        """Deliveries to read in one page: as many as the byte room holds at the mean size
        seen so far (one when unknown), so a page never decodes far more than may be kept."""
        if self._budget is None:
            return room
        if not self._avg_size:
            return 1
        free = min(self._budget.session_bytes - self.held_bytes,
                   self._budget.total_bytes - self._budget.held)
        return max(1, min(room, free // self._avg_size))

    def sent(self, delivery_id: int) -> None:
        """The delivery's frame was written to the client: its memory is no longer held for
        it (its ack is still awaited; ``max_unacked`` counts that)."""
        size = self._held.pop(delivery_id, 0)
        if size and self._budget is not None:
            self.held_bytes -= size
            self._budget.release(size)
            self._room_freed()

    async def refill(self) -> None:
        """Read the next page now if flow control has room (after an ack, so the consumer
        finds the next deliveries ready instead of waiting for its next read)."""
        if self._behind and self._room() and not self._starved:
            await self._fill()

    async def _fill(self) -> None:
        """Read one page from the store if behind and flow control leaves room."""
        async with self._filling:  # one page at a time: the ack path and the consumer race
            await self._fill_locked()

    async def _fill_locked(self) -> None:
        while True:
            if (not self._behind or self._closed or self._fetch is None or self._starved
                    or self._held_back):  # those go first; the store holds newer ones
                return
            room = self._room()
            if not room:
                return
            limit = self._page_limit(room)
            dropped_before = self._dropped_max
            page = await self._fetch(self._cursor, limit)
            if self._closed:
                return
            for ready, finished in page:
                if ready.delivery_id <= self._cursor:
                    continue
                size = held_bytes(ready.trajectory)
                if not self._fits(size):
                    return  # the rest stays in the store; the cursor stops before it
                if ready.delivery_id <= self._replay_upto:
                    ready = replace(ready, replayed=True)
                self._queue(ready, finished, size)
                self._in_store = max(0, self._in_store - 1)
            if len(page) < limit:
                # A short page holds every unacknowledged delivery committed before it was
                # read, and a dropped id was committed before it was dropped: one dropped
                # before the read and missing from the page was acknowledged meanwhile, so the
                # cursor may pass it.
                self._cursor = max(self._cursor, dropped_before)
                if self._dropped_max <= self._cursor:  # nothing newer dropped during the read
                    self._behind = False
                    self._in_store = 0
                return
            if limit >= room:
                return  # one page as large as flow control allows per fill
            # The page was cut to what memory may hold at the mean size seen so far (one
            # delivery when none was seen yet): read on with the better estimate.

    def acked(self, delivery_ids: Iterable[int] = (), through: int = 0) -> None:
        for d in delivery_ids:
            self._outstanding.discard(d)
        if through:
            self._outstanding = {d for d in self._outstanding if d > through}
        self._release_held_back()
        if self._behind:
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
            if self._behind and self._room() and not self._starved:
                try:
                    await self._fill()
                except Exception as exc:  # the store is failing: try again shortly
                    log.warning("replay page for %s failed: %s", self.client_id, exc)
                    await asyncio.sleep(0.5)
                continue
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
        self._held_back.clear()
        if self._budget is not None:
            self._budget.forget(id(self))
            self._budget.release(self.held_bytes)
            self._held.clear()
            self.held_bytes = 0
        self._wake()
        if self._on_close is not None:
            self._on_close(self)
