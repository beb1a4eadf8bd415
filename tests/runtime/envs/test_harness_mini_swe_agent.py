"""mini-swe-agent (the real package, installed by scripts/setup_harnesses.sh) as a harness job on
the shipped swe tasks, in a real bwrap sandbox, through the real model gateway.

With the scripted policy speaking mini-swe-agent's own action format, the gold fix earns 1 and
doing nothing 0; with a real model (the tiny random one; SmolLM2 in the slow test) the harness
runs to its step limit and every token the model saw and produced is in the trajectory."""

from __future__ import annotations

from typing import Any

import pytest

from rollout.runtime.envs.harness.handler import CAPTURE_KEY, HarnessHandler
from rollout.runtime.tasksets.shipped import load_tasks
from rollout.runtime.types import Limits, SamplingParams, TerminationReason
from tests.runtime.envs.conftest import Rollout
from tests.runtime.envs.harness_helpers import (
    MSWEA_SUBMIT,
    GatewayRig,
    assert_every_token_captured,
    harness_task,
    model_rollout,
    mswea_action,
    need_mini_swe_agent,
)

pytestmark = [pytest.mark.timeout(300)]

TASKS = [t for t in load_tasks("swe") if "spec" not in t]  # no wheelhouse needed


@pytest.fixture(autouse=True)
def installed() -> None:
    need_mini_swe_agent()


action, SUBMIT = mswea_action, MSWEA_SUBMIT


def apply_patch(patch: str) -> str:
    return action(f"cat > /tmp/fix.patch <<'PATCH_EOF'\n{patch}PATCH_EOF\n"
                  "git apply /tmp/fix.patch && git status --short")


@pytest.mark.parametrize("task", TASKS[:2], ids=[t["instance_id"] for t in TASKS[:2]])
async def test_gold_fix_through_mini_swe_agent_earns_1(task: dict[str, Any], rollout: Rollout,
                                                      gateway_rig: GatewayRig) -> None:
    script = [apply_patch(task["patch"]), SUBMIT]
    result = await rollout(HarnessHandler(), harness_task("swe", task, "mini-swe-agent"),
                           script, gateway=gateway_rig.gateway,
                           limits=Limits(max_turns=6, run_timeout_s=180))
    assert result.reward.value == 1.0, (result.reward.info,
                                        result.outcome.metadata["harness_log"])
    capture = result.ctx.state[CAPTURE_KEY]
    assert capture.requests == 2 and len(result.outcome.turns) == 2
    assert result.outcome.termination is TerminationReason.SUBMITTED
    # The scripted replies are the trajectory's outputs, token for token.
    for turn, text in zip(result.outcome.turns, script, strict=True):
        assert turn.output_ids == [*result.engine.tokenizer.encode(
            text, add_special_tokens=False), result.engine.end_of_turn_id]
    # The harness's second request carried what it was shown after the fix: one sequence.
    assert len(result.outcome.segments) == 1
    assert "fix.patch" in result.prompt_text(1) and "<returncode>0</returncode>" in \
        result.prompt_text(1)


async def test_doing_nothing_through_mini_swe_agent_earns_0(rollout: Rollout,
                                                           gateway_rig: GatewayRig) -> None:
    task = TASKS[0]
    result = await rollout(HarnessHandler(), harness_task("swe", task, "mini-swe-agent"),
                           [SUBMIT], gateway=gateway_rig.gateway,
                           limits=Limits(max_turns=4, run_timeout_s=120))
    assert result.reward.value == 0.0
    assert set(result.reward.info["failing"].split(",")) == set(task["FAIL_TO_PASS"])
    assert result.ctx.state[CAPTURE_KEY].requests == 1
    assert result.outcome.metadata["harness_exit"] == "0"


async def test_tiny_model_runs_mini_swe_agent_to_its_step_limit(
        tiny_engine: Any, sandbox_factory: Any, gateway_rig: GatewayRig) -> None:
    steps = 3
    result = await model_rollout(
        HarnessHandler(), harness_task("swe", TASKS[0], "mini-swe-agent"), tiny_engine,
        sandbox_factory=sandbox_factory, gateway=gateway_rig.gateway,
        limits=Limits(max_turns=steps, run_timeout_s=240),
        sampling=SamplingParams(temperature=1.0, max_tokens_per_turn=24, seed=11,
                                total_token_budget=2000))
    outcome = result.outcome
    assert result.capture.requests == steps, outcome.metadata["harness_log"]
    # litellm prints its provider list (ANSI-coloured, several lines) whenever the answer's
    # model name has no provider prefix: noise that buried the harness's own log.
    assert "Provider List" not in outcome.metadata["harness_log"], outcome.metadata[
        "harness_log"]
    assert outcome.termination is TerminationReason.MAX_TURNS
    assert_every_token_captured(result)
    assert result.reward.value == 0.0  # random tokens fix nothing


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_smollm2_runs_mini_swe_agent_to_its_step_limit(
        sandbox_factory: Any, gateway_rig: GatewayRig) -> None:
    from rollout.server.llm.smollm2 import smollm2_dir
    from rollout.server.llm.transformers_engine import TransformersEngine

    engine = TransformersEngine(smollm2_dir(), name="smollm2", num_threads=1)
    steps = 3
    try:
        result = await model_rollout(
            HarnessHandler(), harness_task("swe", TASKS[0], "mini-swe-agent"), engine,
            sandbox_factory=sandbox_factory, gateway=gateway_rig.gateway,
            limits=Limits(max_turns=steps, run_timeout_s=500),
            sampling=SamplingParams(temperature=0.7, max_tokens_per_turn=96, seed=5))
    finally:
        await engine.close()
    assert result.capture.requests == steps, result.outcome.metadata["harness_log"]
    assert_every_token_captured(result)
