"""What a session's writer receives, as one typed union, and the frames progress becomes.

A ``StreamRollouts`` call has three producers (the request reader, the scheduler's subscription
and the heartbeat timer) and one writer, joined by a queue of :data:`StreamEvent`. Each kind of
item is its own frozen dataclass, so the writer dispatches on types (``match``) instead of
telling sentinels and magic values apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout.runtime.types import Stage
from rollout.server.api import proto_convert
from rollout.server.pipeline.delivery_budget import held_bytes
from rollout.server.pipeline.subscription import (
    JobAccepted,
    JobFinished,
    StageProgress,
    TrajectoryReady,
)
from rollout.v1 import rollout_service_pb2 as pb
from rollout.v1 import trajectory_pb2

_PROGRESS_EVENTS = {"started": pb.StageProgress.EVENT_STARTED,
                    "finished": pb.StageProgress.EVENT_FINISHED,
                    "turn": pb.StageProgress.EVENT_TURN}


@dataclass(frozen=True, slots=True)
class RequestReply:
    """The request reader's answer to a submit, ack or cancel: one ``accepted`` or
    ``rejected`` frame (``job_id`` empty for a rejected ack)."""

    job_id: str
    body: pb.JobAccepted | pb.JobRejected


@dataclass(frozen=True, slots=True)
class Beat:
    """A heartbeat due now."""

    heartbeat: pb.Heartbeat


@dataclass(frozen=True, slots=True)
class HalfClosed:
    """The client ended its requests (or, queued again, the jobs it waited for are done): the
    stream ends once nothing is pending for the client."""


@dataclass(frozen=True, slots=True)
class Failed:
    """A producer failed, or another stream took the client id over: the call ends with it."""

    error: BaseException


SessionEvent = JobAccepted | StageProgress | TrajectoryReady | JobFinished
"""What the scheduler's subscription yields (``server/pipeline/subscription.py``)."""
StreamEvent = RequestReply | Beat | HalfClosed | Failed | SessionEvent


def job_of(event: StreamEvent) -> str:
    """The job an item is about ("" for session-level items)."""
    match event:
        case RequestReply(job_id=job_id):
            return job_id
        case JobAccepted(job_id=job_id) | StageProgress(job_id=job_id):
            return job_id
        case TrajectoryReady(job_id=job_id) | JobFinished(job_id=job_id):
            return job_id
    return ""


def progress_to_proto(ev: StageProgress) -> pb.StageProgress:
    msg = pb.StageProgress(
        stage=proto_convert.stage_to_proto(ev.stage),
        event=_PROGRESS_EVENTS.get(ev.event, pb.StageProgress.EVENT_UNSPECIFIED),
        elapsed=proto_convert.seconds_to_duration(ev.elapsed_s))
    if ev.stage is Stage.RUN and ev.event == "turn":
        # Running totals from the agent loop; a handler with its own loop may report only
        # "turn" (0-based), so the count falls back to it.
        detail = ev.detail or {}
        msg.turns = int(detail.get("turns_done", int(detail.get("turn", 0)) + 1))
        msg.output_tokens = int(detail.get("generated_tokens", 0))
        msg.tool_calls = int(detail.get("tool_calls_total", 0))
    return msg


def trajectory_message(ev: TrajectoryReady) -> trajectory_pb2.Trajectory:
    """The delivery's trajectory as a message: parsed from the bytes the store wrote when the
    delivery carries them (far cheaper than converting the dataclass again), else converted."""
    if ev.encoded:
        return trajectory_pb2.Trajectory.FromString(ev.encoded)
    return proto_convert.trajectory_to_proto(ev.trajectory)


def wire_size(ev: TrajectoryReady) -> int:
    """Bytes the delivery's frame takes on the wire: exact from the store's encoding, else
    the decoded trajectory's memory estimate (larger than its encoding, so a batch of replayed
    deliveries stays under its bound)."""
    return 64 + (len(ev.encoded) if ev.encoded else held_bytes(ev.trajectory))


def progress_size(batch: pb.ProgressBatch) -> int:
    """A bound on a ``progress_batch`` frame's bytes: an event is a few dozen bytes and its
    job id (at most 128 characters)."""
    return 64 + 200 * len(batch.events)


def finished_to_proto(ev: JobFinished) -> pb.JobFinished:
    msg = pb.JobFinished(state=proto_convert.state_to_proto(ev.state), reward=ev.reward or 0.0)
    err = proto_convert.job_error_to_proto(ev.error)
    if err is not None:
        msg.error.CopyFrom(err)
    return msg


class ProgressBatch:
    """Progress events waiting for the next write (``batch_progress`` on ``OpenSession`` or
    ``SubmitRolloutRequest``).

    The writer adds progress events here instead of writing each, and writes them as one
    ``progress_batch`` frame when nothing else is queued (so it never waits for more to
    arrive), when ``limit`` events are held, or before a frame about a job whose progress is
    held (so that job's events keep their order, and its trajectory follows its progress).
    Frames about other jobs go out ahead of the held progress: a trajectory waits for no
    progress but its own job's.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._events: list[StageProgress] = []
        self._jobs: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self._events)

    @property
    def full(self) -> bool:
        return len(self._events) >= self.limit

    def add(self, ev: StageProgress) -> None:
        self._events.append(ev)
        self._jobs.add(ev.job_id)

    def holds(self, job_id: str) -> bool:
        return job_id in self._jobs

    def take(self) -> pb.ProgressBatch:
        """The oldest ``limit`` events as one frame's content (the rest stay for the next)."""
        now, rest = self._events[:self.limit], self._events[self.limit:]
        msg = pb.ProgressBatch(events=[pb.JobProgress(job_id=ev.job_id,
                                                      progress=progress_to_proto(ev))
                                       for ev in now])
        self._events = rest
        self._jobs = {ev.job_id for ev in rest}
        return msg
