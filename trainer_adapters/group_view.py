"""A group's frozen view, derived alike by every process that asks for it.

verl's legacy loop gives an untrainable row (a failed job, a masked one) a fill reward computed
from its group's valid rewards (:mod:`rollout.trainer_adapters.group_fill`), and the fills
complement each other only when every untrainable row of the group computes its fill from the
same set of siblings. A group can be split across processes (verl's ``AgentLoopManager`` hands
each worker a contiguous chunk of the batch, which cuts a group whenever the chunk size is not a
multiple of ``n``), so "the view this process took first" is not enough: two processes that
look at different moments would see different siblings settled.

So the view is defined by the service's own timestamps, not by when anyone looked: the group's
**anchor** is the moment the earliest of its untrainable jobs settled, its **cut** is the anchor
plus the caller's wait, and the view is every sibling that settled by the cut (each with the
classification the caller's own test gives it, which is the same function in every process).
Any process that reads the group after the cut, or after every sibling settled, derives the same
view whenever it reads. Time is the service's clock throughout; a reader never compares it with
its own wall clock, only with a lower bound of the service's time (the newest stamp it has read,
plus the monotonic time elapsed since that read), so clock skew between hosts changes nothing.

The one thing a timestamp cannot prove is that a record stamped before the cut is already
readable: the service stamps a finished job before its store commits it. A reader therefore
decides by time only ``lag_s`` after the cut; a store slower than that to commit a finished job
could show two processes different views (their fills then still keep the mean of the set each
saw, as a view per process always did).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

COMMIT_LAG_S = 10.0
"""How long after a cut a reader waits before deciding the view by time alone: longer than the
service takes to commit a finished job it has stamped (milliseconds when healthy, seconds on a
machine at load 10)."""


@dataclass(frozen=True)
class SettledGroup:
    """A group's settled jobs as one caller sees them: the valid ones' rewards by job id, and
    the ids of the others (failed, cancelled, or not trained by the caller)."""

    valid: dict[str, float]
    untrainable: frozenset[str]
    roster: frozenset[str] = frozenset()
    """Every job id of the group (settled or not) that the view counts: a job still running at
    the cut is in the roster and in neither set."""


@dataclass(frozen=True)
class Member:
    """One job of a group as a reader last saw it; times are the service's, in seconds."""

    job_id: str
    created_at: float
    settled_at: float | None = None
    """When the job reached its terminal state; None while it runs."""
    valid: bool | None = None
    """Whether the caller trains it (SUCCEEDED and its row trained); None while it runs or
    before its trajectory could be read."""
    reward: float = 0.0


@dataclass(frozen=True)
class Cut:
    """The verdict on one reading of a group: the view when it is decided, else the service
    time at which waiting alone could decide it (None: only more reading can)."""

    view: SettledGroup | None
    decide_at: float | None = None

    @property
    def decided(self) -> bool:
        return self.view is not None


def cut_group(members: Iterable[Member], *, size: int, wait_s: float, now: float,
              fallback_anchor: float, lag_s: float = COMMIT_LAG_S) -> Cut:
    """The view of a group whose jobs a reader sees as ``members`` at service time ``now`` (a
    lower bound). ``fallback_anchor`` stands in for the anchor when no member is known to be
    untrainable (then the view is this reader's own: nothing marks a common moment)."""
    seen = sorted(members, key=lambda m: (m.settled_at is None, m.settled_at or 0.0, m.job_id))
    anchor = fallback_anchor
    for m in seen:
        if m.settled_at is None:
            break
        if m.valid is None:
            return Cut(None)  # an earlier settled job may be the anchor: read it first
        if m.valid is False:
            anchor = m.settled_at
            break
    cut = anchor + max(wait_s, 0.0)
    complete = len(seen) >= size and all(m.valid is not None for m in seen)
    if not complete and now < cut + lag_s:
        return Cut(None, decide_at=cut + lag_s)
    counted = [m for m in seen if m.settled_at is not None and m.settled_at <= cut]
    if any(m.valid is None for m in counted):
        return Cut(None)
    return Cut(SettledGroup(
        valid={m.job_id: m.reward for m in counted if m.valid},
        untrainable=frozenset(m.job_id for m in counted if not m.valid),
        roster=frozenset(m.job_id for m in seen if m.created_at <= cut)))


__all__ = ["COMMIT_LAG_S", "Cut", "Member", "SettledGroup", "cut_group"]
