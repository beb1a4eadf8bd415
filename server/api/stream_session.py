"""One ``StreamRollouts`` call as an object: a receive loop and a send loop around one queue.

The shape is etcd's ``serverWatchStream`` (``recvLoop`` / ``sendLoop``): the call is a session
object whose loops each own their part of the state and meet only at one bounded queue of typed
items (:data:`rollout.server.api.stream_events.StreamEvent`):

- :meth:`StreamSession.recv_loop` reads the client's frames (submit, ack, cancel), calls the
  scheduler, and queues one answer per job (a bad frame of one job never ends the session);
- :meth:`StreamSession.event_loop` moves the scheduler's subscription (accepted, progress,
  trajectories, finished) into the queue; :meth:`StreamSession.heartbeat_loop` queues a
  heartbeat every interval;
- :meth:`StreamSession.send_loop` is the only writer: it numbers the frames, batches progress,
  and decides when the stream ends (a half-close once the client's jobs are delivered, a
  producer's failure, another stream taking the client id over).

Flow control of deliveries sits below, in the subscription (``max_unacked``: trajectories are held
back and paged from the store later); the send loop takes what to write next in one place,
:meth:`StreamSession._next_item`, so a further limit on what goes out belongs there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from rollout.runtime.types import InvalidArgument
from rollout.server.api import errors, proto_convert, typed_tasks
from rollout.server.api.stream_events import (
    Beat,
    Failed,
    HalfClosed,
    ProgressBatch,
    RequestReply,
    StreamEvent,
    finished_to_proto,
    job_of,
    progress_size,
    progress_to_proto,
    trajectory_message,
    wire_size,
)
from rollout.server.pipeline.records import SubmitResult
from rollout.server.pipeline.subscription import (
    JobAccepted,
    JobFinished,
    StageProgress,
    Subscription,
    TrajectoryReady,
)
from rollout.server.scheduler import Scheduler
from rollout.server.tenancy import auth
from rollout.server.tenancy.ownership import Ownership, job_id_taken
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb

VERSION = "0.1.0"
SMALL_FRAME_BYTES = 256
"""What a frame without a trajectory or progress counts toward ``max_batch_bytes`` (an answer,
a finished frame, a heartbeat: tens of bytes; a rejection adds its message)."""
DEFAULT_MAX_UNACKED = 1024
QUEUE_SIZE = 4096
"""Items waiting for the send loop; a full queue makes the producers wait (backpressure onto
the request reader and the subscription), never drops."""


@dataclass(frozen=True)
class StreamSettings:
    """The server's side of every session (``[server]`` settings)."""

    heartbeat_s: float = 10.0
    """Heartbeat interval when the client's ``open`` names none."""
    min_heartbeat_s: float = 0.1
    """Shortest interval a client may ask for: a 1 ns one would make the session a busy
    loop on the server."""
    max_progress_batch: int = 512
    """Most events in one ``progress_batch`` frame."""
    max_frame_batch: int = 1024
    """Most frames in one ``batch`` frame (``OpenSession.batch_frames``)."""
    max_batch_bytes: int = 4 << 20
    """A ``batch`` frame is closed once its frames pass this many bytes, so it stays well
    under the message limit (a single larger frame is written alone, as without batching)."""


@dataclass(frozen=True)
class OpenRequest:
    """The checked ``open`` frame."""

    client_id: str
    acked_through: int
    max_unacked: int
    progress: bool
    batch_progress: bool
    batch_frames: bool
    heartbeat_s: float
    store_id: str

    @classmethod
    def from_proto(cls, first: pb.StreamRolloutsRequest,
                   settings: StreamSettings) -> OpenRequest:
        if first.WhichOneof("kind") != "open":
            raise InvalidArgument("the first frame of StreamRollouts must be `open`",
                                  "OPEN_REQUIRED", "open")
        opened = first.open
        _check_client_id(opened.client_id)
        if opened.acked_through < 0:
            raise InvalidArgument("open.acked_through must not be negative (0 acknowledges "
                                  "nothing)", "INVALID_ACK", "open.acked_through")
        if opened.max_unacked < 0:
            raise InvalidArgument("open.max_unacked must not be negative (0 means the server "
                                  f"default, {DEFAULT_MAX_UNACKED})", "INVALID_MAX_UNACKED",
                                  "open.max_unacked")
        heartbeat = settings.heartbeat_s
        if opened.HasField("heartbeat_interval"):
            heartbeat = opened.heartbeat_interval.ToNanoseconds() / 1e9
            if heartbeat < 0 or 0 < heartbeat < settings.min_heartbeat_s:
                raise InvalidArgument(
                    f"open.heartbeat_interval must be 0 (no heartbeats) or at least "
                    f"{settings.min_heartbeat_s:g} s (the server's server.min_heartbeat_s)",
                    "HEARTBEAT_TOO_SHORT", "open.heartbeat_interval")
        return cls(client_id=opened.client_id, acked_through=opened.acked_through,
                   max_unacked=opened.max_unacked or DEFAULT_MAX_UNACKED,
                   progress=opened.progress,
                   batch_progress=opened.progress and opened.batch_progress,
                   batch_frames=opened.batch_frames,
                   heartbeat_s=heartbeat, store_id=opened.store_id)


