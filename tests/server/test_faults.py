"""Fault injection on the durability paths: nothing lost, nothing announced before it is durable,
no delivery id ever re-issued.

Faults are real ones where we can make them real: the store's writes fail through a SQLite
trigger (a genuine SQLite error raised half-way through the finish transaction), the writer
thread dies from an exception outside any op, the caller of a submit is cancelled while its
commit is in the writer. The full filesystem and SIGKILL during finish run in child processes
(tests/server/test_faults_fs.py, test_faults_kill.py).
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections import Counter

import grpc
import pytest

from rollout.runtime.types import JobState
from rollout.server.pipeline.subscription import JobFinished, TrajectoryReady
from rollout.server.store import JobStore, StoreWriteFailed, now
from rollout.v1 import rollout_service_pb2 as pb
from rollout.v1 import rollout_service_pb2_grpc as pb_grpc
from tests.client.conftest import ServerHarness
from tests.server.handlers import collect_finished, running_scheduler, spec
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(60)

FAULT_DDL = (
    "CREATE TABLE fault (armed INTEGER NOT NULL)",
    "INSERT INTO fault VALUES (1)",
    "CREATE TRIGGER fail_deliveries BEFORE INSERT ON deliveries WHEN (SELECT armed FROM fault)"
    " BEGIN SELECT RAISE(ABORT, 'injected write failure'); END",
)


async def _exec(store: JobStore, *statements: str) -> None:
    """Run statements through the store's own writer (executescript would commit its batch)."""
    def op(c: sqlite3.Connection) -> None:
        for sql in statements:
            c.execute(sql)

    fut = store._write(op, True)
    assert fut is not None
    await fut


def _hold_writer(store: JobStore) -> threading.Event:
    """Block the writer thread on an op until the returned event is set, so that everything
    queued meanwhile lands in one batch (or waits in the queue)."""
    release = threading.Event()
    store._write(lambda c: release.wait(10), wait=False)
    return release


async def _read_sql(store: JobStore, sql: str, *args: object) -> list[tuple]:
    return await store._read(lambda c: c.execute(sql, args).fetchall())


async def test_failed_finish_is_never_announced_and_is_retried_until_durable(tmp_path):
    """The repro of the issue: finishes whose transaction fails used to be announced (and
    acked by the client), then re-run after a restart under re-issued delivery ids."""
    db = tmp_path / "jobs.db"
    ids = [f"j{i}" for i in range(10)]
    async with running_scheduler(db, finish_retry_s=(0.01, 0.05)) as (sched, handler):
        await _exec(sched.store, *FAULT_DDL)
        sub = await sched.attach("t")
        await sched.submit([spec(j) for j in ids], "t")
        await assert_eventually(lambda: sched.finish_failures >= 2 * len(ids))
        heard = [e for e in sub.drain() if isinstance(e, (TrajectoryReady, JobFinished))]
        assert heard == [], "a finish that did not commit was announced"
        assert sched.status().pending == len(ids), "jobs whose end is not durable stay live"
        # The finish op's first statements (state, trajectory, transition, id counter) ran
        # before the trigger fired: its savepoint took them all back.
        rows = await _read_sql(sched.store, "SELECT state, trajectory IS NULL FROM jobs")
        assert {tuple(r) for r in rows} == {("running", 1)}
        assert await _read_sql(sched.store, "SELECT * FROM delivery_marks") == []
        assert await sched.store.next_delivery_id("t") == 1, "a failed finish used up an id"

        await _exec(sched.store, "UPDATE fault SET armed=0")
        done = await collect_finished(sub, ids)
        assert {f.state for f in done.values()} == {JobState.SUCCEEDED}
        assert sorted(f.delivery_id for f in done.values()) == list(range(1, len(ids) + 1))
        started = Counter(j for j, s, e in handler.events if s == "init" and e == "start")
        assert started == Counter({j: 1 for j in ids}), "a retried finish re-ran its job"

    async with running_scheduler(db) as (sched, handler):
        sub = await sched.attach("t")
        again = await collect_finished(sub, ids)
        assert {j: f.delivery_id for j, f in again.items()} == {
            j: f.delivery_id for j, f in done.items()}, "replay must keep each job's id"
        assert not handler.events, "finished jobs must not run again after a restart"


