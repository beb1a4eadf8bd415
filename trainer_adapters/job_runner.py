"""One job at a time, over one shared session per process: what per-sample trainer hooks need.

verl builds a new agent-loop object for every sample, and a NeMo Gym agent server answers one
``POST /run`` per sample. Opening a gRPC stream per sample would cost a connection, a session and
a client id each; instead every caller in a process (on one event loop) shares one
:class:`JobRunner`, which owns one ``StreamRollouts`` session, submits each job, and hands each
caller its own job's outcome. The session resumes by itself after a dropped connection (see
:mod:`rollout.client.session`); trajectories are acknowledged once their caller has them.

Streaming many groups across trainer steps is the batcher's job (``rollout.client.batcher``); this
module serves hooks that are called once per sample and must return that sample.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import socket
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout.client.aio import RolloutClient
from rollout.client.errors import RolloutError
from rollout.client.session import Session
from rollout.client.specs import SpecLike, job_spec
from rollout.trainer_adapters.group_view import COMMIT_LAG_S, Member, SettledGroup, cut_group
from rollout.v1 import job_pb2, trajectory_pb2

SUCCEEDED = job_pb2.Job.State.STATE_SUCCEEDED
TERMINAL = frozenset({SUCCEEDED, job_pb2.Job.State.STATE_FAILED,
                      job_pb2.Job.State.STATE_CANCELLED})
FROZEN_GROUPS_KEPT = 4096
"""Groups whose frozen view (:meth:`JobRunner.frozen_group`) a runner remembers; the oldest
finished ones go first (a verl step's groups are all done long before 4096 newer ones)."""


@dataclass(frozen=True)
class JobOutcome:
    """A finished job: its trajectory (turns produced, reward) and its terminal state."""

    trajectory: trajectory_pb2.Trajectory
    state: int
    """A ``Job.State`` value: SUCCEEDED, FAILED or CANCELLED."""
    error: job_pb2.JobError | None = None
    """Why the job failed or was cancelled; None when it succeeded."""

    @property
    def succeeded(self) -> bool:
        return self.state == SUCCEEDED

    @property
    def state_name(self) -> str:
        return job_pb2.Job.State.Name(self.state).removeprefix("STATE_")  # type: ignore[arg-type]


class JobRejectedError(ValueError):
    """The server refused a submitted job (bad environment, task, sampling parameters...)."""

    def __init__(self, job_id: str, rejected: Any) -> None:
        where = f" (field {rejected.field})" if rejected.field else ""
        super().__init__(f"job {job_id!r} rejected: {rejected.reason}: {rejected.message}{where}")
        self.reason = rejected.reason
        self.field = rejected.field


class JobRunner:
    """Submit a job and await its outcome; many concurrent callers share one session."""

    def __init__(self, address: str, *, token: str | None = None, client_id: str | None = None,
                 max_unacked: int = 0) -> None:
        self.client = RolloutClient(address, token=token)
        self.client_id = client_id or (
            f"adapter-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._max_unacked = max_unacked
        self._session: Session | None = None
        self._reader: asyncio.Task[None] | None = None
        self._waiting: dict[str, asyncio.Future[JobOutcome]] = {}
        self._trajectories: dict[str, tuple[int, trajectory_pb2.Trajectory]] = {}
        self._start_lock = asyncio.Lock()
        self._frozen: collections.OrderedDict[str, asyncio.Task[SettledGroup]] = (
            collections.OrderedDict())

    async def start(self) -> None:
        async with self._start_lock:
            if self._session is not None:
                return
            self.client.connect()
            session = self.client.session(self.client_id, max_unacked=self._max_unacked)
            await session.start()
            self._session = session
            self._reader = asyncio.create_task(self._read(session),
                                               name=f"job-runner:{self.client_id}")

    async def run(self, spec: SpecLike) -> JobOutcome:
        """Submit ``spec`` and wait for its trajectory and terminal state. Cancelling the caller
        cancels the job on the server, so an abandoned sample frees its sandbox and backend."""
        proto = job_spec(spec)
        if not proto.job_id:
            raise ValueError("job_id is required (it is the job's idempotency key)")
        await self.start()
        assert self._session is not None
        if self._reader is not None and self._reader.done():
            # The session gave up (reconnects exhausted, or a verdict such as
            # SESSION_TAKEN_OVER): say why instead of waiting forever.
            exc = None if self._reader.cancelled() else self._reader.exception()
            raise RuntimeError(f"the rollout session to {self.client.address} has ended: "
                               f"{exc or 'closed'}")
        fut: asyncio.Future[JobOutcome] = asyncio.get_running_loop().create_future()
        self._waiting[proto.job_id] = fut
        try:
            await self._session.submit(proto)
            return await fut
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._session.cancel(job_ids=[proto.job_id]))
            raise
        finally:
            self._waiting.pop(proto.job_id, None)

    async def frozen_group(self, group_id: str, *, size: int, timeout_s: float,
                           poll_s: float = 0.5,
                           trains: Callable[[JobOutcome], bool] | None = None,
                           lag_s: float = COMMIT_LAG_S) -> SettledGroup:
        """``group_id``'s frozen view: the siblings that settled by the group's cut (the moment
        its earliest untrainable job settled, plus ``timeout_s``), each valid or untrainable by
        ``trains``, as :func:`~rollout.trainer_adapters.group_view.cut_group` decides from the
        service's timestamps. Every process that asks derives the same view whenever it asks,
        so the loops of a group split across verl workers take their fills from one set. The
        call returns once every sibling has settled, or once the cut is ``lag_s`` behind the
        service's clock; the view is also kept, so later callers in this process do not read
        the group again. A view that failed (the service could not be read) is not kept."""
        task = self._frozen.get(group_id)
        if task is None or (task.done() and (task.cancelled() or task.exception())):
            task = asyncio.create_task(
                self._freeze(group_id, size=size, wait_s=timeout_s, poll_s=poll_s,
                             trains=trains, lag_s=lag_s),
                name=f"job-runner:freeze:{group_id}")
            self._frozen[group_id] = task
            while len(self._frozen) > FROZEN_GROUPS_KEPT:
                old_id, old = next(iter(self._frozen.items()))
                if not old.done():
                    break  # never drop a view someone is still waiting for
                del self._frozen[old_id]
        self._frozen.move_to_end(group_id)
        # A caller cancelled while waiting leaves the view to be taken for the others.
        return await asyncio.shield(task)

    async def _freeze(self, group_id: str, *, size: int, wait_s: float, poll_s: float,
                      trains: Callable[[JobOutcome], bool] | None, lag_s: float
                      ) -> SettledGroup:
        await self.start()
        loop = asyncio.get_running_loop()
        members: dict[str, Member] = {}
        offset: float | None = None  # service time >= loop.time() + offset
        fallback: float | None = None
        delay = poll_s
        while True:
            jobs = [j async for j in self.client.list_jobs(group_id=group_id)]
            read_at = loop.time()
            newest = max((max(_seconds(j.create_time), _seconds(j.update_time)) for j in jobs),
                         default=None)
            if newest is not None and (offset is None or newest - read_at > offset):
                offset = newest - read_at
            pause = delay
            if offset is not None:  # else the group is not listed yet: nothing tells the time
                now = loop.time() + offset
                for job in jobs:
                    members[job.job_id] = await self._member(
                        job, members.get(job.job_id), trains, now=now, lag_s=lag_s)
                fallback = now if fallback is None else fallback
                cut = cut_group(members.values(), size=size, wait_s=wait_s, now=now,
                                fallback_anchor=fallback, lag_s=lag_s)
                if cut.view is not None:
                    return cut.view
                if cut.decide_at is not None:
                    pause = min(pause, max(cut.decide_at - now, 0.0) + 0.05)
            await asyncio.sleep(pause)
            delay = min(delay * 2, 2.0)

    async def _member(self, job: job_pb2.Job, known: Member | None,
                      trains: Callable[[JobOutcome], bool] | None, *, now: float,
                      lag_s: float) -> Member:
        """``job`` as :func:`cut_group` reads it; a classification once made is kept (a
        terminal job never changes)."""
        if known is not None and known.valid is not None:
            return known
        created = _seconds(job.create_time)
        if job.state not in TERMINAL:
            return Member(job.job_id, created)
        settled = _seconds(job.update_time)
        counts = await self._counts(job, trains)
        if counts is None and now >= settled + lag_s:
            counts = False  # its trajectory is gone for every reader alike: not trainable
        return Member(job.job_id, created, settled, counts, job.reward)

    async def settled_group(self, group_id: str, *, exclude: str, others: int,
                            timeout_s: float, poll_s: float = 0.5,
                            trains: Callable[[JobOutcome], bool] | None = None
                            ) -> SettledGroup:
        """``group_id``'s jobs other than ``exclude``, read from the service once ``others`` of
        them are settled (or, at ``timeout_s``, those settled by then): the valid ones' rewards
        and the others' ids. Valid: SUCCEEDED and, given ``trains``, trained by the caller
        (``trains`` is the caller's own test of its row, applied to the job read with its
        trajectory; a job whose trajectory cannot be read yet is not settled). The service is
        asked, not this process, because a trainer may run a group's samples in several
        processes."""
        await self.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout_s, 0.0)
        delay = poll_s
        valid: dict[str, float | None] = {}  # settled jobs: the reward when valid, else None
        roster: set[str] = set()
        while True:
            async for job in self.client.list_jobs(group_id=group_id):
                roster.add(job.job_id)
                if job.job_id != exclude and job.state in TERMINAL and job.job_id not in valid:
                    counts = await self._counts(job, trains)
                    if counts is not None:
                        valid[job.job_id] = job.reward if counts else None
            left = deadline - loop.time()
            if len(valid) >= others or left <= 0:
                break
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, 2.0)
        return SettledGroup(
            valid={j: r for j, r in valid.items() if r is not None},
            untrainable=frozenset(j for j, r in valid.items() if r is None),
            roster=frozenset(roster - {exclude}))

    async def _counts(self, job: job_pb2.Job,
                      trains: Callable[[JobOutcome], bool] | None) -> bool | None:
        """Whether a terminal ``job`` is valid for :meth:`settled_group`; None: not known yet
        (its trajectory is not readable until the job's record is durable)."""
        if job.state != SUCCEEDED:
            return False
        if trains is None:
            return True
        got = await self.client.get_job(job.job_id, include_trajectory=True)
        if not got.HasField("trajectory"):
            return None
        return trains(JobOutcome(got.trajectory, job.state))

    async def cancel_group(self, group_id: str) -> None:
        """Stop a group's unfinished jobs (their callers get CANCELLED outcomes)."""
        await self.start()
        assert self._session is not None
        await self._session.cancel(group_ids=[group_id])

    async def close(self) -> None:
        for task in self._frozen.values():
            task.cancel()
        self._frozen.clear()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self._session is not None:
            await self._session.aclose()
        await self.client.close()
        self._session = self._reader = None

    async def _read(self, session: Session) -> None:
        try:
            async for frame in session.events():
                kind = frame.WhichOneof("kind")
                if kind == "rejected":
                    fut = self._waiting.get(frame.job_id)
                    if fut is not None and not fut.done():
                        fut.set_exception(JobRejectedError(frame.job_id, frame.rejected))
                elif kind == "trajectory":
                    self._trajectories[frame.job_id] = (frame.trajectory.delivery_id,
                                                        frame.trajectory.trajectory)
                elif kind == "finished":
                    await self._finish(session, frame.job_id, frame.finished)
        except RolloutError as err:
            self._fail_all(err)
            raise
        self._fail_all(RolloutError(_unavailable(), "SESSION_ENDED",
                                    "the rollout session ended"))

    async def _finish(self, session: Session, job_id: str, finished: Any) -> None:
        # JobFinished always follows its job's TrajectoryReady (same delivery), so the
        # trajectory is here unless the job was never run (then an empty one stands in).
        delivery_id, traj = self._trajectories.pop(
            job_id, (0, trajectory_pb2.Trajectory(job_id=job_id)))
        fut = self._waiting.get(job_id)
        if fut is not None and not fut.done():
            fut.set_result(JobOutcome(traj, finished.state,
                                      finished.error if finished.HasField("error") else None))
        # Acknowledge even when nobody waits (a replay for a caller that gave up): nothing
        # else would ever take it, and an unacknowledged trajectory holds server flow control.
        if delivery_id:
            await session.ack([delivery_id])

    def _fail_all(self, err: Exception) -> None:
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(err)


def _seconds(stamp: Any) -> float:
    return float(stamp.ToNanoseconds()) / 1e9


def _unavailable() -> Any:
    import grpc

    return grpc.StatusCode.UNAVAILABLE


_RUNNERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], JobRunner]]
_RUNNERS = weakref.WeakKeyDictionary()


def shared_runner(address: str, token: str | None = None) -> JobRunner:
    """The process's runner for ``address`` on the running event loop (one session each).

    Keyed by event loop because a grpc.aio channel belongs to the loop that made it; verl's
    agent-loop worker and a Gym agent server each run all their samples on one loop."""
    loop = asyncio.get_running_loop()
    per_loop = _RUNNERS.setdefault(loop, {})
    key = (address, token or "")
    if key not in per_loop:
        per_loop[key] = JobRunner(address, token=token)
    return per_loop[key]