def _check_client_id(client_id: str) -> None:
    if not client_id:
        raise InvalidArgument("open.client_id is required: a durable id for this trainer, "
                              "reused on reconnect to resume", "MISSING_FIELD", "open.client_id")
    proto_convert.check_id(client_id, "open.client_id")
    auth.check_not_reserved(client_id, "open.client_id")
    auth.current.get().check_client_id(client_id, "open.client_id")


def _batch_frame(frames: list[pb.StreamRolloutsResponse]) -> pb.StreamRolloutsResponse:
    """One frame as itself; several in a ``batch`` frame (sequence 0: they carry theirs)."""
    if len(frames) == 1:
        return frames[0]
    out = pb.StreamRolloutsResponse()
    out.batch.frames.extend(frames)  # a few times cheaper than FrameBatch(frames=...)
    return out


def result_pruned(job_id: str) -> errors.FailedPrecondition:
    return errors.FailedPrecondition(
        f"job {job_id!r} finished and retention (pipeline.retention_s) has deleted its "
        "trajectory, so it cannot be delivered again; submit under a new job id to run it "
        "again", "JOB_RESULT_PRUNED", "job_id")


def rejected(exc: BaseException) -> pb.JobRejected:
    m = errors.classify(exc)
    return pb.JobRejected(code=m.code.value[0], reason=m.reason, message=m.message,
                          field=m.field)


async def accepted_state(scheduler: Scheduler, result: SubmitResult) -> job_pb2.Job.State:
    """QUEUED for a new job; a duplicate reports the existing job's state (it may be finished
    already, which tells a resuming client not to wait for it)."""
    if not result.duplicate:
        return job_pb2.Job.STATE_QUEUED
    rec = await scheduler.get(result.job_id)
    if rec is None:
        return job_pb2.Job.STATE_QUEUED
    return proto_convert.state_to_proto(rec.state)