async def test_each_op_of_a_batch_commits_or_rolls_back_alone(tmp_path):
    store = JobStore(tmp_path / "s.db")
    await store.open()
    try:
        await store.insert_jobs([(spec("a"), "c"), (spec("b"), "c")], 1.0)

        def half_then_raise(c: sqlite3.Connection) -> None:
            c.execute("UPDATE jobs SET priority=7 WHERE job_id='b'")
            raise RuntimeError("op failed half-way")

        release = _hold_writer(store)
        before = store.write_stats[0]
        futs = [store._write(lambda c: c.execute("UPDATE jobs SET priority=5 WHERE job_id='a'"),
                             True),
                store._write(half_then_raise, True),
                store._write(lambda c: c.execute("UPDATE jobs SET reward=2 WHERE job_id='a'"),
                             True)]
        release.set()
        results = await asyncio.gather(*futs, return_exceptions=True)  # type: ignore[arg-type]
        assert isinstance(results[1], RuntimeError)
        assert not isinstance(results[0], BaseException)
        assert not isinstance(results[2], BaseException)
        # With the holder's batch (it may have taken the three along): one transaction for them.
        assert store.write_stats[0] - before in (1, 2), "the three ops shared one transaction"
        a, b = await store.get("a"), await store.get("b")
        assert a is not None and b is not None
        assert (a.priority, a.reward) == (5, 2.0)
        assert b.priority == 0, "the failed op's partial write was committed"
    finally:
        await store.close()


class _Die(BaseException):
    """Not an Exception: escapes the per-op handler and kills the writer thread."""


async def test_dead_writer_fails_every_waiter_at_once(tmp_path):
    store = JobStore(tmp_path / "s.db")
    await store.open()
    try:
        release = _hold_writer(store)
        queued = [store._write(lambda c: c.execute(
            "INSERT INTO closed_groups VALUES ('g', 'x', 1)"), True)]

        def die(c: sqlite3.Connection) -> None:
            raise _Die()

        queued.append(store._write(die, True))
        queued += [store.insert_jobs([(spec(f"q{i}"), "c")], 1.0) for i in range(3)]
        release.set()
        async with asyncio.timeout(5):  # nobody waits forever on a thread that is gone
            results = await asyncio.gather(*queued, return_exceptions=True)  # type: ignore
        assert all(isinstance(r, StoreWriteFailed) for r in results), results
        assert all(r.reason == "STORE_WRITE_FAILED" for r in results)  # type: ignore[union-attr]
        with pytest.raises(StoreWriteFailed):  # and every later write fails at once
            await store.insert_jobs([(spec("late"), "c")], 1.0)
        assert await store.closed_groups() == {}, "an op of the dead batch was committed"
        assert await store.get("q0") is None
    finally:
        await store.close()


async def test_submit_cancelled_mid_commit_still_runs_its_jobs(tmp_path):
    """A stream cancelled while its batch is in the writer used to leave the jobs stored QUEUED,
    never scheduled, and every re-submit answered 'duplicate'."""
    ids = [f"c{i}" for i in range(30)]
    async with running_scheduler(tmp_path / "db") as (sched, _):
        sub = await sched.attach("t")
        release = _hold_writer(sched.store)
        caller = asyncio.create_task(sched.submit([spec(j) for j in ids], "t"))
        await asyncio.sleep(0.05)  # the insert is queued behind the held writer
        caller.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await caller
        done = await collect_finished(sub, ids)
        assert {f.state for f in done.values()} == {JobState.SUCCEEDED}
        again = await sched.submit([spec(ids[0])], "t")
        assert again[0].duplicate


async def test_job_stored_but_not_live_is_adopted_on_duplicate_submit(tmp_path):
    async with running_scheduler(tmp_path / "db") as (sched, handler):
        sub = await sched.attach("t")
        # What a lost adoption leaves behind: a QUEUED row no pool knows about.
        await sched.store.insert_jobs([(spec("orphan"), "t")], now())
        (res,) = await sched.submit([spec("orphan")], "t")
        assert res.duplicate
        done = await collect_finished(sub, ["orphan"])
        assert done["orphan"].state is JobState.SUCCEEDED
        assert handler.started("orphan", "init")


