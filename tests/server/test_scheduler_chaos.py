"""Many jobs, random stage times, priorities, groups with finish_after, and random cancels.

Whatever interleaving happens, the books must balance: one delivery per job, every started job
cleaned up exactly once, every subprocess gone, and the pools empty at the end.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections import Counter

import pytest

from rollout.runtime.types import GroupSpec, JobState
from rollout.server.pipeline.subscription import JobFinished, TrajectoryReady
from rollout.server.scheduler import NotCancellable
from tests.server.handlers import running_scheduler, spec
from tests.util import assert_eventually


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [7, 11, 23])
async def test_books_balance_under_random_cancels(tmp_path, seed):
    rng = random.Random(seed)
    n = 80
    groups = [GroupSpec(f"g{i}", size=4, finish_after=rng.choice([0, 2])) for i in range(10)]
    specs = []
    for i in range(n):
        sleeps = {s: rng.choice([0, 0.001, 0.003]) for s in ("init", "run", "eval")}
        specs.append(spec(f"j{i}", priority=rng.randint(-1, 1),
                          group=groups[i % 10] if i < 40 else None, sleep=sleeps,
                          spawn=rng.random() < 0.3, fail=rng.choice(["", "", "", "run"])))
    async with running_scheduler(tmp_path / "db", init_workers=3, run_workers=2,
                                 eval_workers=2, stage_queue_size=2) as (sched, handler):
        sub = await sched.attach("t")

        async def cancel_some() -> None:
            for _ in range(25):
                await asyncio.sleep(rng.choice([0, 0.001, 0.002]))
                try:
                    if rng.random() < 0.2:
                        await sched.cancel(group_id=f"g{rng.randrange(10)}", wait=False)
                    else:
                        await sched.cancel(f"j{rng.randrange(n)}", wait=rng.random() < 0.5)
                except NotCancellable:
                    pass

        for i in range(0, n, 20):
            await sched.submit(specs[i:i + 20], "t")
        await cancel_some()
        ready: Counter[str] = Counter()
        finished: dict[str, JobFinished] = {}
        async with asyncio.timeout(40):
            async for ev in sub:
                if isinstance(ev, TrajectoryReady):
                    ready[ev.job_id] += 1
                elif isinstance(ev, JobFinished):
                    assert ev.job_id not in finished, "finished twice"
                    finished[ev.job_id] = ev
                    if len(finished) == n:
                        break
        assert set(ready) == set(finished) and set(ready.values()) == {1}
        states = Counter(f.state for f in finished.values())
        assert states[JobState.SUCCEEDED] > 0 and states[JobState.CANCELLED] > 0
        started = {j for j, s, e in handler.events if s == "init" and e == "start"}
        cleanups = Counter(j for j, s, _ in handler.events if s == "cleanup")
        assert set(cleanups) == started and set(cleanups.values()) == {1}
        assert set(handler.pids) <= handler.resources_closed
        for pid in handler.pids.values():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        await assert_eventually(lambda: sched.status().pending == 0)
        st = sched.status()
        assert all(s.queue_depth == 0 and s.in_flight == 0 for s in st.stages)
        for f in finished.values():
            if f.state is JobState.CANCELLED:
                assert f.error is not None and f.error.reason in (
                    "CANCELLED_BY_CLIENT", "GROUP_FINISHED")
