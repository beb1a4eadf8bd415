"""Group policies: finish_after early termination and cancelling a whole group."""

from __future__ import annotations

import pytest

from rollout.runtime.types import GroupSpec, JobState
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
        # Jobs of the finished group submitted later are cancelled at once, never run.
        res = await sched.submit([spec("late", group=g)], "t")
        assert res[0].accepted
        late = (await collect_finished(sub, ["late"]))["late"]
        assert late.state is JobState.CANCELLED and late.error.reason == GROUP_FINISHED
        assert not handler.started("late", "init")
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
