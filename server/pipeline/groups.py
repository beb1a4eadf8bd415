"""Group policies for dynamic sampling (DAPO): early termination of a group's redundant jobs.

A group is closed when a trainer cancels it or when ``finish_after`` of its jobs SUCCEEDED; the
closure is persisted so jobs of that group submitted while any of its jobs is still live (even
across a restart) are cancelled at once with the group's reason instead of burning sandbox and
GPU time. A group lives exactly as long as it has live jobs: when its last one ends, the group
is forgotten (and its persisted closure dropped through ``on_reopen``), so a trainer may use the
id again for a new group, e.g. the same prompt at the next step. Keeping closures forever made
such ids unusable and grew the table without bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rollout.server.pipeline.stage_pool import LiveJob

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

    def __init__(self, on_reopen: Callable[[str], None] | None = None) -> None:
        self._groups: dict[str, GroupState] = {}
        self.on_reopen = on_reopen
        """Called with a closed group's id once it has no live job: its persisted closure
        must go, or the id would stay closed after a restart."""

    def load_closed(self, closed: dict[str, str]) -> None:
        for gid, reason in closed.items():
            self._groups.setdefault(gid, GroupState()).closed_reason = reason

    def drop_idle(self) -> list[str]:
        """Forget groups without live jobs (closures loaded at start whose jobs all ended);
        returns the closed ones among them, whose persisted closure is now stale."""
        idle = [gid for gid, g in self._groups.items() if not g.live]
        stale = [gid for gid in idle if self._groups[gid].closed_reason is not None]
        for gid in idle:
            del self._groups[gid]
        return stale

    def has_live(self, group_id: str) -> bool:
        g = self._groups.get(group_id)
        return bool(g and g.live)

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
        if succeeded:
            g.succeeded += 1
        if not g.live:
            # The group's last job: nothing is left to cancel, and the id is free again.
            del self._groups[gid]
            if g.closed_reason is not None and self.on_reopen is not None:
                self.on_reopen(gid)
            return None
        if (succeeded and g.finish_after and g.succeeded >= g.finish_after
                and g.closed_reason is None):
            g.closed_reason = GROUP_FINISHED
            return [j for j in g.live if not j.finishing]
        return None

    def close(self, group_id: str, reason: str) -> list[LiveJob]:
        """Close a group now (a trainer cancelled it); returns its live jobs to cancel. A
        group without live jobs is not closed: there is nothing to stop, and its id is free."""
        g = self._groups.get(group_id)
        if g is None or not g.live:
            return []
        if g.closed_reason is None:
            g.closed_reason = reason
        return [j for j in g.live if not j.finishing]

