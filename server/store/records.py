"""The job store's values: what it writes and what it hands back (plain frozen dataclasses).

:class:`JobRecord` is the one job type of the server: the store reads rows into it, the scheduler
builds it for live jobs (:func:`rollout.server.pipeline.records.record_from_live`), and the
servicer turns it into a ``Job`` message.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollout.runtime.types import JobError, JobSpec, JobState, Stage, StageTimings, Trajectory
from rollout.server.api.proto_convert import spec_from_bytes

LIVE_STATES = (JobState.QUEUED.value, JobState.RUNNING.value)
"""Stored states of a job that has not ended."""


@dataclass(frozen=True)
class Transition:
    """One entry of a job's history: it entered ``state`` (and ``stage``) at ``at``."""

    at: float
    state: JobState
    stage: Stage | None


@dataclass(frozen=True)
class JobRecord:
    """A job: as stored, or as it is live in this process (GetJob / ListJobs report it)."""

    job_id: str
    client_id: str
    group_id: str
    state: JobState
    stage: Stage | None
    """The stage the job is in (live) or was in when it ended."""
    attempts: int
    priority: int
    spec: JobSpec
    error: JobError | None
    reward: float | None
    timings: StageTimings
    created_at: float
    """Wall-clock seconds since the epoch."""
    updated_at: float
    seq: int = 0
    """Submission order in the store (0 for a record built from a live job)."""
    crashes: int = 0
    """Times a process died while this job was inside a stage."""
    in_stage: bool = False
    """The job was executing a stage when the row was last written (not waiting in a queue)."""
    history: tuple[Transition, ...] = ()
    """State transitions, oldest first (only when asked for)."""


@dataclass(frozen=True)
class StoredDelivery:
    """An unacknowledged delivery: the finished job's row plus its trajectory."""

    delivery_id: int
    job: JobRecord
    trajectory: Trajectory | None


@dataclass(frozen=True)
class FinishRecord:
    """Everything written when a job reaches a terminal state, in one statement group."""

    job_id: str
    client_id: str
    state: JobState
    stage: Stage | None
    error: JobError | None
    reward: float | None
    timings: StageTimings
    trajectory: Trajectory | None
    at: float


@dataclass
class PruneStats:
    """What one retention pass removed."""

    trajectories: int = 0
    """Acknowledged deliveries whose trajectory, delivery and transition rows were dropped."""
    jobs: int = 0
    """Job rows forgotten entirely (past the second retention window)."""
    channels: int = 0
    """Delivery counters of finished ``SubmitRollout`` channels (``rpc:...``) forgotten."""


@dataclass(frozen=True)
class OwnerJobCounts:
    """One client's jobs by stored state (:meth:`JobStore.owner_counts`)."""

    by_state: dict[JobState, int]
    """Every job the client owns, counted by the state its row holds."""
    live: dict[str, JobState]
    """The client's jobs whose row says QUEUED or RUNNING, by job id, with that state."""


@dataclass(frozen=True)
class GroupTaken:
    """``insert_jobs`` refused a job: its group id is another owner's."""

    group_id: str


class StoreClosed(RuntimeError):
    """The store was closed while an operation was pending."""


def error_to_json(err: JobError | None) -> str | None:
    if err is None:
        return None
    return json.dumps({"code": err.code, "reason": err.reason, "message": err.message,
                       "stage": err.stage.value if err.stage else None})


def error_from_json(text: str | None) -> JobError | None:
    if not text:
        return None
    d = json.loads(text)
    return JobError(d["code"], d["reason"], d["message"], Stage(d["stage"]) if d["stage"] else None)


JOB_COLUMNS = ("seq, job_id, client_id, group_id, state, stage, attempts, priority, spec, error,"
               " reward, timings, created_at, updated_at, crashes, in_stage")
"""The columns :func:`row_to_job` reads, in its order."""


def row_to_job(r: Sequence[Any]) -> JobRecord:
    timings = StageTimings(**json.loads(r[11])) if r[11] else StageTimings()
    return JobRecord(
        seq=r[0], job_id=r[1], client_id=r[2], group_id=r[3], state=JobState(r[4]),
        stage=Stage(r[5]) if r[5] else None, attempts=r[6], priority=r[7],
        spec=spec_from_bytes(r[8]), error=error_from_json(r[9]), reward=r[10],
        timings=timings, created_at=r[12], updated_at=r[13], crashes=r[14],
        in_stage=bool(r[15]))


def now() -> float:
    """Wall-clock seconds; stored timestamps are wall time so they survive restarts."""
    return time.time()
