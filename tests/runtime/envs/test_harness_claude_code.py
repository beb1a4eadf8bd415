"""Claude Code (the real npm package, installed by scripts/setup_harnesses.sh) as a harness job
on the shipped swe tasks, in a real bwrap sandbox, through the real gateway's Anthropic
Messages API (streaming, tool_use, the system message Claude Code puts among its messages).

The scripted policy answers each request by what it shows (a routed script: Claude Code's
sub-agent calls interleave with its main thread): the gold fix through Claude Code's own Bash
tool earns 1, a summary without a change 0; a main thread that starts a sub-agent (its Agent
tool) and resumes gives two chains, each sampled token trained in exactly one. With a real
model every token is captured."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import pytest

from rollout.runtime.envs.harness import presets as harness_presets
from rollout.runtime.envs.harness.handler import HarnessHandler
from rollout.runtime.tasksets.shipped import load_tasks
from rollout.runtime.types import Limits, SamplingParams, TerminationReason
from tests.runtime.envs.conftest import call
from tests.runtime.envs.harness_helpers import (
    GatewayRig,
    RoutedResult,
    assert_each_token_owned_once,
    assert_every_token_captured,
    harness_task,
    model_rollout,
    routed_rollout,
)

pytestmark = [pytest.mark.timeout(300)]

TASKS = [t for t in load_tasks("swe") if "spec" not in t]
DONE = "The fix is in place."
APPLIED = "PATCH-2-APPLIED"  # what the fix command prints; its own text says PATCH-$((1+1))


@pytest.fixture(autouse=True)
def installed() -> None:
    try:
        harness_presets.resolve("claude-code")
    except Exception as e:  # the message says what to run
        pytest.skip(f"Claude Code is not installed: {e}")


async def claude(task: dict[str, Any], choose: Any, tok: Any, sandbox_factory: Any,
                 gateway_rig: GatewayRig, max_turns: int = 6,
                 harness: Any = "claude-code") -> RoutedResult:
    return await routed_rollout(
        HarnessHandler(), harness_task("swe", task, harness), choose, tokenizer=tok,
        sandbox_factory=sandbox_factory, gateway=gateway_rig.gateway,
        limits=Limits(max_turns=max_turns, run_timeout_s=180))


def bash(command: str) -> str:
    return call("Bash", command=command, description="run a command")


@pytest.mark.parametrize("task", TASKS[:2], ids=[t["instance_id"] for t in TASKS[:2]])
async def test_gold_fix_through_claude_code_earns_1(task: dict[str, Any], tok: Any,
                                                   sandbox_factory: Any,
                                                   gateway_rig: GatewayRig) -> None:
    fix = bash(f"cat > /tmp/fix.patch <<'PATCH_EOF'\n{task['patch']}PATCH_EOF\n"
               "git apply /tmp/fix.patch && echo PATCH-$((1+1))-APPLIED")
    result = await claude(task, lambda prompt: DONE if APPLIED in prompt else fix, tok,
                          sandbox_factory, gateway_rig)
    assert result.reward.value == 1.0, (result.reward.info, result.log)
    assert result.capture.requests == 2, result.log
    assert result.outcome.termination is TerminationReason.SUBMITTED
    assert result.outcome.metadata["harness_exit"] == "0"
    # Claude Code's second request carried the Bash tool's output back (a tool_result), and
    # extended the first: one chain.
    assert APPLIED in result.engine.prompts[1]
    assert len(result.outcome.segments) == 1
    # Its system prompt reached the model (Claude Code sends it as a system message).
    assert "You are a coding agent in a Linux sandbox" in result.engine.prompts[0]


async def test_no_change_through_claude_code_earns_0(tok: Any, sandbox_factory: Any,
                                                    gateway_rig: GatewayRig) -> None:
    result = await claude(TASKS[0], lambda prompt: DONE, tok, sandbox_factory, gateway_rig)
    assert result.reward.value == 0.0
    assert result.capture.requests == 1, result.log
    assert result.outcome.metadata["harness_exit"] == "0"


SUBTASK = "SUBTASK: say whether README mentions word counts."
SUB_ANSWER = "Sub-agent report: nothing to change there."


def first_user_message(prompt: str) -> str:
    return prompt.split("<|im_start|>user", 1)[-1].split("<|im_end|>", 1)[0]


def main_or_sub(prompt: str) -> str:
    if SUBTASK in first_user_message(prompt):  # the sub-agent: the subtask is its task
        return SUB_ANSWER
    if SUB_ANSWER in prompt:  # the main thread, resumed with the sub-agent's report
        return DONE
    return call("Agent", description="check the README", prompt=SUBTASK,
                subagent_type="general-purpose", run_in_background=False)


async def test_a_sub_agent_is_a_chain_of_its_own_and_each_token_is_owned_once(
        tok: Any, sandbox_factory: Any, gateway_rig: GatewayRig) -> None:
    """Main thread -> Agent tool -> sub-agent answers -> main thread resumes and ends: three
    requests, two chains (the main thread's two turns in one, the sub-agent's in the other),
    every sampled token trained in exactly one chain."""
    result = await claude(TASKS[0], main_or_sub, tok, sandbox_factory, gateway_rig)
    prompts = result.engine.prompts
    assert result.capture.requests == 3, (result.log, [p[-300:] for p in prompts])
    assert [main_or_sub(p) for p in prompts] == [
        main_or_sub(prompts[0]), SUB_ANSWER, DONE]
    segments = result.outcome.segments
    assert len(segments) == 2, segments
    assert not any(s.side_call for s in segments)
    # The main chain holds the first and the last request; the sub-agent's is the other.
    main, sub = segments
    turns = result.outcome.turns
    main_turns = turns[main.first_turn:sub.first_turn]
    assert len(main_turns) == 2 and len(turns[sub.first_turn:]) == 1
    assert SUB_ANSWER in str(tok.decode(turns[sub.first_turn].output_ids))
    assert_each_token_owned_once(result)
    assert result.outcome.metadata["harness_exit"] == "0"


async def test_tiny_model_through_claude_code_has_every_token_captured(
        tiny_engine: Any, sandbox_factory: Any, gateway_rig: GatewayRig) -> None:
    result = await model_rollout(
        HarnessHandler(), harness_task("swe", TASKS[0], "claude-code"), tiny_engine,
        sandbox_factory=sandbox_factory, gateway=gateway_rig.gateway,
        limits=Limits(max_turns=3, run_timeout_s=240),
        # Claude Code's tool descriptions are some 12,000 of the tiny model's tokens.
        sampling=SamplingParams(temperature=1.0, max_tokens_per_turn=24, seed=11,
                                total_token_budget=16384))
    assert result.capture.requests >= 1, result.outcome.metadata["harness_log"]
    assert_every_token_captured(result)


SUMMARY_PROMPT = "Write a short summary label"
"""How Claude Code's tool-use summary request (to its small fast model) starts its system
prompt (2.1.332)."""
LISTED = "LISTED-2"


def with_a_summary(prompt: str) -> str:
    if SUMMARY_PROMPT in prompt:
        return "Listed the files"
    if LISTED in prompt:
        return DONE
    return bash("ls && echo LISTED-$((1+1))")


SMALL_MODEL_AS_MAIN = {"ANTHROPIC_DEFAULT_HAIKU_MODEL": "{model}",
                       "ANTHROPIC_SMALL_FAST_MODEL": "{model}"}
"""A task's override that sends the small fast model's calls under the main model's name."""


