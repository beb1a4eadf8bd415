"""The frozen group view is the same for every reader: simulated groups whose jobs settle at
random moments and whose records become readable only after a commit lag, read by every
untrainable job's loop (as verl's legacy loop asks) from its own moment on, at its own polling
pace, with its own idea of the service's clock (the newest stamp it has read)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.trainer_adapters.group_view import Member, SettledGroup, cut_group

LAG = 1.0


@dataclass(frozen=True)
class Job:
    job_id: str
    created: float
    create_lag: float
    settled: float | None  # None: runs past every reader
    settle_lag: float
    valid: bool
    reward: float

    def listed(self, at: float) -> Member | None:
        """The job as a listing taken at service time ``at`` shows it."""
        if self.created + self.create_lag > at:
            return None
        if self.settled is None or self.settled + self.settle_lag > at:
            return Member(self.job_id, self.created)
        return Member(self.job_id, self.created, self.settled, self.valid, self.reward)


jobs = st.builds(
    Job,
    job_id=st.text("abcdef", min_size=3, max_size=3),
    created=st.floats(0, 5),
    create_lag=st.floats(0, LAG * 0.99),
    settled=st.one_of(st.none(), st.floats(0, 60)),
    settle_lag=st.floats(0, LAG * 0.99),
    valid=st.booleans(),
    reward=st.sampled_from([0.0, 0.5, 1.0]),
).map(lambda j: j if j.settled is None else
      # A job starts only once its creation is committed, so it settles after that.
      Job(j.job_id, j.created, j.create_lag, j.created + j.create_lag + j.settled,
          j.settle_lag, j.valid, j.reward))


def read_until_decided(group: list[Job], *, size: int, wait_s: float, start: float,
                       poll: float) -> SettledGroup:
    """What :meth:`JobRunner._freeze` does, with the service's true time ``t`` driving the
    listings and the reader's clock a lower bound of it (the newest stamp read)."""
    t, offset = start, None
    fallback = None
    for _ in range(10_000):
        listed = [m for j in group if (m := j.listed(t)) is not None]
        stamps = [max(m.created_at, m.settled_at or 0.0) for m in listed]
        if stamps and (offset is None or max(stamps) - t > offset):
            offset = max(stamps) - t
        now = t + (offset or 0.0)
        fallback = now if fallback is None else fallback
        cut = cut_group(listed, size=size, wait_s=wait_s, now=now, fallback_anchor=fallback,
                        lag_s=LAG)
        if cut.view is not None:
            return cut.view
        t += poll if cut.decide_at is None else min(poll, max(cut.decide_at - now, 0) + 0.01)
    raise AssertionError("never decided")


@settings(max_examples=300, deadline=None)
@given(group=st.lists(jobs, min_size=2, max_size=6, unique_by=lambda j: j.job_id),
       wait_s=st.floats(0, 30), data=st.data())
def test_every_untrainable_loop_derives_the_same_view(group: list[Job], wait_s: float,
                                                      data: st.DataObject) -> None:
    readers = [j for j in group if j.settled is not None and not j.valid]
    if not readers:
        return
    size = len(group)
    views = []
    for r in readers:
        # A loop asks once its own job's outcome reached it (after the commit), at any time.
        start = r.settled + r.settle_lag + data.draw(st.floats(0, 40))  # type: ignore[operator]
        poll = data.draw(st.floats(0.05, 3))
        views.append(read_until_decided(group, size=size, wait_s=wait_s, start=start, poll=poll))
    assert all(v == views[0] for v in views)
    # ... and it is the view the definition gives with everything known.
    anchor = min(j.settled for j in readers)  # type: ignore[type-var]
    cut = anchor + wait_s
    counted = [j for j in group if j.settled is not None and j.settled <= cut]
    assert views[0] == SettledGroup(
        valid={j.job_id: j.reward for j in counted if j.valid},
        untrainable=frozenset(j.job_id for j in counted if not j.valid),
        roster=frozenset(j.job_id for j in group if j.created <= cut))


def test_an_unread_classification_before_the_anchor_holds_the_decision() -> None:
    """A job that settled first but whose row is not classified yet may be the anchor: no view
    is decided from the later one."""
    members = [Member("a", 0.0, 1.0, None), Member("b", 0.0, 2.0, False)]
    assert cut_group(members, size=2, wait_s=0.0, now=100.0, fallback_anchor=0.0).view is None
    members[0] = Member("a", 0.0, 1.0, False)
    view = cut_group(members, size=2, wait_s=0.0, now=100.0, fallback_anchor=0.0).view
    assert view == SettledGroup({}, frozenset({"a"}), frozenset({"a", "b"}))


def test_a_complete_group_is_decided_without_waiting_for_the_lag() -> None:
    members = [Member("a", 0.0, 1.0, False), Member("b", 0.0, 1.5, True, 1.0)]
    cut = cut_group(members, size=2, wait_s=10.0, now=1.5, fallback_anchor=1.5, lag_s=5.0)
    assert cut.view == SettledGroup({"b": 1.0}, frozenset({"a"}), frozenset({"a", "b"}))
    running = [members[0], Member("b", 0.0)]
    waiting = cut_group(running, size=2, wait_s=10.0, now=1.5, fallback_anchor=1.5, lag_s=5.0)
    assert waiting.view is None and waiting.decide_at == 16.0
