"""RolloutService: translates frames and requests to scheduler calls and events back to frames.

Thin on purpose: validation lives in ``server/proto_convert.py``, policy in the scheduler, and the
exception -> status mapping in ``server/errors.py`` (applied by the interceptor).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from rollout.runtime.types import InvalidArgument, JobState
from rollout.server import auth, errors, proto_convert, tenant_status, typed_tasks
from rollout.server.cluster.node import NodeStatus
from rollout.server.pipeline.records import JobRecord
from rollout.server.pipeline.subscription import (
    JobAccepted,
    JobFinished,
    StageProgress,
    TrajectoryReady,
)
from rollout.server.scheduler import Scheduler
from rollout.server.stream_events import (
    Answer,
    Beat,
    Failed,
    HalfClosed,
    ProgressBatch,
    StreamEvent,
    finished_to_proto,
    job_of,
)
from rollout.server.stream_events import progress_to_proto as _progress_to_proto
from rollout.v1 import job_pb2, rollout_service_pb2_grpc
from rollout.v1 import rollout_service_pb2 as pb

log = logging.getLogger(__name__)

VERSION = "0.1.0"
DEFAULT_MAX_UNACKED = 1024
MAX_PROGRESS_BATCH = 512
"""Most events in one ``progress_batch`` frame (about 30-160 bytes each, so a frame stays far
below any client's receive limit); a longer backlog continues in the next frame."""
MAX_PAGE_BYTES = (7 << 20) // 2
"""ListJobs pages stay under the 4 MiB receive limit that grpc-js, grpc-go and grpc-java
default to, whatever the server's own (larger) message limit."""
Frame = Callable[..., pb.StreamRolloutsResponse]


def _client_id_ok(client_id: str) -> None:
    if not client_id:
        raise InvalidArgument("open.client_id is required: a durable id for this trainer, "
                              "reused on reconnect to resume", "MISSING_FIELD", "open.client_id")
    proto_convert.check_id(client_id, "open.client_id")
    auth.check_not_reserved(client_id, "open.client_id")
    auth.current.get().check_client_id(client_id, "open.client_id")


def job_to_proto(rec: JobRecord) -> job_pb2.Job:
    job = job_pb2.Job(
        job_id=rec.job_id, spec=proto_convert.spec_to_proto(rec.spec),
        state=proto_convert.state_to_proto(rec.state),
        stage=proto_convert.stage_to_proto(rec.stage),
        attempts=rec.attempts, reward=rec.reward or 0.0,
        client_id=auth.owner_of(rec.client_id))
    err = proto_convert.job_error_to_proto(rec.error)
    if err is not None:
        job.error.CopyFrom(err)
    job.create_time.FromNanoseconds(int(rec.created_at * 1e9))
    job.update_time.FromNanoseconds(int(rec.updated_at * 1e9))
    return job


def _nodes_to_proto(nodes: list[NodeStatus]) -> list[pb.NodeStatus]:
    """The node agents stage work runs on (the server process itself is not listed)."""
    return [pb.NodeStatus(
        name=n.name, address=n.address, pid=n.pid, alive=n.alive, slots=n.slots, held=n.held,
        stages=[pb.NodeStageStatus(stage=proto_convert.stage_to_proto(s.stage), capacity=s.capacity,
                                   busy=s.busy) for s in n.stages],
        jobs_assigned=n.jobs_assigned, jobs_done=n.jobs_done) for n in nodes if not n.in_server]


class AlreadyExists(errors.ServiceError):
    """A job id that another client owns, or a finished job re-submitted with REJECT."""

    code = grpc.StatusCode.ALREADY_EXISTS
    default_reason = "JOB_ID_TAKEN"


def _job_id_taken(job_id: str) -> AlreadyExists:
    return AlreadyExists(f"job_id {job_id!r} belongs to another client; job ids are owned by "
                         "the client that first submitted them: choose another id (e.g. "
                         "prefix your client id)", "JOB_ID_TAKEN", "job_id")


def _result_pruned(job_id: str) -> errors.FailedPrecondition:
    return errors.FailedPrecondition(
        f"job {job_id!r} finished and retention (pipeline.retention_s) has deleted its "
        "trajectory, so it cannot be delivered again; submit under a new job id to run it "
        "again", "JOB_RESULT_PRUNED", "job_id")


def _rejected(exc: BaseException) -> pb.JobRejected:
    m = errors.classify(exc)
    return pb.JobRejected(code=m.code.value[0], reason=m.reason, message=m.message,
                          field=m.field)


class RolloutServicer(rollout_service_pb2_grpc.RolloutServiceServicer):
    def __init__(self, scheduler: Scheduler, *, heartbeat_s: float = 10.0,
                 min_heartbeat_s: float = 0.1, max_page_bytes: int = 4 << 20,
                 max_progress_batch: int = MAX_PROGRESS_BATCH) -> None:
        self._scheduler = scheduler
        self._max_progress_batch = max(1, max_progress_batch)
        self._heartbeat_s = heartbeat_s
        self._min_heartbeat_s = min_heartbeat_s
        self._max_page_bytes = min(max_page_bytes, MAX_PAGE_BYTES)
        """ListJobs stops a page before its jobs pass this many bytes (under the message
        limit, whatever metadata and tasks the jobs carry)."""
        self._started = time.monotonic()
        self._store_id = ""
        self.sessions = 0
        self._client_sessions: dict[str, int] = {}
        """Open StreamRollouts sessions per client id (GetServerStatus for a tenant)."""
        self._owner_counts = tenant_status.OwnerCounts(scheduler.store, self._live_state)

    def _live_state(self, job_id: str) -> JobState | None:
        job = self._scheduler.jobs.get(job_id)
        return job.state if job is not None else None

    async def _get_store_id(self) -> str:
        if not self._store_id:
            self._store_id = await self._scheduler.store.store_id()
        return self._store_id

    # ------------------------------------------------------------------ the session stream

    async def StreamRollouts(
        self, request_iterator: AsyncIterator[pb.StreamRolloutsRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.StreamRolloutsResponse]:
        try:
            first = await anext(aiter(request_iterator))
        except StopAsyncIteration:
            return
        if first.WhichOneof("kind") != "open":
            raise InvalidArgument("the first frame of StreamRollouts must be `open`",
                                  "OPEN_REQUIRED", "open")
        opened = first.open
        _client_id_ok(opened.client_id)
        if opened.acked_through < 0:
            raise InvalidArgument("open.acked_through must not be negative (0 acknowledges "
                                  "nothing)", "INVALID_ACK", "open.acked_through")
        if opened.max_unacked < 0:
            raise InvalidArgument("open.max_unacked must not be negative (0 means the server "
                                  f"default, {DEFAULT_MAX_UNACKED})", "INVALID_MAX_UNACKED",
                                  "open.max_unacked")
        client_id = opened.client_id
        heartbeat = (opened.heartbeat_interval.ToNanoseconds() / 1e9
                     if opened.HasField("heartbeat_interval") else self._heartbeat_s)
        if opened.HasField("heartbeat_interval") and (
                heartbeat < 0 or 0 < heartbeat < self._min_heartbeat_s):
            # A 1 ns interval would turn the session into a busy loop on the server.
            raise InvalidArgument(
                f"open.heartbeat_interval must be 0 (no heartbeats) or at least "
                f"{self._min_heartbeat_s:g} s (the server's server.min_heartbeat_s)",
                "HEARTBEAT_TOO_SHORT", "open.heartbeat_interval")
        store_id = await self._get_store_id()
        # Delivery ids from another store would acknowledge deliveries this client never saw.
        store_changed = bool(opened.store_id) and opened.store_id != store_id
        sub = await self._scheduler.attach(
            client_id, acked_through=0 if store_changed else opened.acked_through,
            max_unacked=opened.max_unacked or DEFAULT_MAX_UNACKED, progress=opened.progress)
        acked_through = await self._scheduler.store.acked_through(client_id)
        resubmitted: set[int] = set()
        out: asyncio.Queue[StreamEvent] = asyncio.Queue(maxsize=4096)
        batch = (ProgressBatch(self._max_progress_batch)
                 if opened.progress and opened.batch_progress else None)
        seq = 0

        def frame(job_id: str = "", **kind: Any) -> pb.StreamRolloutsResponse:
            nonlocal seq
            seq += 1
            return pb.StreamRolloutsResponse(sequence=seq, job_id=job_id, **kind)

        async def read_requests() -> None:
            try:
                async for req in request_iterator:
                    await self._handle_request(req, client_id, out, resubmitted)
                await out.put(HalfClosed())
            except Exception as exc:  # surfaced by the writer loop below
                await out.put(Failed(exc))

        async def pump_events() -> None:
            try:
                async for ev in sub:
                    await out.put(ev)
            except Exception as exc:
                await out.put(Failed(exc))
            else:
                # The subscription ends only when another stream took over this client id.
                await out.put(Failed(errors.Aborted(
                    f"another StreamRollouts stream opened with client_id {client_id!r}",
                    "SESSION_TAKEN_OVER")))

        async def beat() -> None:
            while True:
                await asyncio.sleep(heartbeat)
                await out.put(Beat(await self._heartbeat(client_id)))

        tasks = [asyncio.create_task(read_requests()), asyncio.create_task(pump_events())]
        if heartbeat > 0:
            tasks.append(asyncio.create_task(beat()))
        self.sessions += 1
        self._client_sessions[client_id] = self._client_sessions.get(client_id, 0) + 1
        try:
            yield frame(opened=pb.SessionOpened(
                client_id=client_id, replaying=sub.replaying, server_version=VERSION,
                store_id=store_id, store_changed=store_changed, acked_through=acked_through))
            while True:
                # The previous write has completed: what queued meanwhile is taken now without
                # waiting (get() on a non-empty queue does not suspend), so held progress goes
                # out as one frame once nothing else is queued or the batch is full.
                if batch and (out.empty() or batch.full):
                    yield frame(progress_batch=batch.take())
                    continue
                item = await out.get()
                if batch is not None:
                    match item:
                        case StageProgress():
                            batch.add(item)
                            continue
                        case JobAccepted():
                            continue  # no frame (the reader answered the submit)
                    if batch and (isinstance(item, HalfClosed) or batch.holds(job_of(item))):
                        # That job's earlier progress goes first, and a closing stream
                        # sends what it holds.
                        yield frame(progress_batch=batch.take())
                match item:
                    case HalfClosed():
                        # Client half-closed: keep sending until its jobs are done and their
                        # deliveries are on the wire, then end. Deliveries it can no longer
                        # ack (or that flow control holds back) replay on its next session.
                        if not self._has_pending(client_id, sub) and out.empty():
                            return
                        tasks.append(asyncio.create_task(
                            self._drain_then_end(client_id, sub, out)))
                    case Failed(error=error):
                        raise error
                    case _:
                        msg = self._event_frame(item, frame, resubmitted)
                        if msg is not None:
                            yield msg
        finally:
            self.sessions -= 1
            left = self._client_sessions.pop(client_id, 1) - 1
            if left:
                self._client_sessions[client_id] = left
            for t in tasks:
                t.cancel()
            with contextlib.suppress(Exception):
                await sub.close()

    def _has_pending(self, client_id: str, sub: Any) -> bool:
        """Jobs still running for this client, or events not yet taken off the subscription."""
        return bool(self._scheduler.client_stats(client_id).get("in_flight") or sub.buffered)

    async def _drain_then_end(self, client_id: str, sub: Any,
                              out: asyncio.Queue[StreamEvent]) -> None:
        while self._has_pending(client_id, sub):
            await asyncio.sleep(0.05)
        await out.put(HalfClosed())

    async def _heartbeat(self, client_id: str) -> pb.Heartbeat:
        # acked_through comes from the store, so it confirms only acknowledgements that are
        # durable (an ack is committed before the session's state changes).
        acked_through = await self._scheduler.store.acked_through(client_id)
        st = self._scheduler.client_stats(client_id)
        now = Timestamp()
        now.GetCurrentTime()
        return pb.Heartbeat(server_time=now, jobs_in_flight=st.get("in_flight", 0),
                            unacked=st.get("unacked", 0), held_back=st.get("held_back", 0),
                            acked_through=acked_through)

    @staticmethod
    def _event_frame(item: Answer | Beat | JobAccepted | StageProgress | TrajectoryReady
                     | JobFinished, frame: Frame,
                     resubmitted: set[int]) -> pb.StreamRolloutsResponse | None:
        match item:
            case Answer(job_id=job_id, body=pb.JobAccepted() as accepted):
                return frame(job_id, accepted=accepted)
            case Answer(job_id=job_id, body=pb.JobRejected() as rejected):
                return frame(job_id, rejected=rejected)
            case Beat(heartbeat=hb):
                return frame(heartbeat=hb)
            case TrajectoryReady():
                return frame(item.job_id, trajectory=pb.TrajectoryReady(
                    delivery_id=item.delivery_id,
                    trajectory=proto_convert.trajectory_to_proto(item.trajectory),
                    resubmitted=item.delivery_id in resubmitted))
            case JobFinished():
                return frame(item.job_id, finished=finished_to_proto(item))
            case StageProgress():
                return frame(item.job_id, progress=_progress_to_proto(item))
        return None  # JobAccepted events: the reader already answered the submit

    @staticmethod
    async def _answer(out: asyncio.Queue[StreamEvent], job_id: str,
                      error: BaseException) -> None:
        """A ``rejected`` frame; the id is cut short so a huge one is not echoed back."""
        await out.put(Answer(job_id[:128], _rejected(error)))

    async def _handle_request(self, req: pb.StreamRolloutsRequest, client_id: str,
                              out: asyncio.Queue[StreamEvent],
                              resubmitted: set[int]) -> None:
        kind = req.WhichOneof("kind")
        if kind == "submit":
            await self._submit_batch(req.submit.jobs, client_id, out,
                                     req.submit.if_finished, resubmitted)
        elif kind == "ack":
            if any(i <= 0 for i in req.ack.delivery_ids):
                # Answered in the stream: a bad ack must not end a session whose other
                # deliveries are fine (they would all replay).
                await self._answer(out, "", InvalidArgument(
                    "ack.delivery_ids must be positive delivery ids from TrajectoryReady "
                    "frames; this ack was ignored", "INVALID_ACK", "ack.delivery_ids"))
                return
            await self._scheduler.ack(client_id, list(req.ack.delivery_ids))
        elif kind == "cancel":
            targets = [("job_id", j) for j in req.cancel.job_ids]
            targets += [("group_id", g) for g in req.cancel.group_ids]
            for key, value in targets:
                try:
                    proto_convert.check_id(value, f"cancel.{key}")
                    await self._check_owner(**{key: value})
                    await self._scheduler.cancel(**{key: value}, wait=False)
                except Exception as exc:
                    await self._answer(out, value if key == "job_id" else "", exc)
        elif kind == "open":
            raise InvalidArgument("`open` is only allowed as the first frame", "DUPLICATE_OPEN",
                                  "open")
        else:
            raise InvalidArgument("empty StreamRollouts frame: set one of submit, ack, cancel",
                                  "EMPTY_FRAME")

    async def _submit_batch(self, jobs: Any, client_id: str, out: asyncio.Queue[StreamEvent],
                            if_finished: int = pb.FINISHED_JOB_POLICY_REPORT,
                            resubmitted: set[int] | None = None) -> None:
        if if_finished not in pb.FinishedJobPolicy.values():
            bad = InvalidArgument(f"submit.if_finished {if_finished} is not a "
                                  "FinishedJobPolicy value", "INVALID_ENUM_VALUE",
                                  "submit.if_finished")
            for p in jobs:
                await self._answer(out, p.job_id, bad)
            return
        specs = []
        for p in jobs:
            try:
                specs.append(proto_convert.spec_from_proto(p))
            except InvalidArgument as exc:  # the id is echoed so the client can match it
                await self._answer(out, p.job_id, exc)
        foreign = await self._foreign_groups(specs)
        for s in specs:
            if s.group is not None and s.group.group_id in foreign:
                await self._answer(out, s.job_id, foreign[s.group.group_id])
        specs = [s for s in specs if s.group is None or s.group.group_id not in foreign]
        if not specs:
            return
        try:
            results = await self._scheduler.submit(specs, client_id)
        except Exception as exc:  # overload: reject the whole batch, keep the stream
            for s in specs:
                await self._answer(out, s.job_id, exc)
            return
        typed = {p.job_id: p.WhichOneof("typed_task") for p in jobs}
        for r in results:
            error: BaseException | None = r.error
            if error is not None:
                error = typed_tasks.error_for(typed.get(r.job_id), error)
            announce = None
            rec = await self._scheduler.get(r.job_id) if r.duplicate and error is None else None
            if rec is not None and auth.owner_of(rec.client_id) != client_id:
                error = _job_id_taken(r.job_id)
            elif rec is not None and rec.state.terminal:
                if if_finished == pb.FINISHED_JOB_POLICY_REJECT:
                    error = AlreadyExists(
                        f"job {r.job_id!r} already finished ({rec.state.name}); its result was "
                        "delivered to this client before. Submit under a new job id to run "
                        "it again", "JOB_ALREADY_FINISHED", "job_id")
                elif if_finished == pb.FINISHED_JOB_POLICY_REPLAY:
                    again = await self._scheduler.redeliver(r.job_id, client_id)
                    if again is None:
                        error = _result_pruned(r.job_id)
                    elif again[1] is not None:
                        if resubmitted is not None:
                            resubmitted.add(again[0])
                        announce = again[1]
            if error is not None:
                await self._answer(out, r.job_id, error)
                continue
            state = (proto_convert.state_to_proto(rec.state) if rec is not None
                     else await self._accepted_state(r))
            await out.put(Answer(r.job_id, pb.JobAccepted(duplicate=r.duplicate, state=state)))
            if announce is not None:
                announce()  # after the answer, so `accepted` precedes the trajectory frame

    async def _check_owner(self, job_id: str | None = None,
                           group_id: str | None = None) -> None:
        """Permission before existence: a client bound to a credential gets the same
        PERMISSION_DENIED for a job or group that does not exist as for another client's."""
        principal = auth.current.get()
        if not principal.bound:
            return
        if job_id is not None:
            rec = await self._scheduler.get(job_id)
            if rec is None or not principal.owns(rec.client_id):
                raise principal.denied_job(job_id)
        if group_id is not None:
            owners = await self._group_owners(group_id)
            if not owners or not all(principal.owns(o) for o in owners):
                raise errors.PermissionDenied(
                    f"no group {group_id!r} is visible to client {principal.client_id!r} (it "
                    "does not exist, or holds another client's jobs)", "GROUP_NOT_ACCESSIBLE",
                    "group_id")

    async def _group_owners(self, group_id: str, limit: int = 0) -> set[str]:
        owners: set[str] = set()
        token = ""
        while True:
            recs, token = await self._scheduler.list(page_size=1000, page_token=token,
                                                     group_id=group_id)
            owners.update(r.client_id for r in recs)
            if not token or (limit and len(recs) >= limit):
                return owners

    async def _foreign_groups(self, specs: Any) -> dict[str, Exception]:
        """Groups of ``specs`` that already hold another client's jobs: joining one would let
        a tenant end someone else's group early (finish_after)."""
        principal = auth.current.get()
        if not principal.bound:
            return {}
        out: dict[str, Exception] = {}
        for gid in {s.group.group_id for s in specs if s.group is not None}:
            owners = await self._group_owners(gid, limit=1)
            if any(not principal.owns(o) for o in owners):
                out[gid] = errors.PermissionDenied(
                    f"group_id {gid!r} is used by another client; choose another id",
                    "GROUP_ID_TAKEN", "group.group_id")
        return out

    async def _accepted_state(self, r: Any) -> job_pb2.Job.State:
        """QUEUED for a new job; a duplicate reports the existing job's state (it may be
        finished already, which tells a resuming client not to wait for it)."""
        if not r.duplicate:
            return job_pb2.Job.STATE_QUEUED
        rec = await self._scheduler.get(r.job_id)
        if rec is None:
            return job_pb2.Job.STATE_QUEUED
        return proto_convert.state_to_proto(rec.state)

    # ------------------------------------------------------------------ unary-ish RPCs

    async def SubmitRollout(self, request: pb.SubmitRolloutRequest,
                            context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[pb.SubmitRolloutResponse]:
        if not request.HasField("job"):
            raise InvalidArgument("job is required", "MISSING_FIELD", "job")
        spec = proto_convert.spec_from_proto(request.job)
        principal = auth.current.get()
        for exc in (await self._foreign_groups([spec])).values():
            raise exc
        rec = await self._scheduler.get(spec.job_id)
        if rec is not None and not principal.owns(rec.client_id):
            raise _job_id_taken(spec.job_id)
        if rec is not None and rec.state.terminal:
            # A retry of a finished job: answer from the store at once. (Waiting for its
            # delivery instead hung forever once an earlier call had acknowledged it.)
            traj = await self._scheduler.get_trajectory(spec.job_id)
            if traj is None:
                raise _result_pruned(spec.job_id)
            yield pb.SubmitRolloutResponse(accepted=pb.JobAccepted(
                duplicate=True, state=proto_convert.state_to_proto(rec.state)))
            yield pb.SubmitRolloutResponse(trajectory=proto_convert.trajectory_to_proto(traj))
            yield pb.SubmitRolloutResponse(finished=finished_to_proto(JobFinished(
                job_id=spec.job_id, state=rec.state, error=rec.error, reward=rec.reward)))
            # A delivery an earlier call never acknowledged (it went away first) is answered
            # now; left open it would be kept forever (retention keeps unacked results).
            channel = principal.rpc_channel(spec.job_id)
            pending = await self._scheduler.store.unacked_delivery(channel, spec.job_id)
            if pending is not None:
                await self._scheduler.ack(channel, [pending])
            return
        # Each job submitted here gets a private delivery channel, so re-submitting the same
        # job id re-attaches and replays its result (rpc:<owner>#<job> for a bound client).
        client_id = principal.rpc_channel(spec.job_id)
        sub = await self._scheduler.attach(client_id, acked_through=0,
                                           max_unacked=DEFAULT_MAX_UNACKED)
        try:
            (result,) = await self._scheduler.submit([spec], client_id)
            if result.error is not None:
                raise typed_tasks.error_for(request.job.WhichOneof("typed_task"), result.error)
            rec = await self._scheduler.get(spec.job_id)
            if rec is not None and not principal.owns(rec.client_id):
                raise _job_id_taken(spec.job_id)
            yield pb.SubmitRolloutResponse(accepted=pb.JobAccepted(
                duplicate=result.duplicate, state=await self._accepted_state(result)))
            if rec is not None and rec.client_id != client_id:
                async for msg in self._follow_foreign(spec.job_id):
                    yield msg
                return
            batch = (ProgressBatch(self._max_progress_batch) if request.batch_progress
                     else None)
            async for first in sub:
                # The previous write has completed: with batching, every event that arrived
                # meanwhile is taken now (without waiting for more), its progress in one frame.
                events = [first, *sub.drain()] if batch is not None else [first]
                for ev in events:
                    match ev:
                        case StageProgress() if batch is not None:
                            batch.add(ev)
                        case StageProgress():
                            yield pb.SubmitRolloutResponse(progress=_progress_to_proto(ev))
                        case TrajectoryReady():
                            while batch:  # the job's progress goes before its trajectory
                                yield pb.SubmitRolloutResponse(progress_batch=batch.take())
                            yield pb.SubmitRolloutResponse(
                                trajectory=proto_convert.trajectory_to_proto(ev.trajectory))
                            # Acknowledged once handed to gRPC: a retry after this replays
                            # from the store (above), so nothing is lost if the caller
                            # vanished meanwhile.
                            await self._scheduler.ack(client_id, [ev.delivery_id])
                        case JobFinished():
                            while batch:
                                yield pb.SubmitRolloutResponse(progress_batch=batch.take())
                            yield pb.SubmitRolloutResponse(finished=finished_to_proto(ev))
                            return
                while batch:
                    yield pb.SubmitRolloutResponse(progress_batch=batch.take())
        finally:
            await sub.close()

    async def _follow_foreign(self, job_id: str) -> AsyncIterator[pb.SubmitRolloutResponse]:
        """The job belongs to a stream session: watch its state without taking its deliveries."""
        while True:
            rec = await self._scheduler.get(job_id)
            if rec is not None and rec.state.terminal:
                traj = await self._scheduler.get_trajectory(job_id)
                if traj is not None:
                    yield pb.SubmitRolloutResponse(
                        trajectory=proto_convert.trajectory_to_proto(traj))
                yield pb.SubmitRolloutResponse(finished=finished_to_proto(JobFinished(
                    job_id=job_id, state=rec.state, error=rec.error, reward=rec.reward)))
                return
            await asyncio.sleep(0.2)

    async def GetJob(self, request: pb.GetJobRequest,
                     context: grpc.aio.ServicerContext) -> pb.GetJobResponse:
        proto_convert.check_id(request.job_id, "job_id")
        await self._check_owner(job_id=request.job_id)
        rec = await self._scheduler.get(request.job_id)
        if rec is None:
            raise errors.NotFound(f"no job with id {request.job_id!r}", "JOB_NOT_FOUND",
                                  "job_id")
        resp = pb.GetJobResponse(job=job_to_proto(rec))
        if rec.timings is not None:
            resp.timings.CopyFrom(proto_convert.timings_to_proto(rec.timings))
        if request.include_trajectory:
            traj = await self._scheduler.get_trajectory(request.job_id)
            if traj is not None:
                resp.trajectory.CopyFrom(proto_convert.trajectory_to_proto(traj))
        return resp

    async def ListJobs(self, request: pb.ListJobsRequest,
                       context: grpc.aio.ServicerContext) -> pb.ListJobsResponse:
        if request.page_size < 0:
            raise InvalidArgument("page_size must not be negative", "INVALID_PAGE_SIZE",
                                  "page_size")
        page_size = min(request.page_size or 100, 1000)
        proto_convert.check_id(request.group_id, "group_id", required=False)
        proto_convert.check_id(request.client_id, "client_id", required=False)
        if len(request.page_token) > 64:
            raise InvalidArgument("page_token is not one this server issued",
                                  "INVALID_PAGE_TOKEN", "page_token")
        principal = auth.current.get()
        client_id = request.client_id or None
        if client_id is not None:
            auth.check_not_reserved(client_id, "client_id")
        if principal.bound:
            principal.check_client_id(client_id or principal.client_id or "", "client_id")
            client_id = principal.client_id
        state = proto_convert.state_from_proto(request.state)

        async def page(size: int) -> tuple[list[JobRecord], str]:
            # A client id selects its owner's jobs: those of its sessions and the ones it
            # submitted with SubmitRollout (stored under rpc:<owner>#<job> channels).
            return await self._scheduler.list(
                page_size=size, page_token=request.page_token, state=state,
                group_id=request.group_id or None, owner=client_id)

        records, token = await page(page_size)
        jobs = [job_to_proto(r) for r in records]
        # Stop before the page passes the byte budget (each job carries its task and
        # metadata), asking again for fewer jobs so the page token points where it stopped.
        total, fits = 0, 0
        for j in jobs:
            total += j.ByteSize() + 8  # field tag and length prefix
            if total > self._max_page_bytes and fits:
                records, token = await page(fits)
                jobs = [job_to_proto(r) for r in records]
                break
            fits += 1
        return pb.ListJobsResponse(jobs=jobs, next_page_token=token or "")

    async def CancelJob(self, request: pb.CancelJobRequest,
                        context: grpc.aio.ServicerContext) -> pb.CancelJobResponse:
        target = request.WhichOneof("target")
        if target is None or not getattr(request, target):
            raise InvalidArgument("set job_id or group_id", "MISSING_FIELD", "target")
        proto_convert.check_id(getattr(request, target), target)
        await self._check_owner(**{target: getattr(request, target)})
        ids = await self._scheduler.cancel(**{target: getattr(request, target)})
        return pb.CancelJobResponse(cancelled_job_ids=ids)

    async def GetServerStatus(self, request: pb.GetServerStatusRequest,
                              context: grpc.aio.ServicerContext) -> pb.GetServerStatusResponse:
        st = self._scheduler.status()
        principal = auth.current.get()
        # A tenant sees its own jobs; how many other tenants run what is an admin's business.
        tenant = principal.client_id if principal.bound and not principal.admin else None
        resp = pb.GetServerStatusResponse(
            version=VERSION,
            uptime=proto_convert.seconds_to_duration(time.monotonic() - self._started),
            environments=self._scheduler.registry.names(),
            sessions=self.sessions if tenant is None else self._client_sessions.get(tenant, 0))
        for s in st.stages:
            resp.stages.append(pb.StageStatus(
                stage=proto_convert.stage_to_proto(s.stage), queue_depth=s.queue_depth,
                in_flight=s.in_flight, workers=s.workers, completed=s.completed,
                failed=s.failed, latency_p50=proto_convert.seconds_to_duration(s.latency_p50_s),
                latency_p95=proto_convert.seconds_to_duration(s.latency_p95_s),
                throughput_per_second=s.throughput_per_s))
        if tenant is not None:
            for state, n in (await self._owner_counts.get(tenant)).items():
                resp.jobs_by_state[state.name] = n
            return resp
        for state, n in st.jobs_by_state.items():
            name = state.name if isinstance(state, JobState) else str(state).upper()
            resp.jobs_by_state[name] = n
        for reason, n in st.jobs_by_termination.items():
            resp.jobs_by_termination[reason.name] = n
        resp.nodes.extend(_nodes_to_proto(self._scheduler.nodes.status()))
        return resp
