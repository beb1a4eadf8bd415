"""Trajectories built but not yet committed are bounded by the delivery budget: when the
environments produce faster than the store commits, stage workers wait instead of piling
trajectories up in memory, and every job still finishes once the store catches up."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.types import JobState, Trajectory, Turn
from rollout.server.pipeline.delivery_budget import held_bytes
from rollout.server.pipeline.subscription import JobFinished, TrajectoryReady
from tests.server.handlers import running_scheduler, spec
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(120)
TURNS, WIDTH, JOBS = 200, 100, 24


def _one_size() -> int:
    return held_bytes(Trajectory(job_id="x", turns=[
        Turn(prompt_ids=list(range(1000, 1000 + WIDTH)), output_ids=[3],
             output_logprobs=[-0.5])] * TURNS, metadata={"scripted": "yes"}))


async def test_a_store_slower_than_the_environments_holds_back_the_workers(
        tmp_path: Path) -> None:
    size = _one_size()
    async with running_scheduler(tmp_path / "db", init_workers=4, run_workers=4,
                                 eval_workers=4, stage_queue_size=64,
                                 delivery_memory_bytes=6 * size,
                                 session_memory_bytes=6 * size) as (sched, _):
        runner = sched.pipeline
        store = runner.store
        gate = asyncio.Event()
        real_finish = store.finish
        pending: list[Any] = []

        def slow_finish(rec: Any, *, deliver: bool = True,
                        encoded: Any = None) -> asyncio.Future[Any]:
            """The store's commits are held until the gate opens (a slow disk)."""
            out: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

            async def later() -> None:
                await gate.wait()
                try:
                    out.set_result(await real_finish(rec, deliver=deliver,
                                                     encoded=encoded))
                except Exception as exc:
                    out.set_exception(exc)

            pending.append(asyncio.ensure_future(later()))
            return out

        store.finish = slow_finish  # type: ignore[method-assign]
        sub = await sched.attach("t")
        ids = [f"j{i}" for i in range(JOBS)]
        await sched.submit([spec(j, turns=TURNS, width=WIDTH) for j in ids], "t")
        limit_jobs = runner.precommit_limit // size
        # The workers stop once the uncommitted trajectories pass the limit: a few jobs past
        # it (one per EVAL worker), never all of them.
        await assert_eventually(lambda: len(pending) > limit_jobs, timeout=60)
        await asyncio.sleep(1.0)
        assert len(pending) <= limit_jobs + 1 + 4, len(pending)
        assert runner.precommit_bytes == len(pending) * size
        gate.set()
        finished: dict[str, Any] = {}
        async with asyncio.timeout(90):
            async for ev in sub:  # a client that reads: each trajectory is written, then sent
                if isinstance(ev, TrajectoryReady):
                    sub.sent(ev.delivery_id)
                if isinstance(ev, JobFinished):
                    finished[ev.job_id] = ev
                    if len(finished) == JOBS:
                        break
        assert {ev.state for ev in finished.values()} == {JobState.SUCCEEDED}
        assert runner.precommit_bytes == 0
        assert runner.precommit_peak <= (limit_jobs + 1 + 4) * size
