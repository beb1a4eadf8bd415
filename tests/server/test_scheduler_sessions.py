"""Sessions: durable replay of unacknowledged trajectories, acks, flow control, status/metrics."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from rollout.runtime.types import JobState
from rollout.server.pipeline.subscription import JobFinished, StageProgress, TrajectoryReady
from tests.server.handlers import collect_finished, running_scheduler, spec
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(30)


async def _all_done(sched, n: int) -> None:
    await assert_eventually(lambda: sched.status().pending == 0
                     and sum(sched.status().jobs_by_state.values()) >= n)


async def test_detached_client_gets_unacked_trajectories_on_attach(tmp_path):
    async with running_scheduler(tmp_path / "db") as (sched, _):
        await sched.submit([spec(f"j{i}") for i in range(3)], "t")
        await _all_done(sched, 3)
        sub = await sched.attach("t")
        got = sub.drain()
        ready = [e for e in got if isinstance(e, TrajectoryReady)]
        assert [e.delivery_id for e in ready] == [1, 2, 3]
        assert all(e.replayed for e in ready)
        assert not any(isinstance(e, StageProgress) for e in got), "progress is ephemeral"
        assert [type(e) for e in got] == [TrajectoryReady, JobFinished] * 3
        await sched.ack("t", [1, 2])

        sub = await sched.attach("t")  # re-attach: only what is still unacked
        assert [e.delivery_id for e in sub.drain() if isinstance(e, TrajectoryReady)] == [3]
        sub = await sched.attach("t", acked_through=3)
        assert sub.drain() == []
        await sched.submit([spec("new")], "t")
        fin = await collect_finished(sub, ["new"])
        assert fin["new"].delivery_id == 4


async def test_second_attach_closes_the_first(tmp_path):
    async with running_scheduler(tmp_path / "db") as (sched, _):
        first = await sched.attach("t")
        second = await sched.attach("t")
        assert first.closed and not second.closed
        with pytest.raises(StopAsyncIteration):
            await first.__anext__()
        assert sched.status().sessions == 1
        await second.close()
        assert sched.status().sessions == 0


async def test_replay_and_live_deliveries_never_duplicate(tmp_path):
    n = 150
    async with running_scheduler(tmp_path / "db") as (sched, _):
        await sched.submit([spec(f"j{i}") for i in range(n)], "t")
        await assert_eventually(lambda: sched.status().pending < n - 10)
        sub = await sched.attach("t")  # attach while jobs are still finishing
        ids: list[int] = []
        async with asyncio.timeout(20):
            async for ev in sub:
                if isinstance(ev, TrajectoryReady):
                    ids.append(ev.delivery_id)
                    if len(ids) == n:
                        break
        assert sorted(ids) == list(range(1, n + 1))
        assert ids == sorted(ids), "deliveries arrive in delivery_id order"


async def test_max_unacked_holds_trajectories_until_acks(tmp_path):
    async with running_scheduler(tmp_path / "db") as (sched, _):
        sub = await sched.attach("t", max_unacked=2)
        await sched.submit([spec(f"j{i}") for i in range(4)], "t")
        await _all_done(sched, 4)
        ready = [e for e in sub.drain() if isinstance(e, TrajectoryReady)]
        assert [e.delivery_id for e in ready] == [1, 2] and sub.outstanding == 2
        await sched.ack("t", [1])
        assert [e.delivery_id for e in sub.drain() if isinstance(e, TrajectoryReady)] == [3]
        await sched.ack("t", through=3)
        assert [e.delivery_id for e in sub.drain() if isinstance(e, TrajectoryReady)] == [4]


async def test_held_back_deliveries_wait_in_memory_while_the_budget_allows(tmp_path):
    """Flow control holds deliveries in memory (not read back from the store) while the memory
    budget has room, and releases them in id order as acks come; once the budget is full,
    later ones wait in the store and still come in order after the held ones."""
    for budget, reads_wanted in ((1 << 30, False), (1, True)):
        async with running_scheduler(tmp_path / f"db{budget}", delivery_memory_bytes=budget,
                                     session_memory_bytes=budget) as (sched, _):
            reads: list[int] = []
            real = sched.store.unacked

            async def spy(client_id, *, after=0, limit=-1, real=real, reads=reads):
                got = await real(client_id, after=after, limit=limit)
                reads.extend(d.delivery_id for d in got)
                return got

            sched.store.unacked = spy  # type: ignore[method-assign]
            sub = await sched.attach("t", max_unacked=2)
            await sched.submit([spec(f"j{i}") for i in range(6)], "t")
            await _all_done(sched, 6)
            seen = []
            while len(seen) < 6:
                ev = await asyncio.wait_for(sub.__anext__(), 5)
                if isinstance(ev, TrajectoryReady):
                    seen.append(ev.delivery_id)
                    sub.sent(ev.delivery_id)  # what the servicer does once it is written
                    await sched.ack("t", [ev.delivery_id])
            assert seen == [1, 2, 3, 4, 5, 6]
            assert bool(reads) == reads_wanted, reads


async def test_status_and_prometheus_metrics(tmp_path):
    async with running_scheduler(tmp_path / "db", init_workers=2) as (sched, handler):
        await sched.submit([spec(f"j{i}") for i in range(5)] + [spec("f", fail="run")], "t")
        await _all_done(sched, 6)
        st = sched.status()
        init, run, ev = st.stages
        assert (init.completed, run.completed, run.failed, ev.completed) == (6, 5, 1, 5)
        assert init.workers == 2 and init.throughput_per_s > 0 and run.latency_p95_s >= 0
        assert st.jobs_by_state == {JobState.SUCCEEDED: 5, JobState.FAILED: 1}
        await sched.submit([spec("held", gate=["init"])], "t")
        await assert_eventually(lambda: handler.started("held", "init"))
        text = generate_latest(sched.metrics_registry).decode()
        assert 'rollout_stage_in_flight{stage="init"} 1.0' in text
        assert 'rollout_stage_duration_seconds_count{outcome="ok",stage="eval"} 5.0' in text
        assert 'rollout_jobs_finished_total{code="HANDLER_ERROR",state="failed"} 1.0' in text
        assert "rollout_pending_jobs 1.0" in text
        handler.open("held", "init")


async def test_list_pages_with_live_state(tmp_path):
    async with running_scheduler(tmp_path / "db") as (sched, handler):
        await sched.submit([spec(f"j{i}") for i in range(5)] + [spec("g", gate=["run"])], "t")
        await assert_eventually(lambda: handler.started("g", "run"))
        await sched.store.flush()
        page, token = await sched.list(page_size=4)
        rest, end = await sched.list(page_size=4, page_token=token)
        assert [r.job_id for r in page + rest] == ["j0", "j1", "j2", "j3", "j4", "g"]
        assert end == ""
        running, _ = await sched.list(state=JobState.RUNNING)
        assert [r.job_id for r in running] == ["g"]
        live = next(r for r in rest if r.job_id == "g")
        assert live.state is JobState.RUNNING and live.stage is not None
        handler.open("g", "run")


async def test_metrics_are_served_over_http(tmp_path):
    import urllib.request

    async with running_scheduler(tmp_path / "db") as (sched, _):
        await sched.submit([spec("m")], "t")
        await _all_done(sched, 1)
        httpd, thread = sched.serve_metrics("127.0.0.1", 0)
        try:
            url = f"http://127.0.0.1:{httpd.server_port}/metrics"
            body = await asyncio.to_thread(
                lambda: urllib.request.urlopen(url, timeout=5).read().decode())
            assert 'rollout_stage_queue_depth{stage="run"} 0.0' in body
            assert 'rollout_jobs_finished_total{code="",state="succeeded"} 1.0' in body
        finally:
            httpd.shutdown()
            thread.join(5)
