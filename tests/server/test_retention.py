"""Retention: acknowledged trajectories are pruned, unacknowledged ones never, the file stays
bounded under a submit -> ack -> prune loop, and restarts after pruning keep delivery ids."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from rollout.runtime.types import JobState, StageTimings
from rollout.server.api.proto_convert import trajectory_to_bytes
from rollout.server.pipeline.subscription import JobFinished
from rollout.server.store import FinishRecord, JobStore
from tests.server.handlers import collect_finished, running_scheduler, spec

pytestmark = pytest.mark.timeout(60)

TINY = 1e-3  # retention window: due almost at once, so tests poll instead of sleeping


async def _poll(pred, *, prune=None, timeout: float = 20.0) -> None:
    """Poll the async ``pred`` (running a prune pass first, when given) until it holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        if prune is not None:
            await prune()
        if await pred():
            return
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.002)


async def _forgotten(sched, ids) -> bool:
    return all([await sched.get(j) is None for j in ids])


async def _finish_all(sched, client: str, ids: list[str], **task) -> dict[str, JobFinished]:
    sub = await sched.attach(client)
    await sched.submit([spec(j, **task) for j in ids], client)
    done = await collect_finished(sub, ids)
    await sub.close()
    return done


async def test_acked_trajectory_pruned_job_state_kept_unacked_survives(tmp_path):
    async with running_scheduler(tmp_path / "j.db", retention_s=TINY, job_retention_s=0,
                                 prune_interval_s=0.01) as (sched, _):
        done = await _finish_all(sched, "t", ["a", "b"], reward=0.5)
        await sched.ack("t", [done["a"].delivery_id])
        assert (await sched.get_trajectory("b")) is not None

        async def gone() -> bool:
            return await sched.get_trajectory("a") is None

        await _poll(gone)  # the background pass (every 10 ms) prunes it
        rec = await sched.get("a", history=True)
        assert rec is not None and rec.state is JobState.SUCCEEDED and rec.reward == 0.5
        assert rec.history == ()  # transitions went with the trajectory
        for _ in range(20):
            await sched.prune()
        assert sched.retention.passes > 20
        assert (await sched.get_trajectory("b")) is not None
        # The unacked one is still replayed on attach; the pruned one is not.
        sub = await sched.attach("t")
        got = await collect_finished(sub, ["b"])
        assert got["b"].delivery_id == done["b"].delivery_id
        await sub.close()
        assert (await sched.store.unacked("t"))[0].job.job_id == "b"


async def test_unacked_never_pruned_even_with_tiny_windows(tmp_path):
    async with running_scheduler(tmp_path / "j.db", retention_s=TINY, job_retention_s=TINY,
                                 prune_interval_s=3600) as (sched, _):
        ids = [f"u{i}" for i in range(5)]
        await _finish_all(sched, "t", ids)
        for _ in range(50):
            stats = await sched.prune()
            assert stats.trajectories == 0 and stats.jobs == 0
        stored = await sched.store.unacked("t")
        assert sorted(d.job.job_id for d in stored) == ids
        assert all(d.trajectory is not None for d in stored)


async def test_restart_after_pruning_keeps_ids_and_replays_the_rest(tmp_path):
    db = tmp_path / "j.db"
    cfg = dict(retention_s=TINY, job_retention_s=TINY, prune_interval_s=3600)
    async with running_scheduler(db, **cfg) as (sched, _):
        done = await _finish_all(sched, "t", ["x", "y", "z"])
        top = max(f.delivery_id for f in done.values())
        await sched.ack("t", through=top)
        # Every delivery row of client "t" is gone once its jobs are forgotten.
        await _poll(lambda: _forgotten(sched, ("x", "y", "z")), prune=sched.prune)
    async with running_scheduler(db, **cfg) as (sched, _):
        sub = await sched.attach("t")
        await sched.submit([spec("w")], "t")
        got = await collect_finished(sub, ["w"])
        await sub.close()
        # Ids are never reused: a reused id would be covered by the client's acked_through.
        assert got["w"].delivery_id == top + 1
        assert await sched.get_trajectory("w") is not None


async def test_prune_works_in_bounded_batches_and_keeps_marks(tmp_path):
    store = JobStore(tmp_path / "s.db")
    await store.open()
    try:
        await store.insert_jobs([(spec(f"j{i}"), "c") for i in range(10)], 1.0)
        for i in range(10):
            await store.finish(FinishRecord(f"j{i}", "c", JobState.SUCCEEDED, None, None, 1.0,
                                            StageTimings(), None, 2.0))
        await store.ack("c", through=7)
        before = store.write_stats[0]
        stats = await store.prune(acked_before=1e18, batch=3)
        assert stats.trajectories == 7
        assert store.write_stats[0] - before >= 3  # 3+3+1: one transaction per batch
        assert [d.delivery_id for d in await store.unacked("c")] == [8, 9, 10]
    finally:
        await store.close()


async def test_old_schema_is_migrated(tmp_path):
    db = tmp_path / "old.db"
    conn = sqlite3.connect(db)
    conn.executescript("""
        CREATE TABLE deliveries (client_id TEXT NOT NULL, delivery_id INTEGER NOT NULL,
            job_id TEXT NOT NULL, acked INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (client_id, delivery_id)) WITHOUT ROWID;
        INSERT INTO deliveries VALUES ('c', 4, 'gone', 1);""")
    conn.close()
    store = JobStore(db)
    await store.open()
    try:
        assert await store.next_delivery_id("c") == 5
        assert (await store.prune(acked_before=1e18)).trajectories == 1
    finally:
        await store.close()
    store = JobStore(db)
    await store.open()
    try:
        assert await store.next_delivery_id("c") == 5  # the mark outlived the pruned row
    finally:
        await store.close()


@pytest.mark.timeout(120)
async def test_file_stops_growing_under_submit_ack_prune_cycles(tmp_path):
    db = tmp_path / "j.db"
    sizes: list[int] = []
    async with running_scheduler(db, retention_s=TINY, job_retention_s=TINY,
                                 prune_interval_s=3600) as (sched, _):
        blob = 0
        for cycle in range(6):
            ids = [f"c{cycle}-{i}" for i in range(20)]
            done = await _finish_all(sched, "t", ids, turns=1500)
            if cycle == 0:
                traj = await sched.get_trajectory(ids[0])
                blob = len(trajectory_to_bytes(traj)) * len(ids)
            await sched.ack("t", through=max(f.delivery_id for f in done.values()))
            await _poll(lambda ids=ids: _forgotten(sched, ids), prune=sched.prune)
            await sched.store.flush()
            # Fold the WAL into the main file so its size is the database's real footprint.
            with sqlite3.connect(db) as conn:
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            sizes.append(db.stat().st_size)
    print(f"db file bytes per cycle: {sizes}; trajectory bytes per cycle: {blob}")
    slack = 64 << 10
    assert blob > 4 * slack, "trajectories must be big enough for growth to show"
    assert sizes[4] <= sizes[1] + slack, sizes
    assert sizes[5] <= sizes[1] + slack, sizes