class StreamSession:
    """One client's ``StreamRollouts`` call, from its ``open`` frame to the end of the stream."""

    def __init__(self, scheduler: Scheduler, ownership: Ownership, request: OpenRequest,
                 subscription: Subscription, *, store_id: str, store_changed: bool,
                 acked_through: int, settings: StreamSettings) -> None:
        self.client_id = request.client_id
        self._scheduler = scheduler
        self._ownership = ownership
        self._request = request
        self._sub = subscription
        self._store_id = store_id
        self._store_changed = store_changed
        self._acked_through = acked_through
        self._out: asyncio.Queue[StreamEvent] = asyncio.Queue(maxsize=QUEUE_SIZE)
        self._batch = (ProgressBatch(max(1, settings.max_progress_batch))
                       if request.batch_progress else None)
        self._settings = settings
        self._resubmitted: set[int] = set()
        """Delivery ids re-announced by a ``FINISHED_JOB_POLICY_REPLAY`` submit: their frames
        say ``resubmitted`` (written by the receive loop, read by the send loop)."""
        self._sequence = 0
        self.frame_size = 0
        """Estimated wire bytes of the frame made last (see :meth:`_frame`)."""
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def open(cls, first: pb.StreamRolloutsRequest, scheduler: Scheduler,
                   ownership: Ownership, store_id: str,
                   settings: StreamSettings) -> StreamSession:
        """Check the ``open`` frame and attach the client's subscription (which starts the
        replay of its unacknowledged deliveries)."""
        request = OpenRequest.from_proto(first, settings)
        # Delivery ids from another store would acknowledge deliveries this client never saw.
        store_changed = bool(request.store_id) and request.store_id != store_id
        sub = await scheduler.attach(
            request.client_id, acked_through=0 if store_changed else request.acked_through,
            max_unacked=request.max_unacked, progress=request.progress)
        acked_through = await scheduler.store.acked_through(request.client_id)
        return cls(scheduler, ownership, request, sub, store_id=store_id,
                   store_changed=store_changed, acked_through=acked_through, settings=settings)

    async def run(self, requests: AsyncIterator[pb.StreamRolloutsRequest]
                  ) -> AsyncGenerator[pb.StreamRolloutsResponse, None]:
        """The response stream. Close it (``contextlib.aclosing``) when the call ends, so the
        loops stop and the subscription detaches at once."""
        self._spawn(self.recv_loop(requests))
        self._spawn(self.event_loop())
        if self._request.heartbeat_s > 0:
            self._spawn(self.heartbeat_loop())
        frames = (self.coalesce(self.send_loop()) if self._request.batch_frames
                  else self.send_loop())
        try:
            async with contextlib.aclosing(frames):
                async for frame in frames:
                    if frame is not None:
                        yield frame
        finally:
            await self.close()

    async def coalesce(self, frames: AsyncGenerator[pb.StreamRolloutsResponse | None, None]
                       ) -> AsyncGenerator[pb.StreamRolloutsResponse, None]:
        """``batch_frames``: the send loop's frames, those ready together as one ``batch``
        frame. The send loop yields None just before it would wait for the queue, so what it
        made until then goes out at once (a lone frame as itself): nothing waits for a frame
        still to come, and an idle session writes each frame as it is made.

        Frames are collected before they are written, so a trajectory's memory is released
        (``Subscription.sent``) up to one batch early; ``max_batch_bytes`` bounds that."""
        limit = max(1, self._settings.max_frame_batch)
        max_bytes = self._settings.max_batch_bytes
        held: list[pb.StreamRolloutsResponse] = []
        size = 0
        async with contextlib.aclosing(frames):
            try:
                async for frame in frames:
                    if frame is not None:
                        n = self.frame_size
                        if held and size + n > max_bytes:
                            yield _batch_frame(held)
                            held, size = [], 0
                        held.append(frame)
                        size += n
                        if len(held) < limit and size < max_bytes:
                            continue
                    if held:
                        yield _batch_frame(held)
                        held, size = [], 0
            except Exception:
                # The call ends with this error: what was made before it is still written
                # first, as it would have been one frame at a time.
                if held:
                    yield _batch_frame(held)
                raise
            if held:
                yield _batch_frame(held)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        with contextlib.suppress(Exception):
            await self._sub.close()

    def _spawn(self, loop: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(asyncio.create_task(loop))

    # ------------------------------------------------------------------ producers

    async def recv_loop(self, requests: AsyncIterator[pb.StreamRolloutsRequest]) -> None:
        try:
            async for req in requests:
                await self._handle(req)
            await self._out.put(HalfClosed())
        except Exception as exc:  # raised by the send loop, which ends the call with it
            await self._out.put(Failed(exc))

    async def event_loop(self) -> None:
        try:
            async for ev in self._sub:
                await self._out.put(ev)
        except Exception as exc:
            await self._out.put(Failed(exc))
        else:
            # The subscription ends only when another stream took over this client id.
            await self._out.put(Failed(errors.Aborted(
                f"another StreamRollouts stream opened with client_id {self.client_id!r}",
                "SESSION_TAKEN_OVER")))

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._request.heartbeat_s)
            await self._out.put(Beat(await self._heartbeat()))

    async def _drain_then_end(self) -> None:
        while self._has_pending():
            await asyncio.sleep(0.05)
        await self._out.put(HalfClosed())

    # ------------------------------------------------------------------ the writer

    async def send_loop(self) -> AsyncGenerator[pb.StreamRolloutsResponse | None, None]:
        """The frames to write, one per yield (resumed once it is written, or taken into a
        batch); None, which is not a frame, marks the moment it is about to wait for the
        queue (see :meth:`coalesce`)."""
        yield self._frame(opened=pb.SessionOpened(
            client_id=self.client_id, replaying=self._sub.replaying, server_version=VERSION,
            store_id=self._store_id, store_changed=self._store_changed,
            acked_through=self._acked_through))
        yield None  # `opened` is written alone: a client reads it before anything else
        batch = self._batch
        while True:
            # The previous write has completed: what queued meanwhile is taken now without
            # waiting (get() on a non-empty queue does not suspend), so held progress goes
            # out as one frame once nothing else is queued or the batch is full.
            if batch and (self._out.empty() or batch.full):
                events = batch.take()
                yield self._frame(progress_batch=events, size=progress_size(events))
                continue
            if self._out.empty():
                yield None
            item = await self._next_item()
            if batch is not None:
                match item:
                    case StageProgress():
                        batch.add(item)
                        continue
                    case JobAccepted():
                        continue  # no frame (the receive loop answered the submit)
                if batch and (isinstance(item, HalfClosed) or batch.holds(job_of(item))):
                    # That job's earlier progress goes first, and a closing stream sends
                    # what it holds.
                    events = batch.take()
                    yield self._frame(progress_batch=events, size=progress_size(events))
            match item:
                case HalfClosed():
                    # Client half-closed: keep sending until its jobs are done and their
                    # deliveries are on the wire, then end. Deliveries it can no longer ack
                    # (or that flow control holds back) replay on its next session.
                    if not self._has_pending() and self._out.empty():
                        return
                    self._spawn(self._drain_then_end())
                case Failed(error=error):
                    raise error
                case _:
                    frame = self._event_frame(item)
                    if frame is not None:
                        yield frame  # resumed once the frame is written to the client
                    if isinstance(item, TrajectoryReady):
                        self._sub.sent(item.delivery_id)  # its memory is free again

    async def _next_item(self) -> StreamEvent:
        return await self._out.get()

    def _frame(self, job_id: str = "", size: int = SMALL_FRAME_BYTES,
               **kind: Any) -> pb.StreamRolloutsResponse:
        """The next frame; ``size`` estimates its bytes on the wire (read by :meth:`coalesce`
        from ``frame_size``): ``ByteSize()`` of a large trajectory costs more than encoding
        it, so the one who builds a frame says how large it is."""
        self._sequence += 1
        self.frame_size = size
        return pb.StreamRolloutsResponse(sequence=self._sequence, job_id=job_id, **kind)

    def _event_frame(self, item: StreamEvent) -> pb.StreamRolloutsResponse | None:
        match item:
            case RequestReply(job_id=job_id, body=pb.JobAccepted() as accepted):
                return self._frame(job_id, accepted=accepted)
            case RequestReply(job_id=job_id, body=pb.JobRejected() as rejected_):
                return self._frame(job_id, rejected=rejected_,
                                   size=SMALL_FRAME_BYTES + len(rejected_.message))
            case Beat(heartbeat=hb):
                return self._frame(heartbeat=hb)
            case TrajectoryReady():
                ready = pb.TrajectoryReady(delivery_id=item.delivery_id,
                                           trajectory=trajectory_message(item),
                                           resubmitted=item.delivery_id in self._resubmitted)
                return self._frame(item.job_id, size=wire_size(item), trajectory=ready)
            case JobFinished():
                return self._frame(item.job_id, finished=finished_to_proto(item))
            case StageProgress():
                return self._frame(item.job_id, progress=progress_to_proto(item))
        return None  # JobAccepted events: the receive loop already answered the submit

    def _has_pending(self) -> bool:
        """Jobs still running for this client, or events not yet taken off the subscription."""
        return bool(self._scheduler.client_stats(self.client_id).get("in_flight")
                    or self._sub.buffered)

    async def _heartbeat(self) -> pb.Heartbeat:
        # acked_through comes from the store, so it confirms only acknowledgements that are
        # durable (an ack is committed before the session's state changes).
        acked_through = await self._scheduler.store.acked_through(self.client_id)
        st = self._scheduler.client_stats(self.client_id)
        now = Timestamp()
        now.GetCurrentTime()
        return pb.Heartbeat(server_time=now, jobs_in_flight=st.get("in_flight", 0),
                            unacked=st.get("unacked", 0), held_back=st.get("held_back", 0),
                            acked_through=acked_through)

    # ------------------------------------------------------------------ client frames

    async def _answer(self, job_id: str, error: BaseException) -> None:
        """A ``rejected`` frame; the id is cut short so a huge one is not echoed back."""
        await self._out.put(RequestReply(job_id[:128], rejected(error)))

    async def _handle(self, req: pb.StreamRolloutsRequest) -> None:
        kind = req.WhichOneof("kind")
        if kind == "submit":
            await self._submit(req.submit.jobs, req.submit.if_finished)
        elif kind == "ack":
            if any(i <= 0 for i in req.ack.delivery_ids):
                # Answered in the stream: a bad ack must not end a session whose other
                # deliveries are fine (they would all replay).
                await self._answer("", InvalidArgument(
                    "ack.delivery_ids must be positive delivery ids from TrajectoryReady "
                    "frames; this ack was ignored", "INVALID_ACK", "ack.delivery_ids"))
                return
            await self._scheduler.ack(self.client_id, list(req.ack.delivery_ids))
        elif kind == "cancel":
            targets = [("job_id", j) for j in req.cancel.job_ids]
            targets += [("group_id", g) for g in req.cancel.group_ids]
            for key, value in targets:
                try:
                    proto_convert.check_id(value, f"cancel.{key}")
                    await self._ownership.check(**{key: value})
                    await self._scheduler.cancel(**{key: value}, wait=False)
                except Exception as exc:
                    await self._answer(value if key == "job_id" else "", exc)
        elif kind == "open":
            raise InvalidArgument("`open` is only allowed as the first frame", "DUPLICATE_OPEN",
                                  "open")
        else:
            raise InvalidArgument("empty StreamRollouts frame: set one of submit, ack, cancel",
                                  "EMPTY_FRAME")

    async def _submit(self, jobs: Any, if_finished: int) -> None:
        if if_finished not in pb.FinishedJobPolicy.values():
            bad = InvalidArgument(f"submit.if_finished {if_finished} is not a "
                                  "FinishedJobPolicy value", "INVALID_ENUM_VALUE",
                                  "submit.if_finished")
            for p in jobs:
                await self._answer(p.job_id, bad)
            return
        specs = []
        for p in jobs:
            try:
                specs.append(proto_convert.spec_from_proto(p))
            except Exception as exc:  # one job's verdict, never the stream's
                # The id is echoed so the client can match it; an unforeseen error is that
                # job's INTERNAL answer (logged), and the batch's other jobs go on.
                await self._answer(p.job_id, exc)
        if not specs:
            return
        try:
            # A bound tenant's groups are its own: decided in the store's insert transaction,
            # after validation, so neither a race nor a bogus request learns another's group.
            results = await self._scheduler.submit(specs, self.client_id,
                                                   own_groups=auth.current.get().bound)
        except Exception as exc:  # overload: reject the whole batch, keep the stream
            for s in specs:
                await self._answer(s.job_id, exc)
            return
        typed = {p.job_id: p.WhichOneof("typed_task") for p in jobs}
        for r in results:
            await self._answer_submit(r, typed.get(r.job_id), if_finished)

    async def _answer_submit(self, r: SubmitResult, typed_task: str | None,
                             if_finished: int) -> None:
        error: BaseException | None = r.error
        if error is not None:
            error = typed_tasks.error_for(typed_task, error)
        announce = None
        rec = await self._scheduler.get(r.job_id) if r.duplicate and error is None else None
        if rec is not None and auth.owner_of(rec.client_id) != self.client_id:
            error = job_id_taken(r.job_id)
        elif rec is not None and rec.state.terminal:
            if if_finished == pb.FINISHED_JOB_POLICY_REJECT:
                error = errors.AlreadyExists(
                    f"job {r.job_id!r} already finished ({rec.state.name}); its result was "
                    "delivered to this client before. Submit under a new job id to run it "
                    "again", "JOB_ALREADY_FINISHED", "job_id")
            elif if_finished == pb.FINISHED_JOB_POLICY_REPLAY:
                again = await self._scheduler.redeliver(r.job_id, self.client_id)
                if again is None:
                    error = result_pruned(r.job_id)
                elif again[1] is not None:
                    self._resubmitted.add(again[0])
                    announce = again[1]
        if error is not None:
            await self._answer(r.job_id, error)
            return
        state = (proto_convert.state_to_proto(rec.state) if rec is not None
                 else await accepted_state(self._scheduler, r))
        accepted = pb.JobAccepted(duplicate=r.duplicate, state=state)
        await self._out.put(RequestReply(r.job_id, accepted))
        if announce is not None:
            announce()  # after the answer, so `accepted` precedes the trajectory frame
