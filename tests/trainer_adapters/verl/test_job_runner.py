"""The per-sample job runner both adapters share, against a live server: concurrent callers on one
session each get their own outcome, a rejected job says what to fix, and a caller that gives up
cancels its job on the server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollout.client.aio import RolloutClient
from rollout.client.errors import RolloutError
from rollout.trainer_adapters.group_fill import fill_for, grpo_fills
from rollout.trainer_adapters.job_runner import JobRejectedError, JobRunner, shared_runner
from rollout.v1 import job_pb2
from tests.client.conftest import ServerHarness
from tests.trainer_adapters.verl.episodes import episode_harness, two_turn_tool_episode
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[ServerHarness]:
    h = episode_harness(tmp_path / "state")
    await h.start()
    yield h
    await h.stop()


def job(job_id: str, task: dict) -> dict:
    return {"job_id": job_id, "environment": "episode", "task": task}


async def test_concurrent_callers_share_one_session(harness: ServerHarness) -> None:
    runner = shared_runner(harness.address)
    assert shared_runner(harness.address) is runner
    try:
        outs = await asyncio.gather(*[
            runner.run(job(f"j{i}", two_turn_tool_episode(base=100 * i, reward=float(i))))
            for i in range(1, 5)])
        assert [o.trajectory.job_id for o in outs] == ["j1", "j2", "j3", "j4"]
        assert [o.trajectory.reward for o in outs] == [1.0, 2.0, 3.0, 4.0]
        assert all(o.succeeded for o in outs)
        assert [o.trajectory.turns[0].prompt_ids[0] for o in outs] == [100, 200, 300, 400]
        async with RolloutClient(harness.address) as client:
            jobs = [j async for j in client.list_jobs()]
        assert {j.client_id for j in jobs} == {runner.client_id}
    finally:
        await runner.close()


async def test_rejected_job_names_the_field(harness: ServerHarness) -> None:
    runner = JobRunner(harness.address)
    try:
        with pytest.raises(JobRejectedError, match=r"task\.turns") as err:
            await runner.run(job("bad", {"turns": "not a list"}))
        assert err.value.reason == "INVALID_TASK"
    finally:
        await runner.close()


async def test_caller_that_gives_up_cancels_its_job(harness: ServerHarness) -> None:
    runner = JobRunner(harness.address)
    try:
        task = asyncio.create_task(runner.run(job("slow", {**two_turn_tool_episode(),
                                                           "sleep": 30})))
        async with RolloutClient(harness.address) as client:
            async def running() -> bool:
                try:
                    job_now = (await client.get_job("slow")).job
                except RolloutError:  # not submitted yet
                    return False
                return job_now.state == job_pb2.Job.STATE_RUNNING

            await assert_eventually(running)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

            async def cancelled() -> bool:
                return (await client.get_job("slow")).job.state == job_pb2.Job.STATE_CANCELLED

            await assert_eventually(cancelled)
    finally:
        await runner.close()


async def test_a_groups_view_is_frozen_once_for_every_loop(harness: ServerHarness) -> None:
    """The verl legacy loops of one group that has not settled within ``neutral_wait_s``: the
    view holds the siblings that settled by the group's cut (its first untrainable job's
    settling plus the wait), so a later loop of the group gets that same view, although a
    valid sibling settled in between, and so does a loop in another process (another runner:
    its own session, nothing shared but the service) that asks only after every sibling
    settled. Both fills then come from one set and are distinct slots of it, so they
    complement each other; with a view per loop, or per process, the later one would count
    the new valid reward and the fills would not cancel."""
    runner, elsewhere = JobRunner(harness.address), JobRunner(harness.address)
    group = {"group_id": "g", "size": 4}
    tasks = {"a-ok": two_turn_tool_episode(base=100, reward=1.0),
             "b-failed": {**two_turn_tool_episode(base=200), "fail": "eval"},
             "c-late-ok": {**two_turn_tool_episode(base=300, reward=0.0), "sleep": 8},
             "d-late-failed": {**two_turn_tool_episode(base=400), "fail": "eval", "sleep": 8}}
    try:
        # a-ok settles before the anchor (b-failed, the first untrainable job).
        await runner.run({**job("a-ok", tasks["a-ok"]), "group": group})
        runs = {name: asyncio.create_task(runner.run({**job(name, task), "group": group}))
                for name, task in tasks.items() if name != "a-ok"}
        await runs["b-failed"]
        first = await runner.frozen_group("g", size=4, timeout_s=0.0, lag_s=0.5)
        if "c-late-ok" in first.valid:  # the machine was too slow for the test to discriminate
            pytest.skip("the sleeping sibling settled before the first view")
        assert first.valid == {"a-ok": 1.0} and first.untrainable == {"b-failed"}
        assert first.roster == set(tasks)
        late = await runs["c-late-ok"]
        await runs["d-late-failed"]
        assert late.succeeded
        assert await runner.frozen_group("g", size=4, timeout_s=0.0, lag_s=0.5) == first
        assert await elsewhere.frozen_group("g", size=4, timeout_s=0.0, lag_s=0.5) == first
        # What a fresh view taken now would say: the late sibling is valid.
        fresh = await runner.settled_group("g", exclude="", others=4, timeout_s=0.0)
        assert fresh.valid == {"a-ok": 1.0, "c-late-ok": 0.0}
        fills = [fill_for(j, first.valid, first.roster, 4) for j in ("b-failed", "d-late-failed")]
        slots = grpo_fills([1.0], 4)  # the frozen view: one valid reward, three slots
        assert fills == [slots[0], slots[2]]  # b, c (its slot, unused), d by job id
    finally:
        await runner.close()
        await elsewhere.close()


async def test_a_settled_group_is_viewed_whole_at_once(harness: ServerHarness) -> None:
    """Once every sibling has settled the view is decided without waiting out the wait, and a
    sibling that settled within the wait of the first untrainable one counts."""
    runner = JobRunner(harness.address)
    group = {"group_id": "whole", "size": 3}
    tasks = {"a-failed": {**two_turn_tool_episode(base=100), "fail": "eval"},
             "b-ok": two_turn_tool_episode(base=200, reward=1.0),
             "c-ok": two_turn_tool_episode(base=300, reward=0.5)}
    try:
        await asyncio.gather(*[runner.run({**job(name, task), "group": group})
                               for name, task in tasks.items()])
        view = await asyncio.wait_for(
            runner.frozen_group("whole", size=3, timeout_s=3600.0, lag_s=3600.0), 30)
        assert view.valid == {"b-ok": 1.0, "c-ok": 0.5}
        assert view.untrainable == {"a-failed"} and view.roster == set(tasks)
    finally:
        await runner.close()
