"""What the policy causes is a reward; what the service causes is a failure. Through the real
scheduler: a workspace over the grader's quota (two sparse files), code under test that hangs
the grader, and a policy fault raised in RUN each end SUCCEEDED with reward 0 and a termination
reason that says so, beside a control that earns 1; a sandbox that cannot start ends FAILED."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.code.handler import CodeHandler
from rollout.runtime.envs.swe.handler import SweHandler
from rollout.runtime.handler import (
    AgentHandler,
    HandlerRegistry,
    JobContext,
    PolicyFault,
    RunOutcome,
)
from rollout.runtime.sandbox import SandboxError
from rollout.runtime.tasksets.shipped import load_tasks
from rollout.runtime.types import (
    JobSpec,
    JobState,
    Limits,
    Reward,
    SamplingParams,
    TerminationReason,
    Trajectory,
)
from rollout.server.llm.scripted import ScriptedEngine
from rollout.server.pipeline.subscription import JobFinished, TrajectoryReady
from rollout.server.scheduler import PipelineConfig, Scheduler
from rollout.server.store import JobStore
from tests.runtime.doubles import EngineClient
from tests.runtime.envs.conftest import call

pytestmark = pytest.mark.timeout(240)

SWE = next(t for t in load_tasks("swe") if t["instance_id"] == "rollout__textstats-1")
CODE = load_tasks("code")[2]
SUBMIT = call("submit", answer="done")
GOLD = call("bash", command=f"git apply <<'EOF'\n{SWE['patch']}EOF\n")
# Apparent size over the grader's 1 GiB copy budget while using no space at all.
SPARSE = call("bash", command="truncate -s 600M a.bin b.bin && du -sh a.bin b.bin")
HANG = call("bash", command="printf 'while True:\\n    pass\\n' >> textstats/core.py")
WRITE_SOLUTION = call("editor", command="create", path="/workspace/solution.py",
                      file_text=CODE["solution"])


class FaultInRun(AgentHandler):
    """A handler whose RUN meets something the policy caused."""

    name = "fault-in-run"

    async def init(self, ctx: JobContext) -> None:
        return None

    async def run(self, ctx: JobContext) -> RunOutcome:
        raise PolicyFault("the agent's output was over its limit",
                          TerminationReason.WORKSPACE_TOO_LARGE)

    async def eval(self, ctx: JobContext) -> Reward:
        raise AssertionError("EVAL must not run after a policy fault")


async def _run(tmp_path: Path, tok: Any, sandbox_factory: Any,
               plan: dict[str, tuple[str, dict[str, Any], list[str], Limits]],
               ) -> tuple[dict[str, JobFinished], dict[str, Trajectory]]:
    registry = HandlerRegistry()
    for handler in (CodeHandler, SweHandler, FaultInRun):
        registry.register(handler.name, handler)
    store = JobStore(tmp_path / "jobs.sqlite3")
    await store.open()
    scripts = {jid: p[2] for jid, p in plan.items()}
    sched = Scheduler(store, registry, llm=EngineClient(ScriptedEngine(tok, scripts)),
                      sandbox_factory=sandbox_factory,
                      config=PipelineConfig(cleanup_deadline_s=10.0))
    await sched.start()
    finished: dict[str, JobFinished] = {}
    trajectories: dict[str, Trajectory] = {}
    try:
        sub = await sched.attach("trainer")
        specs = [JobSpec(job_id=jid, environment=env, task=task, limits=limits,
                         sampling=SamplingParams(max_tokens_per_turn=4096,
                                                 total_token_budget=32768))
                 for jid, (env, task, _, limits) in plan.items()]
        assert all(r.accepted for r in await sched.submit(specs, "trainer"))
        async with asyncio.timeout(200):
            async for event in sub:
                if isinstance(event, TrajectoryReady):
                    trajectories[event.trajectory.job_id] = event.trajectory
                elif isinstance(event, JobFinished):
                    finished[event.job_id] = event
                    if len(finished) == len(specs):
                        break
    finally:
        await sched.stop(grace_s=0.0)
        await store.close()
    return finished, trajectories


async def test_what_the_policy_causes_is_a_reward_of_0(tmp_path: Path, tok: Any,
                                                       sandbox_factory: Any) -> None:
    turns = Limits(max_turns=3)
    plan = {
        "swe-gold": ("swe", SWE, [GOLD, SUBMIT], turns),
        "swe-gold-sparse": ("swe", SWE, [GOLD, SPARSE, SUBMIT], turns),
        "code-right": ("code", CODE, [WRITE_SOLUTION, SUBMIT], turns),
        "code-right-sparse": ("code", CODE, [WRITE_SOLUTION, SPARSE, SUBMIT], turns),
        "swe-hangs-the-grader": ("swe", SWE, [HANG, SUBMIT],
                                 Limits(max_turns=2, eval_timeout_s=8.0)),
        "fault-in-run": ("fault-in-run", {}, [], Limits(max_turns=1)),
    }
    finished, trajectories = await _run(tmp_path, tok, sandbox_factory, plan)
    states = {j: f.state for j, f in finished.items()}
    assert states == dict.fromkeys(plan, JobState.SUCCEEDED), {
        j: f.error for j, f in finished.items()}
    rewards = {j: t.reward for j, t in trajectories.items()}
    assert rewards == {"swe-gold": 1.0, "swe-gold-sparse": 0.0, "code-right": 1.0,
                       "code-right-sparse": 0.0, "swe-hangs-the-grader": 0.0,
                       "fault-in-run": 0.0}
    term = {j: t.termination for j, t in trajectories.items()}
    assert term["swe-gold"] is TerminationReason.SUBMITTED
    for jid in ("swe-gold-sparse", "code-right-sparse", "fault-in-run"):
        assert term[jid] is TerminationReason.WORKSPACE_TOO_LARGE, (jid, trajectories[jid])
        assert trajectories[jid].state is JobState.SUCCEEDED and trajectories[jid].error is None
    assert trajectories["swe-gold-sparse"].metadata["reward.error"] == "WORKSPACE_TOO_LARGE"
    # Killed at the test run's own timeout (a reward the grader computed) or at the stage's:
    # either way a 0 that says why, never a failure.
    hung = trajectories["swe-hangs-the-grader"]
    assert (hung.termination is TerminationReason.EVAL_TIMEOUT
            or "timed out" in hung.metadata.get("reward.error", "")), hung


async def test_what_the_service_causes_is_a_failure(tmp_path: Path, tok: Any) -> None:
    async def broken_runtime(**_: Any) -> Any:
        raise SandboxError("the sandbox runtime could not start", "SANDBOX_START_FAILED")

    plan = {"swe-gold": ("swe", SWE, [GOLD, SUBMIT], Limits(max_turns=3))}
    finished, trajectories = await _run(tmp_path, tok, broken_runtime, plan)
    assert finished["swe-gold"].state is JobState.FAILED
    assert trajectories["swe-gold"].termination is TerminationReason.ERROR