@pytest.mark.parametrize("small_model", [{}, SMALL_MODEL_AS_MAIN],
                         ids=["haiku-name", "main-models-name"])
async def test_claude_codes_small_fast_model_calls_are_side_calls(
        tok: Any, sandbox_factory: Any, gateway_rig: GatewayRig,
        small_model: dict[str, str]) -> None:
    """Real Claude Code traffic: with CLAUDE_CODE_EMIT_TOOL_USE_SUMMARIES (an SDK setting a
    task may turn on) it asks its small fast model to label each tool use. Under the preset
    that request names a Haiku model (ANTHROPIC_DEFAULT_HAIKU_MODEL); when a task points the
    Haiku variables at the job's model it goes out under the main thread's name, and the
    preset's system-prompt rule still tells it apart. Either way it is a side-call chain, never
    trained, while both turns of the main thread are."""
    harness = {"preset": "claude-code",
               "env": {"CLAUDE_CODE_EMIT_TOOL_USE_SUMMARIES": "1", **small_model}}
    result = await claude(TASKS[0], with_a_summary, tok, sandbox_factory, gateway_rig,
                          harness=harness)
    prompts = result.engine.prompts
    assert result.capture.requests == 3, (result.log, [p[-300:] for p in prompts])
    assert sum(SUMMARY_PROMPT in p for p in prompts) == 1, result.log
    segments, turns = result.outcome.segments, result.outcome.turns
    assert sorted(s.side_call for s in segments) == [False, True], segments
    starts = [s.first_turn for s in segments] + [len(turns)]
    for segment, end in zip(segments, starts[1:], strict=True):
        mine = turns[segment.first_turn:end]
        assert all(t.trained is not segment.side_call for t in mine), (segment, mine)
        said = "".join(str(tok.decode(t.output_ids)) for t in mine)
        assert ("Listed the files" in said) is segment.side_call, said
    assert_each_token_owned_once(result)
    assert result.outcome.metadata["harness_exit"] == "0"


