"""A ``StreamRollouts`` session that survives dropped connections.

Guarantees (what a trainer may rely on):

- **Every trajectory reaches the caller exactly once per Session object.** The server stores
  each trajectory until it is acknowledged and replays unacknowledged ones when the same
  ``client_id`` reconnects; the session drops replays of delivery ids it has already yielded.
- **An acknowledged trajectory is never sent again** once the server has seen the ack. The
  session re-opens with ``acked_through`` = the highest delivery id below which everything is
  acknowledged (so those stay acknowledged even if the last ack frame died with the
  connection) and re-sends the acks above it first thing. A trajectory whose ack was lost in
  flight can be replayed once; the session swallows that replay and re-acks it.
- **No submission is lost or doubled.** A job stays "pending" until the server answers it
  with ``accepted`` or ``rejected``; pending jobs are re-sent after a reconnect, and since
  submission is idempotent by ``job_id`` the server runs each job once (the late answer then
  says ``duplicate=True``).
- Cancels issued while disconnected are sent after the reconnect. A cancel written just
  before the connection died may be lost; cancelling again is harmless.

What resumes: UNAVAILABLE and CANCELLED (connection reset, server restart or graceful
shutdown), with jittered exponential backoff, at most ``max_reconnects`` failed attempts in a
row. What does not: ABORTED (``SESSION_TAKEN_OVER``: another process owns this client id),
INVALID_ARGUMENT, UNAUTHENTICATED and every other verdict on the request; those end
``events()`` with a :class:`RolloutError`.

Progress (``progress=True``) is opted into in batches (``batch_progress``, default on): the
server may then carry many stage-progress events in one ``progress_batch`` frame, which costs
far less than a frame per event. ``events()`` still yields one ``progress`` frame per event, in
the order they arrived, with the job id set; only ``on_wire`` sees the batch frames. Progress
stays ephemeral and best-effort (docs/PROTOCOL.md).

Frames are batched too (``batch_frames``, default on): the server may write the frames that are
ready together (the answers to one submit, trajectories and their ``finished`` frames) as one
``batch`` frame, which costs the server and this client far less than a write and a read per
frame. ``events()`` yields the frames inside one by one, with their own sequence numbers and
job ids, exactly as a server that does not batch sends them; only ``on_wire`` sees the
``batch`` frames. Submits are batched by the caller: one :meth:`Session.submit` of many specs
is one frame.

Sequence numbers restart at 1 on each underlying stream; every re-open shows up as a new
``opened`` frame. The progress frames unpacked from one batch all carry that batch frame's
sequence number, so within one stream the sequence numbers ``events()`` yields never
decrease. Each re-open sends the ``store_id`` of the previous one: if the server's
store changed (its state was lost), the server ignores the old ``acked_through``, the
``opened`` frame says ``store_changed`` and the session forgets its delivery bookkeeping
(the new store numbers deliveries from 1 again) and submits again every job it saw accepted
but not finished, which the lost store took with it; ``store_resets`` counts such re-opens.

Re-submitting a job id this client already used never runs it again; ``if_finished`` on
:meth:`submit` picks what a finished one gets (docs/PROTOCOL.md): ``"report"`` (the default:
``accepted`` with the final state, nothing more), ``"replay"`` (its stored trajectory again,
under a new delivery id, with ``resubmitted`` set) or ``"reject"``.

Ending: ``close()`` means "nothing more to submit". The session half-closes the stream only
when it owes the server nothing: every submit answered, every trajectory it yielded
acknowledged, and a heartbeat confirming that the server has no unfinished job and no
unacknowledged trajectory for this client. Half-closing earlier would
strand the last trajectories: a half-closed stream can no longer carry their acks.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration

from rollout.client.errors import RolloutError
from rollout.client.specs import SpecLike, group_specs, job_specs
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb

_END = object()
_FINISHED_POLICIES = {"report": pb.FINISHED_JOB_POLICY_REPORT,
                      "replay": pb.FINISHED_JOB_POLICY_REPLAY,
                      "reject": pb.FINISHED_JOB_POLICY_REJECT}
_TERMINAL = (job_pb2.Job.STATE_SUCCEEDED, job_pb2.Job.STATE_FAILED,
             job_pb2.Job.STATE_CANCELLED)
_STREAM_BROKEN = (grpc.RpcError, asyncio.InvalidStateError, grpc.aio.UsageError)
MAX_MERGED_BYTES = 4 << 20
"""Requests merged into one frame stop short of this size (and of a quarter of the message
limit); a single larger request is written alone, as it was given."""


class Session:
    def __init__(self, client: Any, client_id: str, *, progress: bool = False,
                 batch_progress: bool = True, batch_frames: bool = True,
                 max_unacked: int = 0, auto_ack: bool = False,
                 heartbeat_s: float | None = None, max_reconnects: int = 10,
                 on_wire: Callable[[pb.StreamRolloutsResponse], None] | None = None,
                 backoff_s: tuple[float, float] = (0.05, 2.0)) -> None:
        self.client = client
        self.client_id = client_id
        self.progress = progress
        self.batch_progress = batch_progress
        """Let the server coalesce progress events into ``progress_batch`` frames (unpacked
        here); False asks for one frame per event, as clients before batching did."""
        self.batch_frames = batch_frames
        """Let the server write the frames that are ready together as one ``batch`` frame
        (unpacked here); False asks for one frame per write, as clients before it did."""
        self.max_unacked = max_unacked
        self.auto_ack = auto_ack
        self.heartbeat_s = 1.0 if heartbeat_s is None else heartbeat_s
        """Heartbeats also tell a closing session when the server owes it nothing."""
        self.max_reconnects = max_reconnects
        self.on_wire = on_wire
        """Sees every frame as received, before de-duplication (tests, debugging)."""
        self.backoff_s = backoff_s
        self.reconnects = 0
        """Successful re-opens after a drop."""
        self.opened = pb.SessionOpened()
        """The latest ``opened`` frame (empty until the stream is open)."""
        self.store_resets = 0
        """Re-opens that found the server on another store (its state was lost)."""

        # Unbounded on purpose: a caller that submits a large batch before it starts reading
        # must not stall the reader, or the server's replies back up until it stops reading
        # the submits (a deadlock). Trajectories, the large frames, stay bounded by the
        # server's max_unacked flow control.
        self._events: asyncio.Queue[Any] = asyncio.Queue()
        self._lock = asyncio.Lock()  # one writer at a time; (re)connect is atomic to writers
        self._call: Any = None
        self._half_closed = False
        self._ready = False
        self._closing = False
        self._pending: dict[str, job_pb2.JobSpec] = {}
        self._policy: dict[str, pb.FinishedJobPolicy] = {}  # if_finished of each pending job
        self._finished: set[str] = set()
        self._unfinished: dict[str, job_pb2.JobSpec] = {}
        """Accepted jobs not finished yet: submitted again if the server's store changes."""
        self._acked_through = 0
        self._acked: set[int] = set()  # acked ids above _acked_through
        self._seen: set[int] = set()  # yielded ids above _acked_through
        self._queued_cancels: list[pb.CancelJobs] = []
        self._outbox: list[tuple[pb.StreamRolloutsRequest, asyncio.Future[bool]]] = []
        """Requests waiting for the writer (see :meth:`_send`), oldest first."""
        self.frames_written = 0
        """Request frames written on the wire (merged requests count once)."""
        self._first_open: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Session:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Open the stream; raises :class:`RolloutError` if the server refuses the session."""
        if self._task is not None:
            return
        self._first_open = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(), name=f"session:{self.client_id}")
        await asyncio.shield(self._first_open)

    async def close(self) -> None:
        """No more submits: the stream ends once everything owed is done (see module doc).
        Keep iterating ``events()`` (and acknowledging) until it ends. The server's heartbeats
        say when it owes nothing more, so a session opened with ``heartbeat_s=0`` cannot
        close gracefully: use :meth:`aclose`."""
        if self.heartbeat_s <= 0:
            raise ValueError("close() needs heartbeats (heartbeat_s > 0); use aclose()")
        self._closing = True

    async def aclose(self) -> None:
        """Drop the stream now. Unacknowledged trajectories stay stored on the server."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._call is not None:
            self._call.cancel()
        self._events.put_nowait(_END)

    # ------------------------------------------------------------------ requests

    async def submit(self, specs: SpecLike | Iterable[SpecLike], *,
                     if_finished: str = "report") -> list[str]:
        """Submit jobs; each is answered by an ``accepted`` or ``rejected`` frame.
        ``if_finished`` (``report`` / ``replay`` / ``reject``) decides what a job id of this
        client whose job already finished gets (see the module docstring)."""
        protos = job_specs(specs)
        policy = _FINISHED_POLICIES.get(if_finished)
        if policy is None:
            raise ValueError(f"if_finished must be one of {sorted(_FINISHED_POLICIES)}")
        if self._closing:
            raise RuntimeError("session is closing; no more submits")
        await self._send(pb.StreamRolloutsRequest(
            submit=pb.SubmitJobs(jobs=protos, if_finished=policy)))
        return [p.job_id for p in protos]

    async def submit_group(self, template: SpecLike, n: int, group_id: str,
                           finish_after: int = 0, *, if_finished: str = "report") -> list[str]:
        """``n`` samples of one prompt as jobs ``{group_id}/{i}`` of one group."""
        return await self.submit(group_specs(template, n, group_id, finish_after),
                                 if_finished=if_finished)

    async def ack(self, delivery_ids: Iterable[int]) -> None:
        new = [i for i in delivery_ids if i > self._acked_through and i not in self._acked]
        if not new:
            return
        self._acked.update(new)
        self._seen.difference_update(new)
        while self._acked_through + 1 in self._acked:
            self._acked_through += 1
            self._acked.discard(self._acked_through)
        self._seen = {i for i in self._seen if i > self._acked_through}
        await self._send(pb.StreamRolloutsRequest(ack=pb.AckTrajectories(delivery_ids=new)))

    async def cancel(self, job_ids: Iterable[str] = (), group_ids: Iterable[str] = ()) -> None:
        msg = pb.CancelJobs(job_ids=list(job_ids), group_ids=list(group_ids))
        if not await self._send(pb.StreamRolloutsRequest(cancel=msg)):
            self._queued_cancels.append(msg)

    @property
    def acked_through(self) -> int:
        return self._acked_through

    # ------------------------------------------------------------------ responses

    async def events(self) -> AsyncIterator[pb.StreamRolloutsResponse]:
        """Every frame once: opened, accepted, rejected, progress, trajectory, finished,
        heartbeat. With ``auto_ack`` a trajectory is acknowledged when the caller asks for
        the next frame, i.e. after it has handled this one."""
        while True:
            item = await self._events.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            if self.auto_ack and item.WhichOneof("kind") == "trajectory":
                await self.ack([item.trajectory.delivery_id])

    async def trajectories(self) -> AsyncIterator[pb.TrajectoryReady]:
        async for frame in self.events():
            if frame.WhichOneof("kind") == "trajectory":
                yield frame.trajectory

    # ------------------------------------------------------------------ the connection

    async def _send(self, req: pb.StreamRolloutsRequest) -> bool:
        """Write ``req`` together with what other callers queue meanwhile: while one write is
        in flight the next requests wait, and the caller that writes next sends them all,
        consecutive ones of a kind merged into one frame (submits with the same policy, acks,
        cancels). Many concurrent one-job submits or one-id acks (an adapter's samples) so
        cost a few frames instead of one each, and an idle session still writes at once.
        False when there is no live stream (see :meth:`_write_locked`)."""
        written = asyncio.get_running_loop().create_future()
        self._outbox.append((req, written))
        async with self._lock:
            await self._flush_locked()
        return written.result() if written.done() else False

    async def _flush_locked(self) -> None:
        items, self._outbox = self._outbox, []
        for req, _ in items:
            if req.WhichOneof("kind") == "submit":
                # Pending from now: answered, or sent again after a reconnect.
                for p in req.submit.jobs:
                    self._pending[p.job_id] = p
                    self._policy[p.job_id] = req.submit.if_finished
                    self._finished.discard(p.job_id)  # a replay's `finished` must come through
        limit = getattr(self.client, "max_message_bytes", MAX_MERGED_BYTES) // 4
        groups = _merged(items, max(1, min(MAX_MERGED_BYTES, limit)))
        for k, (req, waiting) in enumerate(groups):
            try:
                ok = await self._write_locked(req)
            except BaseException:
                # This writer was cancelled: whoever writes next sends what it held.
                self._outbox[:0] = [item for _, w in groups[k:] for item in w]
                raise
            for _, fut in waiting:
                if not fut.done():
                    fut.set_result(ok)

    async def _write_locked(self, req: pb.StreamRolloutsRequest) -> bool:
        """Write on the live stream; False when there is none (the state is re-sent on
        reconnect, so a failed write loses nothing but a cancel)."""
        if self._call is None or self._half_closed or not self._ready:
            return False
        try:
            await self._call.write(req)
        except _STREAM_BROKEN:
            return False
        self.frames_written += 1
        return True

    def _open_request(self) -> pb.StreamRolloutsRequest:
        open_ = pb.OpenSession(client_id=self.client_id, acked_through=self._acked_through,
                               max_unacked=self.max_unacked, progress=self.progress,
                               store_id=self.opened.store_id,
                               batch_progress=self.progress and self.batch_progress,
                               batch_frames=self.batch_frames)
        # Always set: an explicit zero turns heartbeats off (unset would mean the default).
        open_.heartbeat_interval.CopyFrom(Duration(
            seconds=int(max(self.heartbeat_s, 0)),
            nanos=int((max(self.heartbeat_s, 0) % 1) * 1e9)))
        return pb.StreamRolloutsRequest(open=open_)

    async def _connect(self) -> Any:
        async with self._lock:
            call = self.client.stub.StreamRollouts(metadata=self.client.metadata())
            # Writers wait (their state is kept and re-sent) until `opened` has been read.
            self._call, self._half_closed, self._ready = call, False, False
            await call.write(self._open_request())
            return call

    async def _resend(self, call: Any) -> None:
        """After ``opened``: what the last stream may have lost. Not before it, since acks
        must not reach a server whose store changed (the ids would name other deliveries)."""
        async with self._lock:
            if self._acked:
                await call.write(pb.StreamRolloutsRequest(
                    ack=pb.AckTrajectories(delivery_ids=sorted(self._acked))))
            by_policy: dict[pb.FinishedJobPolicy, list[job_pb2.JobSpec]] = {}
            for job_id, spec in self._pending.items():
                policy = self._policy.get(job_id, pb.FINISHED_JOB_POLICY_REPORT)
                by_policy.setdefault(policy, []).append(spec)
            for policy, jobs in by_policy.items():
                await call.write(pb.StreamRolloutsRequest(
                    submit=pb.SubmitJobs(jobs=jobs, if_finished=policy)))
            for msg in self._queued_cancels:
                await call.write(pb.StreamRolloutsRequest(cancel=msg))
            self._queued_cancels.clear()
            self._ready = True

    async def _run(self) -> None:
        try:
            await self._run_streams()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a client bug must end events(), not hang it
            await self._fail(RolloutError(grpc.StatusCode.INTERNAL, "CLIENT_ERROR", repr(exc)))

    async def _run_streams(self) -> None:
        failures = 0
        assert self._first_open is not None
        while True:
            try:
                call = await self._connect()
                first = await call.read()
                if first is grpc.aio.EOF or first.WhichOneof("kind") != "opened":
                    raise RolloutError(grpc.StatusCode.INTERNAL, "PROTOCOL_ERROR",
                                       "the server did not answer `open` with `opened`")
                failures = 0
                await self._on_frame(first)
                await self._resend(call)
                # start() returns only now, so a submit right after it is written at once.
                if self._first_open.done():
                    self.reconnects += 1
                else:
                    self._first_open.set_result(None)
                while (frame := await call.read()) is not grpc.aio.EOF:
                    await self._on_frame(frame)
                self._call = None
                await self._events.put(_END)
                return
            except _STREAM_BROKEN as exc:
                self._call = None
                err = (RolloutError.from_rpc_error(exc) if isinstance(exc, grpc.RpcError)
                       else RolloutError(grpc.StatusCode.UNAVAILABLE, "STREAM_BROKEN",
                                         str(exc)))
                failures += 1
                if not err.retryable or failures > self.max_reconnects:
                    await self._fail(err)
                    return
            except RolloutError as err:
                self._call = None
                await self._fail(err)
                return
            lo, hi = self.backoff_s
            await asyncio.sleep(min(hi, lo * 2 ** (failures - 1)) * random.uniform(0.5, 1.0))

    async def _fail(self, err: RolloutError) -> None:
        assert self._first_open is not None
        if not self._first_open.done():
            self._first_open.set_exception(err)
            self._first_open.exception()  # the caller of start() re-raises it; mark retrieved
        await self._events.put(err)

    async def _on_frame(self, frame: pb.StreamRolloutsResponse) -> None:
        if self.on_wire is not None:
            self.on_wire(frame)
        if frame.WhichOneof("kind") == "batch":
            # Handled one by one, as if each had arrived alone (each carries its own
            # sequence number and job id).
            for inner in frame.batch.frames:
                await self._on_one(inner)
            return
        await self._on_one(frame)

    async def _on_one(self, frame: pb.StreamRolloutsResponse) -> None:
        kind = frame.WhichOneof("kind")
        if kind == "opened":
            if frame.opened.store_changed:
                # Another store numbers deliveries from 1 again: old ids mean nothing there.
                self.store_resets += 1
                self._acked_through = 0
                self._acked.clear()
                self._seen.clear()
                self._finished.clear()
                # The lost store's unfinished jobs would never finish: submit them again.
                self._pending.update(self._unfinished)
                self._unfinished.clear()
            self.opened = frame.opened
            self._confirmed(frame.opened.acked_through)
        elif kind in ("accepted", "rejected"):
            spec = self._pending.pop(frame.job_id, None)
            self._policy.pop(frame.job_id, None)
            if (kind == "accepted" and spec is not None
                    and frame.accepted.state not in _TERMINAL):
                self._unfinished[frame.job_id] = spec
        elif kind == "finished":
            self._unfinished.pop(frame.job_id, None)
            if frame.job_id in self._finished:
                return
            self._finished.add(frame.job_id)
        elif kind == "trajectory":
            did = frame.trajectory.delivery_id
            if did <= self._acked_through or did in self._acked:
                await self.ack_again(did)
                return
            if did in self._seen:
                return
            self._seen.add(did)
        elif kind == "heartbeat":
            self._confirmed(frame.heartbeat.acked_through)
            await self._maybe_half_close(frame.heartbeat)
        elif kind == "progress_batch":
            # Callers keep seeing one progress frame per event, as from a server that does not
            # batch (the queue is unbounded, so this never waits).
            for e in frame.progress_batch.events:
                self._events.put_nowait(pb.StreamRolloutsResponse(
                    sequence=frame.sequence, job_id=e.job_id, progress=e.progress))
            return
        await self._events.put(frame)

    def _confirmed(self, acked_through: int) -> None:
        """The server says every delivery up to ``acked_through`` is durably acknowledged
        (also those an earlier process acknowledged): no need to keep or re-send them."""
        if acked_through <= self._acked_through:
            return
        self._acked_through = acked_through
        self._acked = {i for i in self._acked if i > acked_through}
        while self._acked_through + 1 in self._acked:
            self._acked_through += 1
            self._acked.discard(self._acked_through)
        self._seen = {i for i in self._seen if i > self._acked_through}

    async def ack_again(self, delivery_id: int) -> None:
        """A replay of an acknowledged trajectory means the ack was lost: send it again."""
        await self._send(pb.StreamRolloutsRequest(
            ack=pb.AckTrajectories(delivery_ids=[delivery_id])))

    async def _maybe_half_close(self, hb: pb.Heartbeat) -> None:
        # The server's counts are authoritative (they include jobs submitted by an earlier
        # process with this client id); the local checks cover frames still in flight.
        owes_nothing = (self._closing and not self._pending and not self._seen
                        and not self._outbox and hb.jobs_in_flight == 0 and hb.unacked == 0)
        if not owes_nothing:
            return
        async with self._lock:
            if self._call is not None and not self._half_closed:
                with contextlib.suppress(*_STREAM_BROKEN):
                    await self._call.done_writing()
                self._half_closed = True


