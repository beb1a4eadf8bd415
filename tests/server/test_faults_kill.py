"""SIGKILL while finishes are being committed: zero lost, zero re-issued deliveries.

The child process (this module run as a script) runs a scheduler whose finish transactions are
slowed inside SQLite (a TEMP trigger calls a Python function that sleeps, on the writer's own
connection), so the kill lands while batches of finishes are half-way through their
transaction. It prints every delivery as it is announced; the parent kills it after a few and
restarts on the same database.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from rollout.server.pipeline.subscription import JobFinished, TrajectoryReady
from tests.server.handlers import ScriptedHandler, running_scheduler, spec

ROOT = Path(__file__).resolve().parents[2]
JOBS = [f"k{i}" for i in range(60)]


async def _child(db: str) -> None:
    async with running_scheduler(db, init_workers=4, run_workers=4,
                                 eval_workers=4) as (sched, _):
        def slow(c):
            c.create_function("slow", 0, lambda: time.sleep(0.01))
            c.execute("CREATE TEMP TRIGGER slow_deliveries AFTER INSERT ON deliveries"
                      " BEGIN SELECT slow(); END")

        fut = sched.store._write(slow, True)
        assert fut is not None
        await fut
        sub = await sched.attach("t", progress=False)
        await sched.submit([spec(j) for j in JOBS], "t")
        async for ev in sub:
            if isinstance(ev, TrajectoryReady):
                print(f"D {ev.delivery_id} {ev.job_id}", flush=True)


@pytest.mark.timeout(90)
async def test_sigkill_during_finish_loses_nothing_and_reissues_no_id(tmp_path):
    db = tmp_path / "jobs.db"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.server.test_faults_kill", str(db), cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE)
    assert child.stdout is not None
    announced: dict[int, str] = {}
    try:
        async with asyncio.timeout(60):
            while len(announced) < 8:
                line = (await child.stdout.readline()).decode().split()
                assert line, "child ended before announcing anything"
                announced[int(line[1])] = line[2]
    finally:
        child.send_signal(signal.SIGKILL)
        await child.wait()
    assert len(announced) < len(JOBS), "the kill came too late to hit a finish"

    handler = ScriptedHandler()
    async with running_scheduler(db, handler=handler) as (sched, _):
        sub = await sched.attach("t", progress=False)
        after: dict[str, int] = {}
        ids = Counter[int]()
        async with asyncio.timeout(60):
            async for ev in sub:
                if isinstance(ev, TrajectoryReady):
                    assert ev.job_id not in after, "delivered twice after the restart"
                    after[ev.job_id] = ev.delivery_id
                    ids[ev.delivery_id] += 1
                elif isinstance(ev, JobFinished) and len(after) == len(JOBS):
                    break
        assert set(after) == set(JOBS), "a job was lost"
        assert set(ids.values()) == {1}
        for did, job in announced.items():
            # What a client saw before the kill is durable under the same id, for the same
            # job: a resuming client that acks it acks exactly what it saw.
            assert after[job] == did, f"{job} announced as {did}, replayed as {after[job]}"
            assert not handler.started(job, "init"), f"{job} was announced yet ran again"
        assert sorted(after.values()) == list(range(1, len(JOBS) + 1)), "an id was skipped"


if __name__ == "__main__":
    asyncio.run(_child(sys.argv[1]))
