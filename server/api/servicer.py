"""RolloutService: translates frames and requests to scheduler calls and events back to frames.

Thin on purpose: validation lives in ``server/api/proto_convert.py``, policy in the scheduler, and
the
exception -> status mapping in ``server/api/errors.py`` (applied by the interceptor).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc

from rollout.runtime.types import InvalidArgument, JobState
from rollout.server.api import errors, proto_convert, typed_tasks
from rollout.server.api.stream_events import (
    ProgressBatch,
    finished_to_proto,
    progress_to_proto,
    trajectory_message,
)
from rollout.server.api.stream_session import (
    DEFAULT_MAX_UNACKED,
    VERSION,
    StreamSession,
    StreamSettings,
    accepted_state,
    result_pruned,
)
from rollout.server.api.token_text import trajectory_pieces
from rollout.server.cluster.node import NodeStatus
from rollout.server.pipeline.subscription import JobFinished, StageProgress, TrajectoryReady
from rollout.server.scheduler import Scheduler
from rollout.server.store import JobRecord
from rollout.server.tenancy import auth, ownership, tenant_status
from rollout.server.tenancy.ownership import Ownership, job_id_taken
from rollout.v1 import job_pb2, rollout_service_pb2_grpc
from rollout.v1 import rollout_service_pb2 as pb

log = logging.getLogger(__name__)

MAX_PROGRESS_BATCH = 512
"""Most events in one ``progress_batch`` frame (about 30-160 bytes each, so a frame stays far
below any client's receive limit); a longer backlog continues in the next frame."""
MAX_PAGE_BYTES = (7 << 20) // 2
"""ListJobs pages stay under the 4 MiB receive limit that grpc-js, grpc-go and grpc-java
default to, whatever the server's own (larger) message limit."""


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


class RolloutServicer(rollout_service_pb2_grpc.RolloutServiceServicer):
    def __init__(self, scheduler: Scheduler, *, heartbeat_s: float = 10.0,
                 min_heartbeat_s: float = 0.1, max_page_bytes: int = 4 << 20,
                 max_progress_batch: int = MAX_PROGRESS_BATCH,
                 max_frame_batch: int = StreamSettings.max_frame_batch) -> None:
        self._scheduler = scheduler
        self._max_progress_batch = max(1, max_progress_batch)
        # A batch frame stays within what one ListJobs page may hold: under the message limit.
        self._stream_settings = StreamSettings(
            heartbeat_s=heartbeat_s, min_heartbeat_s=min_heartbeat_s,
            max_progress_batch=self._max_progress_batch,
            max_frame_batch=max(1, max_frame_batch),
            max_batch_bytes=min(max_page_bytes, StreamSettings.max_batch_bytes))
        self._ownership = Ownership(scheduler)
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
        session = await StreamSession.open(first, self._scheduler, self._ownership,
                                           await self._get_store_id(), self._stream_settings)
        client_id = session.client_id
        self.sessions += 1
        self._client_sessions[client_id] = self._client_sessions.get(client_id, 0) + 1
        try:
            async with contextlib.aclosing(session.run(request_iterator)) as frames:
                async for frame in frames:
                    yield frame
        finally:
            self.sessions -= 1
            left = self._client_sessions.pop(client_id, 1) - 1
            if left:
                self._client_sessions[client_id] = left
            await session.close()

    # ------------------------------------------------------------------ unary-ish RPCs

    async def SubmitRollout(self, request: pb.SubmitRolloutRequest,
                            context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[pb.SubmitRolloutResponse]:
        if not request.HasField("job"):
            raise InvalidArgument("job is required", "MISSING_FIELD", "job")
        spec = proto_convert.spec_from_proto(request.job)
        principal = auth.current.get()
        typed = request.job.WhichOneof("typed_task")
        try:  # before any look at existing ids: see Scheduler.submit
            self._scheduler.validate(spec)
        except InvalidArgument as exc:
            raise typed_tasks.error_for(typed, exc) from None
        rec = await self._scheduler.get(spec.job_id)
        if rec is not None and not principal.owns(rec.client_id):
            raise job_id_taken(spec.job_id)
        if rec is not None and rec.state.terminal:
            # A retry of a finished job: answer from the store at once, because its delivery
            # may be acknowledged already (by the earlier call) and would never come again.
            traj = await self._scheduler.get_trajectory(spec.job_id)
            if traj is None:
                raise result_pruned(spec.job_id)
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
            (result,) = await self._scheduler.submit([spec], client_id,
                                                     own_groups=principal.bound)
            if result.error is not None:
                raise typed_tasks.error_for(typed, result.error)
            rec = await self._scheduler.get(spec.job_id)
            if rec is not None and not principal.owns(rec.client_id):
                raise job_id_taken(spec.job_id)
            yield pb.SubmitRolloutResponse(accepted=pb.JobAccepted(
                duplicate=result.duplicate, state=await accepted_state(self._scheduler, result)))
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
                            yield pb.SubmitRolloutResponse(progress=progress_to_proto(ev))
                        case TrajectoryReady():
                            while batch:  # the job's progress goes before its trajectory
                                yield pb.SubmitRolloutResponse(progress_batch=batch.take())
                            yield pb.SubmitRolloutResponse(
                                trajectory=trajectory_message(ev))
                            sub.sent(ev.delivery_id)
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
        await self._ownership.check(job_id=request.job_id)
        rec = await self._scheduler.get(request.job_id)
        if rec is None:
            raise errors.NotFound(f"no job with id {request.job_id!r}", "JOB_NOT_FOUND",
                                  "job_id")
        resp = pb.GetJobResponse(job=job_to_proto(rec))
        if rec.timings is not None:
            resp.timings.CopyFrom(proto_convert.timings_to_proto(rec.timings))
        if request.include_trajectory or request.include_text:
            tokenizer = getattr(self._scheduler.llm, "tokenizer", None)
            if request.include_text and tokenizer is None:
                raise errors.FailedPrecondition(
                    "this server has no tokenizer to decode with (no LLM backend is "
                    "configured); ask without include_text and decode the ids yourself",
                    "NO_TOKENIZER", "include_text")
            traj = await self._scheduler.get_trajectory(request.job_id)
            if traj is not None:
                resp.trajectory.CopyFrom(proto_convert.trajectory_to_proto(traj))
                if request.include_text:
                    turns = await asyncio.to_thread(trajectory_pieces, tokenizer, traj)
                    resp.text.extend(pb.TurnText(prompt=t.prompt, output=t.output,
                                                 observation=t.observation) for t in turns)
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
        await self._ownership.check(**{target: getattr(request, target)})
        ids = await self._scheduler.cancel(**{target: getattr(request, target)})
        return pb.CancelJobResponse(cancelled_job_ids=ids)

    async def GetServerStatus(self, request: pb.GetServerStatusRequest,
                              context: grpc.aio.ServicerContext) -> pb.GetServerStatusResponse:
        st = self._scheduler.status()
        principal = auth.current.get()
        # A tenant sees its own jobs; how many other tenants run what is an admin's business.
        tenant = None if ownership.sees_server_figures(principal) else principal.client_id
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
