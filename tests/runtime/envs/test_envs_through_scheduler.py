"""The shipped environments inside the real three-stage scheduler (store, pools, cleanup),
driven by the scripted policy: what a trainer sees for a right and a wrong rollout of each."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.code.handler import CodeHandler
from rollout.runtime.envs.math.handler import MathHandler
from rollout.runtime.envs.swe.handler import SweHandler
from rollout.runtime.handler import HandlerRegistry
from rollout.runtime.tasksets.shipped import load_tasks
from rollout.runtime.types import JobSpec, JobState, Limits, SamplingParams
from rollout.server.llm.scripted import ScriptedEngine
from rollout.server.pipeline.subscription import JobFinished, TrajectoryReady
from rollout.server.scheduler import PipelineConfig, Scheduler
from rollout.server.store import JobStore
from tests.runtime.doubles import EngineClient
from tests.runtime.envs.conftest import call

pytestmark = pytest.mark.timeout(90)

SUBMIT_DONE = call("submit", answer="done")


def jobs() -> tuple[list[JobSpec], dict[str, list[str]], dict[str, float]]:
    math, code, swe = load_tasks("math")[1], load_tasks("code")[2], load_tasks("swe")[3]
    write = call("editor", command="create", path="/workspace/solution.py",
                 file_text=code["solution"])
    fix = call("bash", command=f"git apply <<'EOF'\n{swe['patch']}EOF\n")
    plan = {  # job id -> (environment, task, script, expected reward)
        "math-wrong": ("math", math, [call("submit", answer="0.91")], 0.0),
        "math-exact": ("math", math, [call("submit", answer="11/12")], 1.0),
        "code-right": ("code", code, [write, SUBMIT_DONE], 1.0),
        "code-noop": ("code", code, [SUBMIT_DONE], 0.0),
        "swe-right": ("swe", swe, [fix, SUBMIT_DONE], 1.0),
        "swe-noop": ("swe", swe, [SUBMIT_DONE], 0.0),
    }
    specs = [JobSpec(job_id=jid, environment=env, task=task,
                     sampling=SamplingParams(max_tokens_per_turn=4096, total_token_budget=32768),
                     limits=Limits(max_turns=len(script)))
             for jid, (env, task, script, _) in plan.items()]
    return (specs, {jid: p[2] for jid, p in plan.items()},
            {jid: p[3] for jid, p in plan.items()})


async def test_rewards_reach_the_trainer(tmp_path: Path, tok: Any, sandbox_factory: Any) -> None:
    specs, scripts, expected = jobs()
    registry = HandlerRegistry()
    for handler in (MathHandler, CodeHandler, SweHandler):
        registry.register(handler.name, handler)
    store = JobStore(tmp_path / "jobs.sqlite3")
    await store.open()
    sched = Scheduler(store, registry, llm=EngineClient(ScriptedEngine(tok, scripts)),
                      sandbox_factory=sandbox_factory,
                      config=PipelineConfig(cleanup_deadline_s=10.0))
    await sched.start()
    try:
        sub = await sched.attach("trainer")
        results = await sched.submit(specs, "trainer")
        assert all(r.accepted for r in results)
        rewards: dict[str, float] = {}
        finished: dict[str, JobFinished] = {}
        async with asyncio.timeout(60):
            async for event in sub:
                if isinstance(event, TrajectoryReady):
                    rewards[event.trajectory.job_id] = event.trajectory.reward
                    assert event.trajectory.turns, event.trajectory.job_id
                elif isinstance(event, JobFinished):
                    finished[event.job_id] = event
                    if len(finished) == len(specs):
                        break
        assert {j: f.state for j, f in finished.items()} == dict.fromkeys(expected,
                                                                          JobState.SUCCEEDED), {
            j: f.error for j, f in finished.items()}
        assert rewards == expected
        # every job's sandbox is gone once its job finished
        assert list(sandbox_factory.args[0].sandboxes_dir.glob("*/workspace")) == []
    finally:
        await sched.stop(grace_s=0.0)
        await store.close()
