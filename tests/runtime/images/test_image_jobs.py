"""Jobs on image roots through the real three-stage scheduler (store, pools, cleanup), driven by
the scripted policy: the shipped code environment on a server whose sandboxes run on
``docker://python:3.11-slim`` (the loopback registry's mirror), and a job whose task names a
broken image, which FAILS in INIT naming the task and never gets a reward."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.code.handler import CodeHandler
from rollout.runtime.handler import AgentHandler, HandlerRegistry, JobContext, RunOutcome
from rollout.runtime.sandbox import SandboxConfig, create_sandbox
from rollout.runtime.sandbox.base import ImageSettings
from rollout.runtime.tasksets.shipped import load_tasks
from rollout.runtime.types import JobSpec, JobState, Limits, Reward, SamplingParams
from rollout.server.llm.scripted import ScriptedEngine
from rollout.server.pipeline.subscription import JobFinished, TrajectoryReady
from rollout.server.scheduler import PipelineConfig, Scheduler
from rollout.server.store import JobStore
from tests.fixtures.images import Registry
from tests.runtime.doubles import EngineClient, smollm2_tokenizer
from tests.runtime.envs.conftest import call

pytestmark = pytest.mark.timeout(300)


class ImageTaskHandler(AgentHandler):
    """TEST-ONLY: opens its sandbox on the task's own ``image`` and reports the release."""

    name = "image-task"

    async def init(self, ctx: JobContext) -> None:
        sb = await ctx.open_sandbox(image=ctx.spec.task["image"])
        ctx.state["sb"] = sb

    async def run(self, ctx: JobContext) -> RunOutcome:
        from rollout.runtime.types import TerminationReason
        return RunOutcome([], TerminationReason.SUBMITTED)

    async def eval(self, ctx: JobContext) -> Reward:
        r = await ctx.state["sb"].exec("cat /etc/debian_version")
        return Reward(1.0 if r.ok else 0.0, {}, {})


async def _run(sched: Scheduler, specs: list[JobSpec]) -> tuple[dict[str, JobFinished],
                                                               dict[str, float]]:
    sub = await sched.attach("trainer")
    results = await sched.submit(specs, "trainer")
    assert all(r.accepted for r in results)
    finished: dict[str, JobFinished] = {}
    rewards: dict[str, float] = {}
    async with asyncio.timeout(240):
        async for event in sub:
            if isinstance(event, TrajectoryReady):
                rewards[event.trajectory.job_id] = event.trajectory.reward
            elif isinstance(event, JobFinished):
                finished[event.job_id] = event
                if len(finished) == len(specs):
                    break
    return finished, rewards


async def test_code_jobs_and_a_broken_task_image_through_the_scheduler(
        tmp_path: Path, image_registry: Registry, image_settings: ImageSettings) -> None:
    code = load_tasks("code")[2]
    write = call("editor", command="create", path="/workspace/solution.py",
                 file_text=code["solution"])
    done = call("submit", answer="done")
    scripts = {"code-right": [write, done], "code-noop": [done]}
    specs = [JobSpec(job_id=jid, environment="code", task=code,
                     sampling=SamplingParams(max_tokens_per_turn=4096, total_token_budget=32768),
                     limits=Limits(max_turns=len(script), init_timeout_s=200))
             for jid, script in scripts.items()]
    specs += [JobSpec(job_id="image-ok", environment="image-task",
                      task={"id": "ok-task", "image": "docker://debian:bookworm-slim"},
                      limits=Limits(init_timeout_s=200)),
              JobSpec(job_id="image-missing", environment="image-task",
                      task={"id": "broken-task", "image": "docker://python:0.0-missing"},
                      limits=Limits(init_timeout_s=200)),
              JobSpec(job_id="image-bad-ref", environment="image-task",
                      task={"id": "typo-task", "image": "python:3.11"},
                      limits=Limits(init_timeout_s=200))]
    registry = HandlerRegistry()
    registry.register(CodeHandler.name, CodeHandler)
    registry.register(ImageTaskHandler.name, ImageTaskHandler)
    cfg = SandboxConfig(state_dir=tmp_path / "state", image="docker://python:3.11-slim",
                        images=image_settings)
    store = JobStore(tmp_path / "jobs.sqlite3")
    await store.open()
    sched = Scheduler(store, registry,
                      llm=EngineClient(ScriptedEngine(smollm2_tokenizer(), scripts)),
                      sandbox_factory=functools.partial(create_sandbox, cfg),
                      config=PipelineConfig(cleanup_deadline_s=10.0))
    await sched.start()
    try:
        finished, rewards = await _run(sched, specs)
    finally:
        await sched.stop(grace_s=0.0)
        await store.close()
    states = {j: f.state for j, f in finished.items()}
    errors: dict[str, Any] = {j: f.error for j, f in finished.items()}
    assert states["code-right"] == JobState.SUCCEEDED, errors["code-right"]
    assert rewards["code-right"] == 1.0 and rewards["code-noop"] == 0.0
    assert states["image-ok"] == JobState.SUCCEEDED and rewards["image-ok"] == 1.0
    missing = errors["image-missing"]
    assert states["image-missing"] == JobState.FAILED
    assert finished["image-missing"].reward is None  # a failure, never a reward of 0
    assert (missing.code, missing.reason) == ("INVALID_TASK", "IMAGE_NOT_FOUND")
    assert "task 'broken-task'" in missing.message and "python:0.0-missing" in missing.message
    typo = errors["image-bad-ref"]
    assert (typo.code, typo.reason) == ("INVALID_TASK", "INVALID_IMAGE_REF")
    assert "task 'typo-task'" in typo.message
    assert list(cfg.sandboxes_dir.glob("*/workspace")) == []
