"""aider (PyPI aider-chat in an interpreter of its own with its own C runtime, installed by
scripts/setup_harnesses.sh) as a harness job on the shipped swe tasks, in a real bwrap
sandbox, through the real gateway's chat completions (litellm's OpenAI route).

The scripted policy writes aider's own edit format (unified diffs in a ``diff`` fence): the
gold fix earns 1, a reply without an edit 0; with a real model every token is captured."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

import pytest

from rollout.runtime.envs.harness import presets as harness_presets
from rollout.runtime.envs.harness.handler import HarnessHandler
from rollout.runtime.tasksets.shipped import load_tasks
from rollout.runtime.types import Limits, SamplingParams, TerminationReason
from tests.runtime.envs.harness_helpers import (
    GatewayRig,
    RoutedResult,
    assert_every_token_captured,
    harness_task,
    model_rollout,
    routed_rollout,
)

pytestmark = [pytest.mark.timeout(300)]

TASKS = [t for t in load_tasks("swe") if "spec" not in t]
DONE = "Nothing in the code needs to change."


@pytest.fixture(autouse=True)
def installed() -> None:
    try:
        harness_presets.resolve("aider")
    except Exception as e:  # the message says what to run
        pytest.skip(f"aider is not installed: {e}")


def as_udiff(patch: str) -> str:
    """A git patch as aider's udiff edits: one ``diff`` fence per file, from its ``---`` line
    (git's ``diff --git`` and ``index`` lines are not part of the format)."""
    files = re.split(r"^diff --git .*\n", patch, flags=re.M)
    blocks = []
    for body in filter(None, files):
        lines = [ln for ln in body.splitlines() if not ln.startswith(("index ", "new file"))]
        blocks.append("```diff\n" + "\n".join(lines) + "\n```")
    return "Here is the fix.\n\n" + "\n\n".join(blocks)


async def aider(task: dict[str, Any], choose: Any, tok: Any, sandbox_factory: Any,
                gateway_rig: GatewayRig) -> RoutedResult:
    return await routed_rollout(
        HarnessHandler(), harness_task("swe", task, "aider"), choose, tokenizer=tok,
        sandbox_factory=sandbox_factory, gateway=gateway_rig.gateway,
        limits=Limits(max_turns=4, run_timeout_s=180))


async def test_gold_fix_through_aider_earns_1(tok: Any, sandbox_factory: Any,
                                             gateway_rig: GatewayRig) -> None:
    task = TASKS[0]
    result = await aider(task, lambda prompt: as_udiff(task["patch"]), tok, sandbox_factory,
                         gateway_rig)
    assert result.reward.value == 1.0, (result.reward.info, result.log)
    # The edit applied: no reflection request followed.
    assert result.capture.requests == 1, result.log
    assert result.outcome.termination is TerminationReason.SUBMITTED
    assert "Act as an expert software developer" in result.engine.prompts[0]
    assert task["problem_statement"].splitlines()[0] in result.engine.prompts[0]


async def test_no_change_through_aider_earns_0(tok: Any, sandbox_factory: Any,
                                              gateway_rig: GatewayRig) -> None:
    result = await aider(TASKS[0], lambda prompt: DONE, tok, sandbox_factory, gateway_rig)
    assert result.reward.value == 0.0
    assert result.capture.requests == 1, result.log
    assert result.outcome.metadata["harness_exit"] == "0"


async def test_tiny_model_through_aider_has_every_token_captured(
        tiny_engine: Any, sandbox_factory: Any, gateway_rig: GatewayRig) -> None:
    result = await model_rollout(
        HarnessHandler(), harness_task("swe", TASKS[0], "aider"), tiny_engine,
        sandbox_factory=sandbox_factory, gateway=gateway_rig.gateway,
        limits=Limits(max_turns=3, run_timeout_s=240),
        sampling=SamplingParams(temperature=1.0, max_tokens_per_turn=24, seed=11))
    assert result.capture.requests >= 1, result.outcome.metadata["harness_log"]
    assert_every_token_captured(result)


def test_aider_starts_in_a_root_that_holds_only_its_install() -> None:
    """Its own loader and C libraries: no /usr, no /lib, nothing of an image (so it runs in a
    task's own image whatever that holds)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    install = harness_presets.resolve("aider").install
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--tmpfs", "/", "--ro-bind",
            str(install), "/.rollout-harness", "--proc", "/proc", "--dev", "/dev",
            "--tmpfs", "/tmp", "--setenv", "HOME", "/tmp",
            "/.rollout-harness/python/bin/python", *["-c", "import ssl, sqlite3, aider.main"]]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