async def test_failed_submit_commit_is_rejected_and_nothing_runs(tmp_path):
    async with running_scheduler(tmp_path / "db") as (sched, handler):
        await _exec(sched.store, "CREATE TRIGGER fail_jobs BEFORE INSERT ON jobs"
                    " BEGIN SELECT RAISE(ABORT, 'injected insert failure'); END")
        with pytest.raises(StoreWriteFailed):
            await sched.submit([spec("x"), spec("y")], "t")
        assert sched.status().pending == 0 and sched.client_stats("t")["in_flight"] == 0
        await _exec(sched.store, "DROP TRIGGER fail_jobs")
        assert not handler.events, "a job whose commit failed ran"
        sub = await sched.attach("t")
        results = await sched.submit([spec("x"), spec("y")], "t")
        assert not any(r.duplicate for r in results), "the failed commit left rows behind"
        done = await collect_finished(sub, ["x", "y"])
        assert {f.state for f in done.values()} == {JobState.SUCCEEDED}


async def test_replay_is_paged_and_bounded_by_max_unacked(tmp_path):
    """A long outage leaves a backlog; attach reads it a page at a time and never holds more
    than max_unacked deliveries in memory, while live deliveries join in id order."""
    n, window, page = 300, 20, 8
    db = tmp_path / "db"
    async with running_scheduler(db) as (sched, _):
        await sched.submit([spec(f"b{i}") for i in range(n)], "t")
        await assert_eventually(lambda: sched.status().pending == 0, timeout=30)
    async with running_scheduler(db, replay_page=page) as (sched, _):
        limits: list[int] = []
        real = sched.store.unacked

        async def spy(client_id, *, after=0, limit=-1):
            limits.append(limit)
            return await real(client_id, after=after, limit=limit)

        sched.store.unacked = spy  # type: ignore[method-assign]
        sub = await sched.attach("t", max_unacked=window, progress=False)
        assert sub.replaying == n
        await sched.submit([spec(f"live{i}") for i in range(20)], "t")
        seen: list[int] = []
        most = 0
        async with asyncio.timeout(30):
            async for ev in sub:
                assert sub.outstanding <= window
                most = max(most, sub.in_memory)
                if isinstance(ev, TrajectoryReady):
                    seen.append(ev.delivery_id)
                    assert ev.replayed == (ev.delivery_id <= n)
                    await sched.ack("t", [ev.delivery_id])
                if len(seen) == n + 20:
                    break
        assert seen == list(range(1, n + 21)), "each delivery once, in id order"
        assert limits and max(limits) <= page
        # Two events per delivery (trajectory, finished) plus the 20 JobAccepted events.
        assert most <= 2 * window + 20


async def test_stream_cancelled_right_after_submit_leaves_no_stuck_job(tmp_path):
    """Through gRPC: clients that send a batch and cut the connection at once. Every job that
    was accepted into the store runs; a later session gets each delivery exactly once."""
    h = ServerHarness(tmp_path / "state")
    await h.start()
    try:
        async with grpc.aio.insecure_channel(h.address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            for round_ in range(10):
                jobs = [pb.SubmitJobs(jobs=[_job(f"r{round_}-{i}") for i in range(30)])]
                call = stub.StreamRollouts(iter(
                    [pb.StreamRolloutsRequest(open=pb.OpenSession(client_id="cutter")),
                     pb.StreamRolloutsRequest(submit=jobs[0])]))
                await call.read()  # opened
                await asyncio.sleep(0.002 * round_)  # cut at different points of the commit
                call.cancel()
        sched = h.server.scheduler  # type: ignore[union-attr]
        await assert_eventually(lambda: sched.status().pending == 0, timeout=30)
        stored = await sched.store.list_jobs(after_seq=0, limit=10_000)
        assert stored and all(r.state.terminal for r in stored), "a stored job never ran"
        sub = await sched.attach("cutter")
        done = await collect_finished(sub, [r.job_id for r in stored])
        assert len({f.delivery_id for f in done.values()}) == len(stored)
    finally:
        await h.stop()


def _job(job_id: str):
    from google.protobuf import struct_pb2

    from rollout.v1 import job_pb2

    s = struct_pb2.Struct()
    s.update({"reward": 1.0})
    return job_pb2.JobSpec(job_id=job_id, environment="scripted", task=s)
