"""The SQLite job store: idempotent inserts, deliveries until acked, group commit, reopen."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from rollout.runtime.types import (
    GroupSpec,
    JobError,
    JobSpec,
    JobState,
    Stage,
    StageTimings,
    TerminationReason,
    Trajectory,
    Turn,
)
from rollout.server.store import FinishRecord, JobStore

pytestmark = pytest.mark.timeout(30)


def _spec(i: int, group: str = "") -> JobSpec:
    return JobSpec(job_id=f"j{i}", environment="scripted", task={"n": i, "name": "x"},
                   priority=i % 3, group=GroupSpec(group, 4, 2) if group else None)


def _traj(job_id: str) -> Trajectory:
    return Trajectory(job_id=job_id, turns=[Turn([1, 2], [3, 4], [-0.5, -0.25], [5])],
                      reward=1.0, termination=TerminationReason.SUBMITTED)


async def test_duplicate_ids_insert_once_even_concurrently(tmp_path):
    store = JobStore(tmp_path / "s.db")
    await store.open()
    try:
        a, b = await asyncio.gather(
            store.insert_jobs([(_spec(1), "c"), (_spec(2), "c")], 1.0),
            store.insert_jobs([(_spec(2), "c"), (_spec(1), "c"), (_spec(3), "c")], 1.0))
        inserted = [x for x in a + b if x is not None]
        assert len(inserted) == 3 and len(set(inserted)) == 3
        assert [x is None for x in b] == [True, True, False]
        got = await store.get("j2")
        assert got is not None and got.spec == _spec(2) and got.state is JobState.QUEUED
    finally:
        await store.close()


async def test_finished_deliveries_survive_reopen_until_acked(tmp_path):
    path = tmp_path / "s.db"
    store = JobStore(path)
    await store.open()
    await store.insert_jobs([(_spec(i), "trainer") for i in range(4)], 1.0)
    for i in range(4):
        err = JobError("TIMEOUT", "RUN_TIMEOUT", "slow", Stage.RUN) if i == 3 else None
        state = JobState.FAILED if i == 3 else JobState.SUCCEEDED
        did = await store.finish(FinishRecord(
            f"j{i}", "trainer", state, Stage.EVAL, err, 1.0 if i < 3 else None,
            StageTimings(run_s=0.5), _traj(f"j{i}"), 2.0))
        assert did == i + 1  # assigned in the transaction, per client, in commit order
    await store.ack("trainer", [2])
    await store.close()

    store = JobStore(path)
    await store.open()
    try:
        pending = await store.unacked("trainer")
        assert [d.delivery_id for d in pending] == [1, 3, 4]
        assert pending[0].trajectory == _traj("j0")
        assert pending[2].job.error == JobError("TIMEOUT", "RUN_TIMEOUT", "slow", Stage.RUN)
        assert pending[0].job.timings.run_s == 0.5
        # Ids keep growing across restarts, so a client's acked_through stays meaningful.
        assert await store.next_delivery_id("trainer") == 5
        await store.ack("trainer", through=3)
        assert [d.delivery_id for d in await store.unacked("trainer")] == [4]
        assert await store.unacked("someone-else") == []
    finally:
        await store.close()


async def test_many_small_writes_share_transactions(tmp_path):
    store = JobStore(tmp_path / "s.db")
    await store.open()
    try:
        specs = [_spec(i) for i in range(500)]
        await asyncio.gather(*(store.insert_jobs([(s, "c")], 1.0) for s in specs))
        for s in specs:
            store.record_stage(s.job_id, Stage.INIT, 1, 2.0)
        await store.flush()
        txns, ops = store.write_stats
        assert ops >= 1001
        assert txns < ops / 5, "group commit should batch concurrent writes"
        rec = await store.get("j499")
        assert rec is not None and rec.state is JobState.RUNNING and rec.attempts == 1
        hist = await store.history("j499")
        assert [(h.state, h.stage) for h in hist] == [(JobState.QUEUED, None),
                                                      (JobState.RUNNING, Stage.INIT)]
    finally:
        await store.close()


async def test_an_op_that_raises_takes_back_only_its_own_writes(tmp_path):
    """Ops share transactions; one that raises half-way leaves nothing of itself, and every
    other op of its batch commits exactly once."""
    store = JobStore(tmp_path / "s.db")
    await store.open()
    try:
        await store._write(lambda c: c.execute("CREATE TABLE t (x INTEGER)"), True)

        def good(i: int):
            return lambda c: c.execute("INSERT INTO t VALUES (?)", (i,)).rowcount

        def bad(c: sqlite3.Connection) -> None:
            c.execute("INSERT INTO t VALUES (-1)")
            raise ValueError("half-way")

        for _ in range(8):  # several rounds: some land in one batch with the bad op
            futs = [store._write(good(i), True) for i in range(5)]
            futs.insert(2, store._write(bad, True))
            results = await asyncio.gather(*futs, return_exceptions=True)
            assert isinstance(results[2], ValueError)
            assert results[:2] + results[3:] == [1] * 5
        txns, ops = store.write_stats
        assert txns < ops, "some ops shared a transaction"
        rows = await store._read(lambda c: c.execute(
            "SELECT x, COUNT(*) FROM t GROUP BY x ORDER BY x").fetchall())
        assert rows == [(i, 8) for i in range(5)]
    finally:
        await store.close()


async def test_list_pages_in_submission_order_with_filters(tmp_path):
    store = JobStore(tmp_path / "s.db")
    await store.open()
    try:
        await store.insert_jobs([(_spec(i, "g" if i % 2 else ""), "c") for i in range(7)], 1.0)
        first = await store.list_jobs(after_seq=0, limit=3)
        second = await store.list_jobs(after_seq=first[-1].seq, limit=10)
        assert [j.job_id for j in first + second] == [f"j{i}" for i in range(7)]
        grouped = await store.list_jobs(after_seq=0, limit=10, group_id="g")
        assert [j.job_id for j in grouped] == ["j1", "j3", "j5"]
        assert len(await store.live_jobs()) == 7
    finally:
        await store.close()


async def test_database_is_wal_and_readable_by_plain_sqlite(tmp_path):
    path = tmp_path / "s.db"
    store = JobStore(path)
    await store.open()
    await store.insert_jobs([(_spec(1), "c")], 1.0)
    await store.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT job_id, state FROM jobs").fetchall() == [("j1", "queued")]
    conn.close()


async def test_commits_are_synchronous_full_by_default_and_configurable(tmp_path):
    for setting, expected in ((None, 2), ("NORMAL", 1)):  # PRAGMA synchronous: FULL=2, NORMAL=1
        store = (JobStore(tmp_path / f"{setting}.db") if setting is None
                 else JobStore(tmp_path / f"{setting}.db", synchronous=setting))
        await store.open()
        try:
            fut = store._write(lambda c: c.execute("PRAGMA synchronous").fetchone()[0], True)
            assert fut is not None and await fut == expected
        finally:
            await store.close()
    with pytest.raises(ValueError, match="synchronous"):
        await JobStore(tmp_path / "x.db", synchronous="OFF").open()


async def test_retention_forgets_finished_submitrollout_channels_not_trainer_ids(tmp_path):
    """SubmitRollout gives every job its own delivery channel (rpc:...); its id counter must
    not outlive the job. A trainer's counter must: its acked_through would cover reused ids."""
    store = JobStore(tmp_path / "s.db")
    await store.open()
    try:
        await store.insert_jobs([(_spec(1), "rpc:j1"), (_spec(2), "trainer")], 1.0)
        for i, client in ((1, "rpc:j1"), (2, "trainer")):
            await store.finish(FinishRecord(f"j{i}", client, JobState.SUCCEEDED, Stage.EVAL,
                                            None, 1.0, StageTimings(), _traj(f"j{i}"), 2.0))
            await store.ack(client, through=1)
        stats = await store.prune(acked_before=1e18, forget_before=1e18)
        assert (stats.trajectories, stats.jobs, stats.channels) == (2, 2, 1)
        assert await store.next_delivery_id("trainer") == 2
        assert await store.next_delivery_id("rpc:j1") == 1
        marks = await store._read(lambda c: c.execute(
            "SELECT client_id FROM delivery_marks").fetchall())
        assert marks == [("trainer",)]
    finally:
        await store.close()


async def test_submitrollout_deliveries_nobody_took_expire_trainer_ones_never(tmp_path):
    """A SubmitRollout caller that went away leaves its job's delivery unacknowledged; a retry
    is answered from the job row, so that delivery must not be kept forever. A trainer's
    unacknowledged delivery is kept however old it is."""
    store = JobStore(tmp_path / "s.db")
    await store.open()
    try:
        await store.insert_jobs([(_spec(1), "rpc:j1"), (_spec(2), "trainer"),
                                 (_spec(3), "rpc:j3")], 1.0)
        for i, client, at in ((1, "rpc:j1", 2.0), (2, "trainer", 2.0), (3, "rpc:j3", 50.0)):
            await store.finish(FinishRecord(f"j{i}", client, JobState.SUCCEEDED, Stage.EVAL,
                                            None, 1.0, StageTimings(), _traj(f"j{i}"), at))
        stats = await store.prune(acked_before=10.0)  # j1 ended before the window, j3 after
        assert stats.trajectories == 1
        assert await store.get_trajectory("j1") is None
        assert await store.get_trajectory("j2") is not None
        assert await store.get_trajectory("j3") is not None
        assert [d.job.job_id for d in await store.unacked("trainer")] == ["j2"]
    finally:
        await store.close()
