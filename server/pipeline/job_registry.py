"""The job registry: which jobs are live in this process, and the counts that follow from that.

Why it is its own object: admission (the pending and per-client caps), adoption of stored jobs,
cancellation by id or group, status and the stage pipeline all ask "which jobs are live, how
many, whose" — and they must get one answer. Only the registry writes them, through a few
methods that keep the counts consistent:

- ``pending`` and the per-client counts cover jobs that are live *and* jobs whose submit
  commit is in flight (``reserve`` before the commit, ``adopt(counted=True)`` or ``unreserve``
  after), so concurrent submits cannot overshoot a cap while they await the store.
- A job leaves the registry only in ``retire``, once its end is durable: a job whose terminal
  write failed stays live (and counted) while the write is retried.
- ``committing`` holds ids whose submit commit is in flight, so a sweep for stored-but-not-live
  jobs does not adopt a job its own submit is about to adopt.
- Groups (``server/pipeline/groups.py``) are a view of live jobs, so they live here too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from rollout.runtime.types import JobState
from rollout.server.pipeline.groups import Groups
from rollout.server.pipeline.stage_pool import LiveJob


class JobRegistry:
    """Live jobs by id, their per-client and server-wide counts, groups, finished totals."""

    def __init__(self, on_group_reopen: Callable[[str], None] | None = None) -> None:
        self.live: dict[str, LiveJob] = {}
        """Jobs not yet durably terminal, by id (read-only outside this class)."""
        self.pending = 0
        """Live jobs plus reserved ones (submit commits in flight): what the caps limit."""
        self._per_client: dict[str, int] = {}
        self._committing: dict[str, int] = {}
        self.groups = Groups(on_group_reopen)
        self.finished: dict[JobState, int] = {}
        """Jobs that ended durably since this process started, by state (status)."""

    def get(self, job_id: str) -> LiveJob | None:
        return self.live.get(job_id)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self.live

    def __len__(self) -> int:
        return len(self.live)

    def __iter__(self) -> Iterator[LiveJob]:
        return iter(list(self.live.values()))

    def in_flight(self, client_id: str) -> int:
        """Unfinished (or reserved) jobs of one client."""
        return self._per_client.get(client_id, 0)

    # -- admission ---------------------------------------------------------------------------

    def reserve(self, client_id: str, n: int) -> None:
        """Count ``n`` jobs of ``client_id`` before their commit, so caps hold across awaits."""
        self.pending += n
        self._per_client[client_id] = self._per_client.get(client_id, 0) + n

    def unreserve(self, client_id: str, n: int) -> None:
        """Give back reservations whose jobs were not stored (a failed commit, a duplicate)."""
        self.pending -= n
        left = self._per_client.get(client_id, 0) - n
        if left > 0:
            self._per_client[client_id] = left
        else:
            self._per_client.pop(client_id, None)

    def begin_commit(self, job_ids: Iterable[str]) -> None:
        for j in job_ids:
            self._committing[j] = self._committing.get(j, 0) + 1

    def end_commit(self, job_ids: Iterable[str]) -> None:
        for j in job_ids:
            left = self._committing[j] - 1
            if left:
                self._committing[j] = left
            else:
                del self._committing[j]

    def committing(self, job_id: str) -> bool:
        """A submit of this id is committing now: it is not an orphan, whatever the store says."""
        return bool(self._committing.get(job_id))

    # -- lifecycle ---------------------------------------------------------------------------

    def adopt(self, job: LiveJob, succeeded_before: int, *, counted: bool = False) -> None:
        """Make ``job`` live; ``counted``: its submit already reserved it.
        ``succeeded_before``: jobs of its group that had already SUCCEEDED (``finish_after``)."""
        self.live[job.job_id] = job
        if not counted:
            self.reserve(job.client_id, 1)
        self.groups.add(job, succeeded_before)

    def retire(self, job: LiveJob, state: JobState) -> None:
        """The job's end is durable: it is live no more, and counts as finished."""
        self.live.pop(job.job_id, None)
        self.unreserve(job.client_id, 1)
        self.finished[state] = self.finished.get(state, 0) + 1

    def by_state(self) -> dict[JobState, int]:
        """Finished totals plus live jobs by their current state (those already ending are
        counted once their end is durable, not twice)."""
        out = dict(self.finished)
        for job in self.live.values():
            if not job.finishing:
                out[job.state] = out.get(job.state, 0) + 1
        return out
