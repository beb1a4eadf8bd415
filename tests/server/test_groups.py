"""Group policies: finish_after early termination and cancelling a whole group."""

from __future__ import annotations

import pytest

from rollout.runtime.types import GroupSpec, JobState
from rollout.server.pipeline.groups import Groups
from rollout.server.pipeline.stage_pool import LiveJob
from rollout.server.scheduler import GROUP_FINISHED
from tests.server.handlers import collect_finished, running_scheduler, spec
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(30)


async def test_finish_after_cancels_the_rest_of_the_group(tmp_path):
    g = GroupSpec("g1", size=5, finish_after=2)
    async with running_scheduler(tmp_path / "db", init_workers=4) as (sched, handler):
        sub = await sched.attach("t")
        jobs = [spec("fast0", group=g, gate=["eval"]), spec("fast1", group=g, gate=["eval"]),
                spec("slow_run", group=g, gate=["run"], spawn=True),
                spec("slow_init", group=g, gate=["init"]),
                spec("queued", group=g, gate=["init"], priority=-1),
                spec("other", group=GroupSpec("g2", 1, 1), gate=["run"])]
        # "queued" waits for INIT behind the gated jobs (lower priority).
        await sched.submit(jobs, "t")
        await assert_eventually(lambda: handler.started("slow_run", "run")
                         and handler.started("slow_init", "init")
                         and handler.started("fast0", "eval") and handler.started("fast1", "eval"))
        handler.open("fast0", "eval")
        handler.open("fast1", "eval")
        done = await collect_finished(sub, ["fast0", "fast1", "slow_run", "slow_init", "queued"])
        assert done["fast0"].state is JobState.SUCCEEDED
        assert done["fast1"].state is JobState.SUCCEEDED
        for j in ("slow_run", "slow_init", "queued"):
            assert done[j].state is JobState.CANCELLED, j
            assert (done[j].error.code, done[j].error.reason) == ("CANCELLED", GROUP_FINISHED)
        assert "slow_run" in handler.resources_closed
        # Every job of the group ended, so the id is free: a later job starts a new group
        # (the same prompt at the next step) and runs.
        async def no_closures() -> bool:  # dropped by a write after the last job ended
            return await sched.store.closed_groups() == {}
        await assert_eventually(no_closures)
        res = await sched.submit([spec("late", group=g)], "t")
        assert res[0].accepted
        late = (await collect_finished(sub, ["late"]))["late"]
        assert late.state is JobState.SUCCEEDED and handler.started("late", "init")
        # Other groups are untouched.
        rec = await sched.get("other")
        assert rec is not None and rec.state is JobState.RUNNING
        handler.open("other", "run")


async def test_cancel_group_reaches_every_stage(tmp_path):
    g = GroupSpec("grp", size=4)
    async with running_scheduler(tmp_path / "db", init_workers=1) as (sched, handler):
        sub = await sched.attach("t")
        await sched.submit([spec("in_run", group=g, gate=["run"], spawn=True),
                            spec("in_eval", group=g, gate=["eval"])], "t")
        await assert_eventually(lambda: handler.started("in_run", "run")
                         and handler.started("in_eval", "eval"))
        await sched.submit([spec("in_init", group=g, gate=["init"]),
                            spec("queued", group=g), spec("keep", gate=["init"])], "t")
        await assert_eventually(lambda: handler.started("in_init", "init"))
        cancelled = await sched.cancel(group_id="grp")
        assert sorted(cancelled) == ["in_eval", "in_init", "in_run", "queued"]
        done = await collect_finished(sub, cancelled)
        assert all(f.state is JobState.CANCELLED and f.error.reason == "CANCELLED_BY_CLIENT"
                   for f in done.values())
        assert "in_run" in handler.resources_closed
        assert ("in_eval", "eval", "cancelled") in handler.events
        assert not handler.started("queued", "init")
        await assert_eventually(lambda: handler.started("keep", "init"))
        handler.open("keep", "init")
        assert (await collect_finished(sub, ["keep"]))["keep"].state is JobState.SUCCEEDED


def _live(job_id: str, group: GroupSpec) -> LiveJob:
    return LiveJob(spec=spec(job_id, group=group), client_id="t", seq=0, created_at=0.0)


def test_a_closed_group_cancels_late_jobs_while_it_has_live_ones_then_frees_its_id():
    reopened: list[str] = []
    groups = Groups(on_reopen=reopened.append)
    g = GroupSpec("g", size=3)
    a, b = _live("a", g), _live("b", g)
    groups.add(a)
    groups.add(b)
    assert set(groups.close("g", "CANCELLED_BY_CLIENT")) == {a, b}
    late = _live("late", g)
    groups.add(late)  # while a and b are still being cancelled: the scheduler cancels it
    assert groups.closed_reason("g") == "CANCELLED_BY_CLIENT"
    assert groups.job_ended(a, False) is None and groups.job_ended(b, False) is None
    assert reopened == [] and groups.closed_reason("g") == "CANCELLED_BY_CLIENT"
    assert groups.job_ended(late, False) is None
    assert reopened == ["g"]  # the persisted closure goes with the last live job
    assert groups.closed_reason("g") is None and not groups.has_live("g")
    # closing a group without live jobs closes nothing (the id stays free)
    assert groups.close("g", "CANCELLED_BY_CLIENT") == []
    assert groups.closed_reason("g") is None


def test_finish_after_reached_by_the_last_live_job_does_not_close_the_group():
    reopened: list[str] = []
    groups = Groups(on_reopen=reopened.append)
    g = GroupSpec("g", size=2, finish_after=2)
    a, b = _live("a", g), _live("b", g)
    groups.add(a)
    groups.add(b)
    assert groups.job_ended(a, True) is None
    assert groups.job_ended(b, True) is None
    assert groups.closed_reason("g") is None and reopened == []


async def test_stale_closures_are_dropped_at_start(tmp_path):
    async with running_scheduler(tmp_path / "db") as (sched, _):
        await sched.store.close_group("old", "CANCELLED_BY_CLIENT", 0.0)
        assert await sched.store.closed_groups() == {"old": "CANCELLED_BY_CLIENT"}
    async with running_scheduler(tmp_path / "db") as (sched, _handler):
        assert await sched.store.closed_groups() == {}
        sub = await sched.attach("t")
        await sched.submit([spec("new", group=GroupSpec("old", 1))], "t")
        assert (await collect_finished(sub, ["new"]))["new"].state is JobState.SUCCEEDED


async def test_a_reused_group_id_counts_only_its_own_successes_after_a_restart(tmp_path):
    g = GroupSpec("reused", size=3, finish_after=2)
    async with running_scheduler(tmp_path / "db") as (sched, handler):
        sub = await sched.attach("t")
        await sched.submit([spec("a0", group=g), spec("a1", group=g)], "t")
        done = await collect_finished(sub, ["a0", "a1"])
        assert all(f.state is JobState.SUCCEEDED for f in done.values())
        # the next generation of the same group id: one success, one still running
        await sched.submit([spec("b0", group=g), spec("b1", group=g, gate=["run"])], "t")
        assert (await collect_finished(sub, ["b0"]))["b0"].state is JobState.SUCCEEDED
        await assert_eventually(lambda: handler.started("b1", "run"))
    async with running_scheduler(tmp_path / "db") as (sched, handler):
        # b1 is recovered into a group with 1 success (b0), not 3: it runs on
        sub = await sched.attach("t")
        await assert_eventually(lambda: handler.started("b1", "run"))
        handler.open("b1", "run")
        assert (await collect_finished(sub, ["b1"]))["b1"].state is JobState.SUCCEEDED
