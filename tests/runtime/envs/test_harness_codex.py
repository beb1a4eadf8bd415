"""OpenAI Codex CLI (the real npm package, installed by scripts/setup_harnesses.sh) as a harness
job on the shipped swe tasks, in a real bwrap sandbox, through the real gateway's Responses API.

The scripted policy calls Codex's own `exec_command` tool (in the model family's tool-call
format, which the gateway turns into Responses function calls): the gold fix earns 1, a
summary without a change 0. With a real model every token is captured."""

from __future__ import annotations

from typing import Any

import pytest

from rollout.runtime.envs.harness import presets as harness_presets
from rollout.runtime.envs.harness.handler import CAPTURE_KEY, HarnessHandler
from rollout.runtime.tasksets.shipped import load_tasks
from rollout.runtime.types import Limits, SamplingParams, TerminationReason
from tests.runtime.envs.conftest import Rollout, call
from tests.runtime.envs.harness_helpers import (
    GatewayRig,
    assert_every_token_captured,
    harness_task,
    model_rollout,
)

pytestmark = [pytest.mark.timeout(300)]

TASKS = [t for t in load_tasks("swe") if "spec" not in t]
DONE = "The fix is in place."


@pytest.fixture(autouse=True)
def installed() -> None:
    try:
        harness_presets.resolve("codex")
    except Exception as e:  # the message says what to run
        pytest.skip(f"Codex CLI is not installed: {e}")


def exec_command(cmd: str) -> str:
    return call("exec_command", cmd=cmd)


@pytest.mark.parametrize("task", TASKS[:2], ids=[t["instance_id"] for t in TASKS[:2]])
async def test_gold_fix_through_codex_earns_1(task: dict[str, Any], rollout: Rollout,
                                             gateway_rig: GatewayRig) -> None:
    fix = exec_command(f"cat > /tmp/fix.patch <<'PATCH_EOF'\n{task['patch']}PATCH_EOF\n"
                       "git apply /tmp/fix.patch && git status --short")
    result = await rollout(HarnessHandler(), harness_task("swe", task, "codex"), [fix, DONE],
                           gateway=gateway_rig.gateway,
                           limits=Limits(max_turns=6, run_timeout_s=180))
    log = result.outcome.metadata["harness_log"]
    assert result.reward.value == 1.0, (result.reward.info, log)
    assert result.ctx.state[CAPTURE_KEY].requests == 2, log
    assert result.outcome.termination is TerminationReason.SUBMITTED
    assert result.outcome.metadata["harness_exit"] == "0"
    # Codex's second request carried the tool's output back (Responses function_call_output).
    assert "fix.patch" in result.prompt_text(1)


async def test_no_change_through_codex_earns_0(rollout: Rollout,
                                              gateway_rig: GatewayRig) -> None:
    task = TASKS[0]
    result = await rollout(HarnessHandler(), harness_task("swe", task, "codex"), [DONE],
                           gateway=gateway_rig.gateway,
                           limits=Limits(max_turns=4, run_timeout_s=120))
    assert result.reward.value == 0.0
    assert result.ctx.state[CAPTURE_KEY].requests == 1, result.outcome.metadata["harness_log"]


async def test_tiny_model_through_codex_has_every_token_captured(
        tiny_engine: Any, sandbox_factory: Any, gateway_rig: GatewayRig) -> None:
    result = await model_rollout(
        HarnessHandler(), harness_task("swe", TASKS[0], "codex"), tiny_engine,
        sandbox_factory=sandbox_factory, gateway=gateway_rig.gateway,
        limits=Limits(max_turns=3, run_timeout_s=240),
        sampling=SamplingParams(temperature=1.0, max_tokens_per_turn=24, seed=11))
    assert result.capture.requests >= 1, result.outcome.metadata["harness_log"]
    assert_every_token_captured(result)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_smollm2_through_codex_has_every_token_captured(
        sandbox_factory: Any, gateway_rig: GatewayRig) -> None:
    from rollout.server.llm.smollm2 import smollm2_dir
    from rollout.server.llm.transformers_engine import TransformersEngine

    engine = TransformersEngine(smollm2_dir(), name="smollm2", num_threads=1)
    try:
        result = await model_rollout(
            HarnessHandler(), harness_task("swe", TASKS[0], "codex"), engine,
            sandbox_factory=sandbox_factory, gateway=gateway_rig.gateway,
            limits=Limits(max_turns=3, run_timeout_s=500),
            sampling=SamplingParams(temperature=0.7, max_tokens_per_turn=96, seed=5))
    finally:
        await engine.close()
    assert result.capture.requests >= 1, result.outcome.metadata["harness_log"]
    assert_every_token_captured(result)


async def test_codex_runs_to_the_jobs_turn_limit(rollout: Rollout,
                                                gateway_rig: GatewayRig) -> None:
    """A model that keeps calling tools: the gateway serves ``limits.max_turns`` requests and
    refuses the next, Codex stops, the job ends at its turn limit with one merged sequence."""
    script = [exec_command(f"echo step-{i}") for i in range(3)]
    result = await rollout(HarnessHandler(), harness_task("swe", TASKS[0], "codex"), script,
                           gateway=gateway_rig.gateway,
                           limits=Limits(max_turns=3, run_timeout_s=120))
    capture = result.ctx.state[CAPTURE_KEY]
    assert capture.requests == 3, result.outcome.metadata["harness_log"]
    assert result.outcome.termination is TerminationReason.MAX_TURNS
    assert len(result.outcome.segments) == 1  # each request extended the one before
    assert "step-1" in result.prompt_text(2)
    assert result.reward.value == 0.0
