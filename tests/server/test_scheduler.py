"""Scheduler behaviour: stage overlap, priorities, timeouts, failures, cancellation, validation.

Assertions are on event order (the scripted handler logs every stage start/end), never on
wall-clock speed.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from rollout.runtime.types import (
    GroupSpec,
    JobState,
    Limits,
    SamplingParams,
    Stage,
    TerminationReason,
)
from rollout.server.pipeline.subscription import (
    JobAccepted,
    JobFinished,
    StageProgress,
    TrajectoryReady,
)
from rollout.server.scheduler import JobNotFound, NotCancellable, Overloaded
from tests.server.handlers import collect_finished, running_scheduler, spec
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(30)


async def test_job_runs_through_all_stages_and_streams_events(tmp_path):
    async with running_scheduler(tmp_path / "db") as (sched, handler):
        sub = await sched.attach("trainer")
        res = await sched.submit([spec("a", turns=2, reward=0.75)], "trainer")
        assert res[0].accepted and not res[0].duplicate
        events = []
        async for ev in sub:
            events.append(ev)
            if isinstance(ev, JobFinished):
                break
        assert events[0] == JobAccepted("a")
        progress = [(e.stage, e.event) for e in events if isinstance(e, StageProgress)]
        assert progress == [(Stage.INIT, "started"), (Stage.INIT, "finished"),
                            (Stage.RUN, "started"), (Stage.RUN, "turn"), (Stage.RUN, "turn"),
                            (Stage.RUN, "finished"), (Stage.EVAL, "started"),
                            (Stage.EVAL, "finished")]
        ready = next(e for e in events if isinstance(e, TrajectoryReady))
        assert events[-2] is ready and ready.delivery_id == 1
        traj = ready.trajectory
        assert traj.reward == 0.75 and traj.reward_components == {"exact": 1.0}
        assert [t.output_ids for t in traj.turns] == [[3], [4]]
        assert traj.termination is TerminationReason.NO_TOOL_CALL
        assert traj.timings.run_s > 0 and traj.metadata["scripted"] == "yes"
        fin = events[-1]
        assert fin.state is JobState.SUCCEEDED and fin.error is None and fin.reward == 0.75
        assert ("a", "cleanup", "") in handler.events
        rec = await sched.get("a", history=True)
        assert rec is not None and rec.state is JobState.SUCCEEDED and rec.attempts == 1
        assert [(h.state, h.stage) for h in rec.history] == [
            (JobState.QUEUED, None), (JobState.RUNNING, Stage.INIT),
            (JobState.RUNNING, Stage.RUN), (JobState.RUNNING, Stage.EVAL),
            (JobState.SUCCEEDED, Stage.EVAL)]
        stored = await sched.get_trajectory("a")
        assert stored is not None and stored.reward == 0.75


async def test_slow_eval_does_not_stall_init_or_run_of_other_jobs(tmp_path):
    async with running_scheduler(tmp_path / "db", init_workers=1, run_workers=1,
                                 eval_workers=1) as (sched, handler):
        sub = await sched.attach("t")
        await sched.submit([spec("slow", gate=["eval"])], "t")
        await assert_eventually(lambda: handler.started("slow", "eval"))
        await sched.submit([spec(f"b{i}") for i in range(3)], "t")
        # While "slow" holds the only EVAL worker, the others still pass INIT and RUN.
        for i in range(3):
            await assert_eventually(lambda i=i: (f"b{i}", "run", "end") in handler.events)
        assert ("slow", "eval", "end") not in handler.events
        st = sched.status().stages
        assert st[2].in_flight == 1 and st[2].queue_depth >= 1
        handler.open("slow", "eval")
        done = await collect_finished(sub, ["slow", "b0", "b1", "b2"])
        assert all(f.state is JobState.SUCCEEDED for f in done.values())


async def test_stages_of_different_jobs_overlap(tmp_path):
    async with running_scheduler(tmp_path / "db") as (sched, handler):
        await sched.submit([spec("r", gate=["run"]), spec("e", gate=["eval"]),
                            spec("i", gate=["init"])], "t")
        for job, stage in (("r", "run"), ("e", "eval"), ("i", "init")):
            await assert_eventually(lambda j=job, s=stage: handler.started(j, s))
        assert [s.in_flight for s in sched.status().stages] == [1, 1, 1]
        for job, stage in (("r", "run"), ("e", "eval"), ("i", "init")):
            handler.open(job, stage)


async def test_priorities_higher_first_fifo_among_equals(tmp_path):
    async with running_scheduler(tmp_path / "db", init_workers=1) as (sched, handler):
        await sched.submit([spec("blocker", gate=["init"])], "t")
        await assert_eventually(lambda: handler.started("blocker", "init"))
        await sched.submit([spec("low1", priority=-1), spec("mid1"), spec("high", priority=5),
                            spec("mid2"), spec("low2", priority=-1)], "t")
        handler.open("blocker", "init")
        order = ["high", "mid1", "mid2", "low1", "low2"]
        await assert_eventually(lambda: all(handler.started(j, "init") for j in order))
        starts = [j for j, s, e in handler.events if s == "init" and e == "start"]
        assert starts == ["blocker", *order]


async def test_stage_timeout_counts_only_that_stage(tmp_path):
    limits = Limits(init_timeout_s=30, run_timeout_s=0.2, eval_timeout_s=30)
    async with running_scheduler(tmp_path / "db") as (sched, handler):
        sub = await sched.attach("t")
        await sched.submit([spec("t1", gate=["run"], limits=limits, spawn=True)], "t")
        fin = (await collect_finished(sub, ["t1"]))["t1"]
        assert fin.state is JobState.FAILED
        assert (fin.error.code, fin.error.reason, fin.error.stage) == (
            "TIMEOUT", "RUN_TIMEOUT", Stage.RUN)
        assert "t1" in handler.resources_closed
        traj = await sched.get_trajectory("t1")
        assert traj is not None and traj.termination is TerminationReason.DEADLINE


async def test_handler_failures_are_typed(tmp_path):
    async with running_scheduler(tmp_path / "db") as (sched, _):
        sub = await sched.attach("t")
        await sched.submit([spec("f", fail="init"), spec("c", crash="eval")], "t")
        done = await collect_finished(sub, ["f", "c"])
        assert (done["f"].error.code, done["f"].error.reason, done["f"].error.stage) == (
            "HANDLER_ERROR", "SCRIPTED_FAILURE", Stage.INIT)
        assert (done["c"].error.code, done["c"].error.reason) == (
            "HANDLER_ERROR", "ZERO_DIVISION_ERROR")
        traj = await sched.get_trajectory("c")
        assert traj is not None and traj.termination is TerminationReason.ERROR
        assert traj.reward == 0.0 and traj.turns  # RUN's turns are kept for accounting
        assert sched.status().stages[0].failed == 1


async def test_invalid_jobs_are_rejected_one_by_one(tmp_path):
    async with running_scheduler(tmp_path / "db") as (sched, _):
        bad_sampling = spec("s")
        bad_sampling = type(bad_sampling)(**{**bad_sampling.__dict__,
                                             "sampling": SamplingParams(top_p=0)})
        res = await sched.submit([spec("ok"), spec("u", env="nope"), spec("b", bad=True),
                                  bad_sampling, spec("l", limits=Limits(max_turns=0))], "t")
        assert [r.job_id for r in res] == ["ok", "u", "b", "s", "l"]
        assert res[0].accepted
        assert [r.error.reason for r in res[1:]] == [
            "UNKNOWN_ENVIRONMENT", "INVALID_TASK", "INVALID_SAMPLING_PARAMS", "INVALID_LIMITS"]
        assert await sched.get("u") is None


async def test_duplicate_submit_yields_one_job(tmp_path):
    async with running_scheduler(tmp_path / "db") as (sched, handler):
        sub = await sched.attach("t")
        r1 = await sched.submit([spec("d"), spec("d")], "t")
        assert [r.duplicate for r in r1] == [False, True]
        await collect_finished(sub, ["d"])
        r2 = await sched.submit([spec("d")], "t")
        assert r2[0].duplicate
        await sched.stop(0)
        assert [e for e in handler.events if e[1] == "init"].count(("d", "init", "start")) == 1
        assert [d.job.job_id for d in await sched.store.unacked("t")] == ["d"]


async def test_cancel_running_job_frees_its_resources(tmp_path):
    async with running_scheduler(tmp_path / "db") as (sched, handler):
        sub = await sched.attach("t")
        await sched.submit([spec("x", gate=["run"], spawn=True)], "t")
        await assert_eventually(lambda: handler.started("x", "run"))
        pid = handler.pids["x"]
        os.kill(pid, 0)  # the subprocess is alive while the job runs
        assert await sched.cancel("x") == ["x"]
        assert ("x", "run", "cancelled") in handler.events
        assert ("x", "cleanup", "") in handler.events and "x" in handler.resources_closed
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        fin = (await collect_finished(sub, ["x"]))["x"]
        assert fin.state is JobState.CANCELLED
        assert (fin.error.code, fin.error.reason) == ("CANCELLED", "CANCELLED_BY_CLIENT")
        with pytest.raises(NotCancellable):
            await sched.cancel("x")
        with pytest.raises(JobNotFound):
            await sched.cancel("missing")


async def test_cancel_job_waiting_between_stages_frees_its_resources(tmp_path):
    async with running_scheduler(tmp_path / "db", run_workers=1) as (sched, handler):
        await sched.submit([spec("hog", gate=["run"]), spec("w", spawn=True)], "t")
        await assert_eventually(lambda: handler.started("hog", "run")
                         and ("w", "init", "end") in handler.events)
        assert sched.status().stages[1].queue_depth == 1
        assert await sched.cancel("w") == ["w"]
        assert "w" in handler.resources_closed and ("w", "cleanup", "") in handler.events
        assert not handler.started("w", "run")
        assert sched.status().stages[1].queue_depth == 0
        handler.open("hog", "run")


async def test_full_downstream_queue_holds_upstream_back(tmp_path):
    async with running_scheduler(tmp_path / "db", init_workers=2, run_workers=1,
                                 stage_queue_size=1) as (sched, handler):
        await sched.submit([spec(f"j{i}", gate=["run"]) for i in range(6)], "t")
        await assert_eventually(lambda: handler.started("j0", "run"))
        # RUN holds j0, its queue holds one job, INIT's two workers each hold a finished job.
        await assert_eventually(lambda: [s.in_flight for s in sched.status().stages][:2] == [2, 1])
        st = sched.status().stages
        assert st[1].queue_depth == 1 and st[0].queue_depth == 2
        for i in range(6):
            handler.open(f"j{i}", "run")
        await assert_eventually(lambda: all((f"j{i}", "eval", "end") in handler.events
                                     for i in range(6)))


async def test_pending_cap_raises_overloaded(tmp_path):
    async with running_scheduler(tmp_path / "db", max_pending_jobs=3,
                                 max_in_flight_per_client=2) as (sched, _):
        await sched.submit([spec("a", gate=["init"]), spec("b", gate=["init"])], "c1")
        with pytest.raises(Overloaded) as client_cap:
            await sched.submit([spec("c")], "c1")
        assert client_cap.value.reason == "CLIENT_OVERLOADED"
        await sched.submit([spec("d", gate=["init"])], "c2")
        with pytest.raises(Overloaded):
            await sched.submit([spec("e")], "c3")
        assert sched.status().pending == 3
        await sched.cancel("a")
        assert (await sched.submit([spec("e")], "c3"))[0].accepted


async def test_llm_session_is_ended_for_every_job(tmp_path):
    class FakeLLM:
        tokenizer = None
        ended: list[str] = []

        async def generate(self, request):  # pragma: no cover - not used here
            raise AssertionError

        async def end_session(self, session_id: str) -> None:
            self.ended.append(session_id)

    async with running_scheduler(tmp_path / "db") as (sched, _):
        sched.llm = FakeLLM()
        sub = await sched.attach("t")
        await sched.submit([spec("ok"), spec("bad", fail="run")], "t")
        await collect_finished(sub, ["ok", "bad"])
        assert sorted(FakeLLM.ended) == ["bad", "ok"]


async def test_a_finishing_job_is_listed_with_its_reward_before_its_record_is_durable(tmp_path):
    """Between the terminal decision and the store's write, GetJob and ListJobs read the job
    from memory: it must not show SUCCEEDED with no reward (a trainer reading a group's
    rewards by ListJobs would take it for 0)."""
    async with running_scheduler(tmp_path / "db") as (sched, _):
        gate = asyncio.Event()
        real = sched.store.finish
        writes: list[asyncio.Future[None]] = []

        def held(rec, **kwargs):
            out = asyncio.get_running_loop().create_future()

            async def later():
                await gate.wait()
                try:
                    out.set_result(await real(rec, **kwargs))
                except Exception as exc:  # the runner sees the write's own failure
                    out.set_exception(exc)
            writes.append(asyncio.ensure_future(later()))
            return out

        sched.store.finish = held
        await sched.submit([spec("a", reward=0.75, group=GroupSpec("g"))], "trainer")

        async def listed():
            rows, _ = await sched.list(group_id="g")
            return rows and rows[0].state is JobState.SUCCEEDED

        await assert_eventually(listed)
        rows, _ = await sched.list(group_id="g")
        assert rows[0].reward == 0.75
        rec = await sched.get("a")
        assert rec is not None and rec.reward == 0.75
        gate.set()
        await assert_eventually(lambda: sched.jobs.get("a") is None)
        rows, _ = await sched.list(group_id="g")
        assert rows[0].state is JobState.SUCCEEDED and rows[0].reward == 0.75