_Waiting = list[tuple[pb.StreamRolloutsRequest, "asyncio.Future[bool]"]]


def _merged(items: _Waiting, max_bytes: int) -> list[tuple[pb.StreamRolloutsRequest, _Waiting]]:
    """Consecutive requests of one kind as one request each (submits only with the same
    policy), in order, each under ``max_bytes``; with the queued items each one carries."""
    groups: list[tuple[Any, _Waiting]] = []
    size = 0
    for req, fut in items:
        kind = req.WhichOneof("kind")
        key = (kind, req.submit.if_finished) if kind == "submit" else (kind,)
        n = req.ByteSize()
        if groups and groups[-1][0] == key and size + n <= max_bytes:
            groups[-1][1].append((req, fut))
            size += n
        else:
            groups.append((key, [(req, fut)]))
            size = n
    return [(_join(waiting), waiting) for _, waiting in groups]


def _join(waiting: _Waiting) -> pb.StreamRolloutsRequest:
    if len(waiting) == 1:
        return waiting[0][0]
    reqs = [req for req, _ in waiting]
    kind = reqs[0].WhichOneof("kind")
    if kind == "submit":
        return pb.StreamRolloutsRequest(submit=pb.SubmitJobs(
            jobs=[j for r in reqs for j in r.submit.jobs], if_finished=reqs[0].submit.if_finished))
    if kind == "ack":
        return pb.StreamRolloutsRequest(ack=pb.AckTrajectories(
            delivery_ids=[i for r in reqs for i in r.ack.delivery_ids]))
    return pb.StreamRolloutsRequest(cancel=pb.CancelJobs(
        job_ids=[j for r in reqs for j in r.cancel.job_ids],
        group_ids=[g for r in reqs for g in r.cancel.group_ids]))
