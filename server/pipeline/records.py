"""What the scheduler hands back to the servicer about jobs (plain frozen values): a submit's
answer, and a live job as the store's :class:`~rollout.server.store.JobRecord`."""

from __future__ import annotations

from dataclasses import dataclass

from rollout.server.pipeline.stage_pool import LiveJob
from rollout.server.store import JobRecord


@dataclass(frozen=True)
class SubmitResult:
    """Per-job answer to a submit: accepted, a duplicate of an existing job, or rejected."""

    job_id: str
    duplicate: bool = False
    """The id already existed; nothing new was created (idempotent submit)."""
    error: Exception | None = None
    """Why this job was rejected (InvalidArgument, or PermissionDenied GROUP_ID_TAKEN); the
    others of the batch are unaffected."""

    @property
    def accepted(self) -> bool:
        return self.error is None


def record_from_live(job: LiveJob) -> JobRecord:
    return JobRecord(
        job_id=job.job_id, client_id=job.client_id, group_id=job.spec.group_id, state=job.state,
        stage=job.stage, attempts=job.attempts, priority=job.spec.priority, spec=job.spec,
        error=job.error, reward=job.reward, created_at=job.created_at,
        updated_at=job.updated_at or job.created_at, timings=job.timings)
