"""Nothing accepted is lost: SIGKILL mid-run, restart, every job completes and is delivered.

The crashing scheduler runs in a child process (this module run as a script), so the kill is a
real SIGKILL of a process holding the SQLite database open, not a simulated one.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from rollout.runtime.types import JobState, Stage
from rollout.server.pipeline.subscription import TrajectoryReady
from rollout.server.store import JobStore
from tests.server.handlers import (
    ScriptedHandler,
    collect_finished,
    running_scheduler,
    spec,
)
from tests.util import assert_eventually, patience

ROOT = Path(__file__).resolve().parents[2]
DONE = [f"done{i}" for i in range(5)]
RUNNING = [f"run{i}" for i in range(2)]
QUEUED = [f"q{i}" for i in range(10)]


async def _child(db: str) -> None:
    """Finish some jobs (never acked), hold two in RUN, queue the rest; then wait to be killed."""
    async with running_scheduler(db, init_workers=1, run_workers=2, eval_workers=1,
                                 stage_queue_size=3) as (sched, handler):
        await sched.submit([spec(j) for j in DONE], "trainer")
        await assert_eventually(lambda: sched.status().pending == 0, timeout=20)
        await sched.submit([spec(j, gate=["run"]) for j in RUNNING + QUEUED], "trainer")
        await assert_eventually(lambda: all(handler.started(j, "run") for j in RUNNING), timeout=20)
        await sched.store.flush()
        print("READY", flush=True)
        await asyncio.sleep(3600)


@pytest.mark.timeout(60)
async def test_sigkill_mid_run_then_restart_delivers_everything(tmp_path):
    db = tmp_path / "jobs.db"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.server.test_recovery", str(db), cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE)
    assert child.stdout is not None
    try:
        line = await asyncio.wait_for(child.stdout.readline(), patience(40))
        assert line.strip() == b"READY"
    finally:
        child.send_signal(signal.SIGKILL)
        await child.wait()

    handler = ScriptedHandler()
    for j in RUNNING + QUEUED:
        handler.open(j, "run")
    async with running_scheduler(db, handler=handler) as (sched, _):
        sub = await sched.attach("trainer")
        everything = DONE + RUNNING + QUEUED
        deliveries: dict[str, TrajectoryReady] = {}
        finished = {}
        async with asyncio.timeout(30):
            async for ev in sub:
                if isinstance(ev, TrajectoryReady):
                    assert ev.job_id not in deliveries, "delivered twice"
                    deliveries[ev.job_id] = ev
                elif type(ev).__name__ == "JobFinished":
                    finished[ev.job_id] = ev
                    if len(finished) == len(everything):
                        break
        assert sorted(finished) == sorted(everything)
        assert all(f.state is JobState.SUCCEEDED for f in finished.values())
        # Finished-but-unacked trajectories come back from the store; they did not run again.
        assert all(deliveries[j].replayed for j in DONE)
        assert not any(handler.started(j, "init") for j in DONE)
        for j in RUNNING:
            rec = await sched.get(j)
            assert rec is not None and rec.attempts == 2, "interrupted once, ran again"
        # Only the jobs inside a stage at the kill are charged a crash; those waiting in a
        # queue (before INIT, or between stages) are not.
        crashes = {j: (await sched.store.get(j)).crashes for j in RUNNING + QUEUED}
        assert crashes == {**{j: 1 for j in RUNNING}, **{j: 0 for j in QUEUED}}
        ids = sorted(d.delivery_id for d in deliveries.values())
        assert ids == list(range(1, len(everything) + 1))


@pytest.mark.timeout(30)
async def test_graceful_stop_requeues_running_jobs(tmp_path):
    db = tmp_path / "jobs.db"
    async with running_scheduler(db) as (sched, handler):
        await sched.submit([spec("a", gate=["run"], spawn=True), spec("b", gate=["init"])], "c")
        await assert_eventually(
            lambda: handler.started("a", "run") and handler.started("b", "init"))
        await sched.stop(grace_s=0.0)
        assert "a" in handler.resources_closed  # stopping still frees what jobs hold
        assert handler.events.count(("a", "cleanup", "")) == 1
        assert handler.events.count(("b", "cleanup", "")) == 1
        rec = await sched.store.get("a")
        assert rec is not None and rec.state is JobState.RUNNING and rec.stage is Stage.RUN

    again = ScriptedHandler()
    again.open("a", "run")
    again.open("b", "init")
    async with running_scheduler(db, handler=again) as (sched, _):
        sub = await sched.attach("c")
        done = await collect_finished(sub, ["a", "b"])
        assert {f.state for f in done.values()} == {JobState.SUCCEEDED}


@pytest.mark.timeout(30)
async def test_job_that_keeps_crashing_inside_a_stage_fails_instead_of_looping(tmp_path):
    db = tmp_path / "jobs.db"
    store = JobStore(db)
    await store.open()
    await store.insert_jobs([(spec("loop"), "c"), (spec("waited"), "c")], 1.0)
    await store.recover([("loop", 2), ("waited", 2)], 1.5)  # two crashes charged before
    store.record_stage("loop", Stage.RUN, 3, 2.0)  # the process died inside RUN a third time
    store.record_stage("waited", Stage.INIT, 3, 2.0)
    await store.record_waiting(["waited"])  # ... while this one was queued for RUN
    await store.close()
    async with running_scheduler(db, max_attempts=3) as (sched, handler):
        sub = await sched.attach("c")
        fin = await collect_finished(sub, ["loop", "waited"])
        assert fin["loop"].state is JobState.FAILED
        assert fin["loop"].error.reason == "TOO_MANY_ATTEMPTS"
        assert not handler.started("loop", "init")
        assert fin["waited"].state is JobState.SUCCEEDED  # waiting is not crashing
        assert (await sched.store.get("waited")).crashes == 2


@pytest.mark.timeout(60)
async def test_graceful_restarts_never_count_against_jobs(tmp_path):
    """Five graceful stops with jobs inside a stage and jobs queued: none is charged, none
    fails (three such restarts used to fail a sixth of the jobs with TOO_MANY_ATTEMPTS)."""
    db = tmp_path / "jobs.db"
    ids = [f"g{i}" for i in range(6)]
    for restart in range(5):
        async with running_scheduler(db, init_workers=1, run_workers=1,
                                     max_attempts=2) as (sched, handler):
            if restart == 0:
                await sched.submit([spec(j, gate=["run"]) for j in ids], "c")
            await assert_eventually(lambda h=handler: h.started("g0", "run"))
            await sched.stop(grace_s=0.0)
        for j in ids:
            rec = await _stored(db, j)
            assert rec.crashes == 0 and not rec.in_stage and not rec.state.terminal
    again = ScriptedHandler()
    for j in ids:
        again.open(j, "run")
    async with running_scheduler(db, handler=again, max_attempts=2) as (sched, _):
        sub = await sched.attach("c")
        done = await collect_finished(sub, ids)
        assert {f.state for f in done.values()} == {JobState.SUCCEEDED}
        assert (await sched.store.get("g0")).attempts == 6  # started once per run


async def _stored(db: Path, job_id: str):
    store = JobStore(db)
    await store.open()
    try:
        rec = await store.get(job_id)
        assert rec is not None
        return rec
    finally:
        await store.close()


if __name__ == "__main__":
    asyncio.run(_child(sys.argv[1]))
