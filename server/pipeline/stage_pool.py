"""One stage pool: a bounded priority queue and a fixed number of worker slots.

Why slots and not long-lived worker tasks: every stage execution runs as its own task, so
cancelling a job cancels exactly that task and never a worker, and there is no hand-off queue
between a dispatcher and workers. A slot is held from the moment a job starts the stage until
it is handed to the next stage's queue; when that queue is full the job keeps its slot
("blocked") — that is the backpressure that stops INIT from racing ahead of a slow RUN.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout.runtime.handler import JobContext
from rollout.runtime.types import JobError, JobSpec, JobState, Stage, StageTimings


@dataclass(eq=False, slots=True)
class LiveJob:
    """A job that is not terminal yet: its in-memory state while it moves through the stages."""

    spec: JobSpec
    client_id: str
    seq: int
    """Submission order in the store; FIFO among equal priorities, stable list order."""
    created_at: float
    attempts: int = 0
    crashes: int = 0
    """Times a process or node died while the job was inside a stage (``max_attempts``)."""
    state: JobState = JobState.QUEUED
    stage: Stage | None = None
    updated_at: float = 0.0
    ctx: JobContext | None = None
    node: Any = None
    """The ``server.cluster`` node holding the job's sandbox from INIT until its release."""
    task: asyncio.Task[Any] | None = None
    pool: StagePool | None = None
    """The pool whose queue (or blocked list) holds the job, if any."""
    blocked: bool = False
    queue_token: int = -1
    enqueued_at: float = 0.0
    """Monotonic time the job entered its current queue."""
    stage_started: float = 0.0
    cancel_reason: str | None = None
    finishing: bool = False
    """Set once the job's terminal state is decided; it can no longer be cancelled."""
    error: JobError | None = None
    reward: float | None = None
    """The terminal reward, once decided: GetJob and ListJobs read a finishing job from
    memory until its record is durable, and must not show it SUCCEEDED with no reward."""
    last_turn: Mapping[str, Any] | None = None
    """The detail of the agent loop's latest ``turn`` progress event (running counters)."""
    timings: StageTimings = field(default_factory=StageTimings)
    waiters: list[asyncio.Future[None]] | None = None

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    def wait_done(self) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.waiters is None:
            self.waiters = []
        self.waiters.append(fut)
        return fut

    def mark_done(self) -> None:
        for fut in self.waiters or ():
            if not fut.done():
                fut.set_result(None)
        self.waiters = None


class StagePool:
    """Queue + slots of one stage; ``start(job, pool)`` launches the stage task for a job."""

    def __init__(self, stage: Stage, workers: int, capacity: int,
                 start: Callable[[LiveJob, StagePool], None]) -> None:
        if workers <= 0:
            raise ValueError(f"{stage.value} pool needs at least one worker")
        self.stage = stage
        self.workers = workers
        self.capacity = capacity
        self._start = start
        self._heap: list[tuple[int, int, int, LiveJob]] = []
        self._tokens = 0
        self.depth = 0
        """Live (not cancelled) entries in the queue."""
        self.busy = 0
        """Slots in use: running jobs plus blocked ones."""
        self.blocked: deque[LiveJob] = deque()
        self.paused = False
        self.upstream: StagePool | None = None
        """The pool whose blocked jobs wait for room in this one."""
        self.downstream: StagePool | None = None

    def take_now(self, job: LiveJob) -> bool:
        """Give ``job`` (done upstream) a slot at once if one is idle and nobody is queued.

        Nobody queued means no better candidate exists, so priorities are kept; the caller
        keeps running the job in its own task and releases its upstream slot.
        """
        if self.paused or self.busy >= self.workers or self.depth:
            return False
        self.busy += 1
        job.enqueued_at = time.monotonic()
        return True

    def has_room(self) -> bool:
        return self.depth < self.capacity

    def push(self, job: LiveJob) -> None:
        self._tokens += 1
        job.queue_token = self._tokens
        job.pool = self
        job.blocked = False
        job.enqueued_at = time.monotonic()
        heapq.heappush(self._heap, (-job.spec.priority, job.seq, self._tokens, job))
        self.depth += 1
        self.pump()

    def remove(self, job: LiveJob) -> None:
        """Take a queued or blocked job out (it was cancelled); lazy for the heap."""
        if job.pool is not self:
            return
        job.pool = None
        if job.blocked:
            job.blocked = False
            self.blocked.remove(job)
            self.busy -= 1
            self.pump()
        else:
            job.queue_token = -1
            self.depth -= 1
            self._room_freed()

    def pump(self) -> None:
        """Start queued jobs while slots are free."""
        while not self.paused and self.busy < self.workers and self._heap:
            _, _, token, job = heapq.heappop(self._heap)
            if job.queue_token != token or job.pool is not self:
                continue  # cancelled while queued
            job.pool = None
            job.queue_token = -1
            self.depth -= 1
            self.busy += 1
            self._start(job, self)
            self._room_freed()

    def release(self) -> None:
        """A running job left this stage (handed on, finished or failed)."""
        self.busy -= 1
        self.pump()

    def hand_on(self, job: LiveJob) -> None:
        """The job finished this stage: queue it downstream, or hold its slot until room."""
        nxt = self.downstream
        assert nxt is not None
        if nxt.has_room() and not self.blocked:
            self.busy -= 1
            nxt.push(job)
            self.pump()
        else:
            job.pool = self
            job.blocked = True
            self.blocked.append(job)

    def _room_freed(self) -> None:
        up = self.upstream
        if up is None:
            return
        while up.blocked and self.has_room():
            job = up.blocked.popleft()
            job.blocked = False
            job.pool = None
            up.busy -= 1
            self.push(job)
        up.pump()
