"""GroupBatcher's bookkeeping around a batch: what is acknowledged when, what survives a
cancelled ``next_batch``, and the equal-reward re-check after stale samples leave a group.

Same real server and scripted group environment as ``test_batcher.py``; the only double is a
wrapper that records (and can hold) the session's acknowledgements.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest

from rollout.client.aio import RolloutClient
from rollout.client.batcher import BatcherConfig, GroupBatcher
from rollout.runtime.handler import JobContext, RunOutcome
from tests.client.conftest import ServerHarness
from tests.client.test_batcher import GroupHandler, _eventually_zero, prompt
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def env(harness: ServerHarness) -> AsyncIterator[tuple[ServerHarness, GroupHandler]]:
    handler = GroupHandler()
    harness.registry.register("groups", handler)
    yield harness, handler


class AckRecorder:
    """Wraps ``session.ack``: records every id it is given, and holds a call that carries at
    least ``hold_at`` ids until ``release`` is set (a slow stream at the worst moment)."""

    def __init__(self, session: Any, hold_at: int = 0) -> None:
        self.session, self.inner = session, session.ack
        self.acked: list[int] = []
        self.hold_at = hold_at
        self.holding = asyncio.Event()
        self.release = asyncio.Event()
        session.ack = self

    async def __call__(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        if self.hold_at and len(ids) >= self.hold_at and not self.release.is_set():
            self.holding.set()
            await self.release.wait()
        await self.inner(ids)
        self.acked += ids


async def test_cancelled_next_batch_returns_its_groups_on_the_next_call(env: Any) -> None:
    harness, _ = env
    data = [prompt([1, 0]), prompt([0, 1])]
    cfg = BatcherConfig(groups_per_batch=2, group_size=2, max_rounds=1, run_id="cx")
    async with RolloutClient(harness.address) as client, client.session("trainer-cx") as s, \
            GroupBatcher(s, data, cfg) as batcher:
        rec = AckRecorder(s, hold_at=4)
        task = asyncio.create_task(batcher.next_batch())
        async with asyncio.timeout(60):
            await rec.holding.wait()  # both groups popped; acknowledging them
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        rec.release.set()
        batch = await asyncio.wait_for(batcher.next_batch(), 30)
        assert sorted(g.rewards for g in batch.groups) == [[0.0, 1.0], [1.0, 0.0]]
        assert len(rec.acked) == 4
        assert await _eventually_zero(harness, "trainer-cx")


async def test_kept_samples_are_acknowledged_when_batched_not_when_complete(env: Any) -> None:
    """A kept group that waits for a later batch is not acknowledged yet: a trainer that dies
    meanwhile gets it again after a restart. Dropped groups are acknowledged at once."""
    harness, _ = env
    data = [prompt([1, 0]), prompt([0, 1], sleep=0.3), prompt([1, 1], sleep=0.3)]
    cfg = BatcherConfig(groups_per_batch=1, group_size=2, max_in_flight_groups=3,
                        prefetch_groups=3, max_rounds=3, run_id="ka")
    async with RolloutClient(harness.address) as client, client.session("trainer-ka") as s, \
            GroupBatcher(s, data, cfg) as batcher:
        rec = AckRecorder(s)
        first = await asyncio.wait_for(batcher.next_batch(), 30)
        assert [g.rewards for g in first.groups] == [[1.0, 0.0]]
        await assert_eventually(lambda: batcher.totals.groups_completed == 3, timeout=30)
        # Six trajectories delivered; acknowledged: the first batch's two and the equal
        # group's two. The other kept group's two wait for the next batch, unacknowledged.
        await assert_eventually(lambda: len(rec.acked) == 4, timeout=10)
        before = set(rec.acked)
        assert {x.delivery_id for x in first.samples} <= before
        second = await asyncio.wait_for(batcher.next_batch(), 30)
        assert [g.rewards for g in second.groups] == [[0.0, 1.0]]
        held = {x.delivery_id for x in second.samples}
        assert not held & before
        assert held <= set(rec.acked)


class VersionedHandler(GroupHandler):
    """As the group environment, but sample ``i``'s turns carry ``versions[i]`` of the task:
    samples of one group that started on different weights."""

    name = "vgroups"

    async def run(self, ctx: JobContext) -> RunOutcome:
        outcome = await super().run(ctx)
        version = int(ctx.spec.task["versions"][int(ctx.spec.job_id.rsplit("/", 1)[1])])
        return RunOutcome(turns=[dataclasses.replace(t, policy_version=version)
                                 for t in outcome.turns], termination=outcome.termination)


async def test_waiting_group_left_all_equal_by_stale_samples_is_dropped(env: Any) -> None:
    """Group B (rewards [1, 0, 0], versions [0, 1, 1]) completes at trainer version 1 with
    bound 1: all fresh, rewards differ, kept; it waits behind group A. The trainer moves to
    version 2: sample 0 is stale now, and what is left, [0, 0], has zero advantage
    everywhere. B must be dropped at batch time, not trained on."""
    harness, _ = env
    harness.registry.register("vgroups", VersionedHandler())
    a = {"environment": "vgroups", "task": {"rewards": [1, 0, 0], "versions": [1, 1, 1]}}
    b = {"environment": "vgroups", "task": {"rewards": [1, 0, 0], "versions": [0, 1, 1],
                                            "sleep": 0.5}}
    cfg = BatcherConfig(groups_per_batch=1, group_size=3, max_in_flight_groups=2,
                        prefetch_groups=2, max_staleness=1, max_rounds=2, run_id="eq")
    async with RolloutClient(harness.address) as client, client.session("trainer-eq") as s, \
            GroupBatcher(s, [a, b], cfg, policy_version=1) as batcher:
        first = await asyncio.wait_for(batcher.next_batch(), 30)
        assert [x.turn_versions for x in first.samples] == [(1,), (1,), (1,)]
        await assert_eventually(lambda: batcher.totals.groups_completed == 2, timeout=30)
        assert batcher.totals.groups_kept == 2  # B was kept when it completed
        batcher.set_policy_version(2)
        second = await asyncio.wait_for(batcher.next_batch(), 30)
        assert second.groups == ()
        assert second.stats.stale_samples == 1 and second.stats.groups_dropped_stale == 1
        assert await _eventually_zero(harness, "trainer-eq")
