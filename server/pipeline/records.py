"""What the scheduler hands back to the servicer about jobs (plain frozen values)."""

from __future__ import annotations

from dataclasses import dataclass

from rollout.runtime.types import InvalidArgument, JobError, JobSpec, JobState, Stage, StageTimings
from rollout.server.pipeline.stage_pool import LiveJob
from rollout.server.store import StoredJob, Transition


@dataclass(frozen=True)
class SubmitResult:
    """Per-job answer to a submit: accepted, a duplicate of an existing job, or rejected."""

    job_id: str
    duplicate: bool = False
    """The id already existed; nothing new was created (idempotent submit)."""
    error: InvalidArgument | None = None
    """Why this job was rejected; the others of the batch are unaffected."""

    @property
    def accepted(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class JobRecord:
    """A job as GetJob / ListJobs report it."""

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
    created_at: float
    """Wall-clock seconds since the epoch."""
    updated_at: float
    timings: StageTimings
    history: tuple[Transition, ...] = ()
    """State transitions, oldest first (only when asked for)."""


def record_from_live(job: LiveJob) -> JobRecord:
    return JobRecord(
        job_id=job.job_id, client_id=job.client_id, group_id=job.spec.group_id, state=job.state,
        stage=job.stage, attempts=job.attempts, priority=job.spec.priority, spec=job.spec,
        error=job.error, reward=None, created_at=job.created_at,
        updated_at=job.updated_at or job.created_at, timings=job.timings)


def record_from_stored(s: StoredJob) -> JobRecord:
    return JobRecord(
        job_id=s.job_id, client_id=s.client_id, group_id=s.group_id, state=s.state,
        stage=s.stage, attempts=s.attempts, priority=s.priority, spec=s.spec, error=s.error,
        reward=s.reward, created_at=s.created_at, updated_at=s.updated_at, timings=s.timings)
