"""Group policies for dynamic sampling (DAPO): early termination of a group's redundant jobs.

A group is closed when a trainer cancels it or when ``finish_after`` of its jobs SUCCEEDED; the
closure is persisted so jobs of that group submitted later (even after a restart) are cancelled
at once with the group's reason instead of burning sandbox and GPU time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout.server.pipeline.pool import LiveJob

GROUP_FINISHED = "GROUP_FINISHED"
"""Cancellation reason of jobs stopped because their group reached ``finish_after``."""


@dataclass(slots=True)
class GroupState:
    finish_after: int = 0
    succeeded: int = 0
    closed_reason: str | None = None
    live: set[LiveJob] = field(default_factory=set)


class Groups:
    """In-memory view of the groups that matter now: open ones with live jobs, closed ones."""

    def __init__(self) -> None:
        self._groups: dict[str, GroupState] = {}

    def load_closed(self, closed: dict[str, str]) -> None:
        for gid, reason in closed.items():
            self._groups.setdefault(gid, GroupState()).closed_reason = reason

    def closed_reason(self, group_id: str) -> str | None:
        g = self._groups.get(group_id)
        return g.closed_reason if g else None

    def add(self, job: LiveJob, succeeded_before: int = 0) -> None:
        spec = job.spec
        if spec.group is None:
            return
        g = self._groups.get(spec.group.group_id)
        if g is None:
            g = self._groups[spec.group.group_id] = GroupState(succeeded=succeeded_before)
        g.finish_after = max(g.finish_after, spec.group.finish_after)
        g.live.add(job)
        if g.finish_after and g.succeeded >= g.finish_after and g.closed_reason is None:
            # Reached before a crash whose closing write was lost: close it now.
            g.closed_reason = GROUP_FINISHED

    def job_ended(self, job: LiveJob, succeeded: bool) -> list[LiveJob] | None:
        """Account for a terminal job; returns the jobs to cancel if this closed the group."""
        gid = job.spec.group_id
        g = self._groups.get(gid) if gid else None
        if g is None:
            return None
        g.live.discard(job)
        to_cancel = None
        if succeeded:
            g.succeeded += 1
            if g.finish_after and g.succeeded >= g.finish_after and g.closed_reason is None:
                g.closed_reason = GROUP_FINISHED
                to_cancel = [j for j in g.live if not j.finishing]
        if not g.live and g.closed_reason is None and not g.finish_after:
            del self._groups[gid]  # nothing to remember about a plain finished group
        return to_cancel

    def close(self, group_id: str, reason: str) -> list[LiveJob]:
        """Close a group now (a trainer cancelled it); returns its live jobs to cancel."""
        g = self._groups.setdefault(group_id, GroupState())
        if g.closed_reason is None:
            g.closed_reason = reason
        return [j for j in g.live if not j.finishing]

    def live_count(self) -> int:
        return sum(len(g.live) for g in self._groups.values())