def test_claude_code_starts_in_a_root_that_holds_only_its_install() -> None:
    """Its own loader and C libraries (scripts/harness_loader.py): no /usr, no /lib, nothing of
    an image, so it runs in a task's own image whatever that holds. It also answers a request
    there (through the gateway in the tests above, which run in the host's view)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    install = harness_presets.resolve("claude-code").install
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--tmpfs", "/", "--ro-bind",
            str(install), "/.rollout-harness", "--proc", "/proc", "--dev", "/dev",
            "--tmpfs", "/tmp", "--setenv", "HOME", "/tmp",
            "/.rollout-harness/node_modules/@anthropic-ai/claude-code/bin/claude.exe",
            "--version"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Claude Code" in done.stdout



PROGRESS_PROMPT = "Describe your most recent action in 3-5 words"
"""How the progress label of a background sub-agent (the fork variant: the sub-agent's own
system prompt and history plus this instruction) begins (2.1.332)."""
PROGRESS = "Sleeping in the shell"


def with_a_background_agent(prompt: str) -> str:
    if PROGRESS_PROMPT in prompt:
        return PROGRESS
    if SUBTASK in first_user_message(prompt):  # the background sub-agent
        if "SLEPT-2" in prompt:
            return SUB_ANSWER
        if "STEP-2" in prompt:
            # Long enough for the label's timer (30 s after the agent starts) to fire. Claude
            # Code refuses a plain long `sleep`.
            return bash("timeout 45 tail -f /dev/null; echo SLEPT-$((1+1))")
        return bash("echo STEP-$((1+1))")
    if SUBTASK in prompt:  # the main thread once the agent is started (or has reported)
        return DONE
    return call("Agent", description="check the README", prompt=SUBTASK,
                subagent_type="general-purpose", run_in_background=True)


@pytest.mark.slow
async def test_a_background_agents_progress_label_is_a_side_call(
        tok: Any, sandbox_factory: Any, gateway_rig: GatewayRig) -> None:
    """Real Claude Code traffic: with CLAUDE_CODE_AGENT_PROGRESS_SUMMARIES (a task may set it;
    the SDK's ``agentProgressSummaries`` option) a background sub-agent gets a progress label
    every 30 s from a fork of it: its own system prompt, history and model name, plus one user
    message asking for the label (and a system message of Claude Code's after it). Only that
    message tells the fork apart; it must land as an untrained chain, while the main thread's
    and the sub-agent's turns stay trained, each sampled token owned once."""
    harness = {"preset": "claude-code", "env": {"CLAUDE_CODE_AGENT_PROGRESS_SUMMARIES": "1"}}
    result = await claude(TASKS[0], with_a_background_agent, tok, sandbox_factory, gateway_rig,
                          harness=harness, max_turns=12)
    prompts = result.engine.prompts
    labels = sum(PROGRESS_PROMPT in p for p in prompts)
    assert labels >= 1, (result.log, [p[-300:] for p in prompts])
    segments, turns = result.outcome.segments, result.outcome.turns
    assert sum(s.side_call for s in segments) == labels, segments
    starts = [s.first_turn for s in segments] + [len(turns)]
    for segment, end in zip(segments, starts[1:], strict=True):
        mine = turns[segment.first_turn:end]
        assert all(t.trained is not segment.side_call for t in mine), (segment, mine)
        said = "".join(str(tok.decode(t.output_ids)) for t in mine)
        assert (PROGRESS in said) is segment.side_call, said
    assert any(SUB_ANSWER in str(tok.decode(t.output_ids)) and t.trained for t in turns)
    assert_each_token_owned_once(result)
    assert result.outcome.metadata["harness_exit"] == "0"
