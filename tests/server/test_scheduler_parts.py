"""The scheduler's parts on their own: the job registry's accounting, and a stage pipeline that
runs jobs with nothing but its collaborators (no Scheduler around it)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from rollout.runtime.handler import HandlerRegistry
from rollout.runtime.types import JobState, Stage
from rollout.server.cluster.node import LocalNode, NodeSet
from rollout.server.metrics import SchedulerMetrics
from rollout.server.pipeline.delivery import Delivery
from rollout.server.pipeline.job_registry import JobRegistry
from rollout.server.pipeline.runner import PipelineConfig, StageRunner
from rollout.server.pipeline.stage_pool import LiveJob
from rollout.server.pipeline.subscription import JobFinished, StageProgress, TrajectoryReady
from rollout.server.scheduler import Scheduler
from rollout.server.store import JobStore, now
from tests.server.handlers import ScriptedHandler, spec


def _live(job_id: str, client: str, group: str = "") -> LiveJob:
    from rollout.runtime.types import GroupSpec

    s = spec(job_id, group=GroupSpec(group, finish_after=0) if group else None)
    return LiveJob(spec=s, client_id=client, seq=0, created_at=0.0)


def test_registry_counts_follow_reservations_adoptions_and_retirements() -> None:
    reg = JobRegistry()
    reg.reserve("a", 3)                        # a submit of 3 jobs by a, commit in flight
    assert (reg.pending, reg.in_flight("a")) == (3, 3)
    a1, a2 = _live("a1", "a"), _live("a2", "a")
    reg.adopt(a1, 0, counted=True)
    reg.adopt(a2, 0, counted=True)
    reg.unreserve("a", 1)                      # the third was a duplicate
    assert (reg.pending, reg.in_flight("a"), len(reg)) == (2, 2, 2)
    b1 = _live("b1", "b", group="g")
    reg.adopt(b1, 0)                           # recovered at start: not reserved before
    assert (reg.pending, reg.in_flight("b")) == (3, 1)
    assert reg.groups.has_live("g")
    a1.state = JobState.RUNNING
    a2.finishing = True                        # its end is being written: counted once, later
    assert reg.by_state() == {JobState.RUNNING: 1, JobState.QUEUED: 1}
    reg.retire(a2, JobState.SUCCEEDED)
    reg.retire(b1, JobState.FAILED)
    assert (reg.pending, reg.in_flight("a"), reg.in_flight("b")) == (1, 1, 0)
    assert "a2" not in reg and "a1" in reg
    assert reg.by_state() == {JobState.RUNNING: 1, JobState.SUCCEEDED: 1, JobState.FAILED: 1}
    # Groups drop a job when its end is *decided* (the pipeline calls groups.job_ended then,
    # to cancel its redundant siblings at once), not when the end is durable.
    assert reg.groups.has_live("g")
    reg.begin_commit(["x", "x"])               # two submits of one id in flight
    reg.end_commit(["x"])
    assert reg.committing("x")
    reg.end_commit(["x"])
    assert not reg.committing("x")


async def test_the_stage_pipeline_runs_jobs_with_only_its_collaborators(tmp_path: Path) -> None:
    handler = ScriptedHandler()
    handlers = HandlerRegistry()
    handlers.register("scripted", handler)
    store = JobStore(tmp_path / "jobs.sqlite3")
    await store.open()
    try:
        jobs, delivery = JobRegistry(), Delivery(store, replay_page=8)
        resources = SimpleNamespace(registry=handlers, llm=None, sandbox_factory=None)
        metrics = SchedulerMetrics(lambda: None)  # type: ignore[arg-type,return-value]
        runner = StageRunner(store, jobs, delivery, metrics,
                             NodeSet.single(LocalNode(resources)), PipelineConfig())
        sub = await delivery.attach("c")
        specs = [spec("ok", reward=0.5), spec("bad", fail="run")]
        seqs = await store.insert_jobs([(s, "c") for s in specs], now())
        for s, seq in zip(specs, seqs, strict=True):
            assert seq is not None
            job = LiveJob(spec=s, client_id="c", seq=seq, created_at=now())
            jobs.adopt(job, 0)
            runner.queue(job)
        events: list[object] = []
        async with asyncio.timeout(20):
            async for ev in sub:
                events.append(ev)
                if sum(isinstance(e, JobFinished) for e in events) == 2:
                    break
        finished = {e.job_id: e for e in events if isinstance(e, JobFinished)}
        assert finished["ok"].state is JobState.SUCCEEDED and finished["ok"].reward == 0.5
        assert finished["bad"].state is JobState.FAILED
        assert finished["bad"].error is not None
        assert finished["bad"].error.reason == "SCRIPTED_FAILURE"
        # Each delivery is announced right before its JobFinished, under the id the store gave.
        for job_id, fin in finished.items():
            ready = events[events.index(fin) - 1]
            assert isinstance(ready, TrajectoryReady) and ready.job_id == job_id
            assert ready.delivery_id == fin.delivery_id
        assert sorted(d.delivery_id for d in await store.unacked("c")) == [1, 2]
        started = [(e.job_id, e.stage) for e in events
                   if isinstance(e, StageProgress) and e.event == "started"]
        assert [s for j, s in started if j == "ok"] == [Stage.INIT, Stage.RUN, Stage.EVAL]
        assert [s for j, s in started if j == "bad"] == [Stage.INIT, Stage.RUN]
        # The pipeline retired both jobs in the registry once their ends were durable.
        assert len(jobs) == 0 and jobs.pending == 0
        assert jobs.finished == {JobState.SUCCEEDED: 1, JobState.FAILED: 1}
        assert (await store.get("ok")).state is JobState.SUCCEEDED  # type: ignore[union-attr]
        await runner.drain(0.0)
    finally:
        await store.close()


def test_the_scheduler_composes_its_parts_instead_of_inheriting_them() -> None:
    assert not issubclass(Scheduler, StageRunner)
    assert not hasattr(StageRunner, "status")  # the base once called a status() it lacked
