"""OpenCode (the real npm package with its own C runtime, installed by
scripts/setup_harnesses.sh) as a harness job on the shipped swe tasks, in a real bwrap sandbox,
through the real gateway's chat completions (streaming, tool calls).

The scripted policy answers each request by what it shows: OpenCode writes its session's title
in a request of its own, beside the main thread, and the preset marks it a side call (a chain
of its own, never trained). The gold fix through OpenCode's own bash tool earns 1, a summary
without a change 0; with a real model every token is captured.

Address space (issue 28 finding 8): OpenCode 1.18.33's first request needs about 3.75 to 4 GiB
of RLIMIT_AS on the 2-core test machine (bisected with prlimit: 3.5 GiB 0 of 3 runs answered,
3.75 GiB 1 of 3, 4 GiB 3 of 3); below that Bun's JavaScriptCore aborts in
``LocalAllocator::allocateSlowCase`` before any request. The sandbox's old fixed 4 GiB sat
within a few percent of that need, which grows on bigger machines, so the preset raises it;
the tests show the abort under 3 GiB and that the preset leaves twice what this machine needs.
At exactly 4 GiB the outcome varies from run to run (seen: SIGILL or SIGABRT when it spawns its
bash tool, the tool answering "Out of memory", a hang to the deadline, a clean run), so the test
that fails without the preset's raise reads the limit OpenCode's process runs under from inside
instead of hoping for a crash.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.harness import presets as harness_presets
from rollout.runtime.envs.harness.handler import HarnessHandler
from rollout.runtime.handler import HandlerError
from rollout.runtime.sandbox.base import SandboxLimits
from rollout.runtime.tasksets.shipped import load_tasks
from rollout.runtime.types import Limits, SamplingParams, TerminationReason
from tests.runtime.envs.conftest import call
from tests.runtime.envs.harness_helpers import (
    GatewayRig,
    RoutedResult,
    assert_each_token_owned_once,
    harness_task,
    model_rollout,
    routed_rollout,
)

pytestmark = [pytest.mark.timeout(300)]

TASKS = [t for t in load_tasks("swe") if "spec" not in t]
DONE = "The fix is in place."
TITLE = "Word count whitespace fix"
APPLIED = "PATCH-2-APPLIED"  # what the fix command prints; its own text says PATCH-$((1+1))


@pytest.fixture(autouse=True)
def installed() -> None:
    try:
        harness_presets.resolve("opencode")
    except Exception as e:  # the message says what to run
        pytest.skip(f"OpenCode is not installed: {e}")


def is_title_request(prompt: str) -> bool:
    return "You are a title generator" in prompt


async def opencode(task: dict[str, Any], main: Any, tok: Any, sandbox_factory: Any,
                   gateway_rig: GatewayRig, harness: Any = "opencode") -> RoutedResult:
    def choose(prompt: str) -> str:
        return TITLE if is_title_request(prompt) else main(prompt)

    return await routed_rollout(
        HarnessHandler(), harness_task("swe", task, harness), choose, tokenizer=tok,
        sandbox_factory=sandbox_factory, gateway=gateway_rig.gateway,
        limits=Limits(max_turns=6, run_timeout_s=180))


@pytest.mark.parametrize("task", TASKS[:2], ids=[t["instance_id"] for t in TASKS[:2]])
async def test_gold_fix_through_opencode_earns_1(task: dict[str, Any], tok: Any,
                                                sandbox_factory: Any,
                                                gateway_rig: GatewayRig) -> None:
    fix = call("bash", command=f"cat > /tmp/fix.patch <<'PATCH_EOF'\n{task['patch']}PATCH_EOF\n"
               "git apply /tmp/fix.patch && echo PATCH-$((1+1))-APPLIED",
               description="apply the fix")
    result = await opencode(task, lambda p: DONE if APPLIED in p else fix, tok,
                            sandbox_factory, gateway_rig)
    assert result.reward.value == 1.0, (result.reward.info, result.log)
    assert result.outcome.termination is TerminationReason.SUBMITTED
    assert result.outcome.metadata["harness_exit"] == "0"
    main = [p for p in result.engine.prompts if not is_title_request(p)]
    assert len(main) == 2 and APPLIED in main[1], result.log


async def test_no_change_through_opencode_earns_0_and_its_title_is_never_trained(
        tok: Any, sandbox_factory: Any, gateway_rig: GatewayRig) -> None:
    """The title request is a side call: a chain of its own whose output carries loss mask
    0; the main thread's reply is the one trained turn."""
    result = await opencode(TASKS[0], lambda p: DONE, tok, sandbox_factory, gateway_rig)
    assert result.reward.value == 0.0
    assert result.capture.requests == 2, result.log
    segments, turns = result.outcome.segments, result.outcome.turns
    assert sorted(s.side_call for s in segments) == [False, True], segments
    for segment, start in zip(segments, [s.first_turn for s in segments], strict=True):
        text = str(tok.decode(turns[start].output_ids))
        assert (TITLE in text) is segment.side_call, (segment, text)
    assert_each_token_owned_once(result)
    # The preset's [limits] reached the sandbox.
    assert "address_space_bytes=34359738368" in result.outcome.metadata["harness_limits"]


async def test_tiny_model_through_opencode_has_every_token_captured(
        tiny_engine: Any, sandbox_factory: Any, gateway_rig: GatewayRig) -> None:
    result = await model_rollout(
        HarnessHandler(), harness_task("swe", TASKS[0], "opencode"), tiny_engine,
        sandbox_factory=sandbox_factory, gateway=gateway_rig.gateway,
        limits=Limits(max_turns=3, run_timeout_s=240),
        sampling=SamplingParams(temperature=1.0, max_tokens_per_turn=24, seed=11,
                                total_token_budget=16384))
    assert result.capture.requests >= 1, result.outcome.metadata["harness_log"]
    assert_each_token_owned_once(result)


def capped_preset(directory: Path, address_space: int) -> str:
    """The shipped OpenCode preset with ``address_space`` as its only address-space limit,
    written as preset ``opencode-capped`` in ``directory`` (put on $ROLLOUT_HARNESS_PRESETS)."""
    shipped = Path(harness_presets.__file__).with_name("shipped") / "opencode.toml"
    text = re.sub(r"(?m)^address_space\s*=.*\n", "", shipped.read_text())
    line = f"address_space = {address_space}\n"
    text = text.replace("[limits]\n", f"[limits]\n{line}", 1) if "[limits]\n" in text \
        else f"{text}\n[limits]\n{line}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "opencode-capped.toml").write_text(text)
    return "opencode-capped"


async def test_opencode_aborts_at_start_under_3_gib(
        tok: Any, sandbox_factory: Any, gateway_rig: GatewayRig, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The limit is real: under 3 GiB OpenCode dies before its first request, which is the
    service's failure (HARNESS_NOT_STARTED), not a reward 0."""
    monkeypatch.setenv("ROLLOUT_HARNESS_PRESETS", str(tmp_path / "presets"))
    name = capped_preset(tmp_path / "presets", 3 << 30)
    with pytest.raises(HandlerError) as info:
        await opencode(TASKS[0], lambda p: DONE, tok, sandbox_factory, gateway_rig,
                       harness=name)
    assert info.value.reason == "HARNESS_NOT_STARTED", info.value


async def test_the_preset_leaves_opencode_twice_the_address_space_it_needs(
        tok: Any, sandbox_factory: Any, gateway_rig: GatewayRig, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Half of the preset's address space still runs OpenCode's whole session here. Without
    the preset's raise that half is 2 GiB (half the server's default 4 GiB), where it aborts:
    the default leaves no room for a bigger machine's needs."""
    given = harness_presets.resolve("opencode").limits.get(
        "address_space_bytes", SandboxLimits().address_space_bytes)
    monkeypatch.setenv("ROLLOUT_HARNESS_PRESETS", str(tmp_path / "presets"))
    name = capped_preset(tmp_path / "presets", given // 2)
    result = await opencode(TASKS[0], lambda p: DONE, tok, sandbox_factory, gateway_rig,
                            harness=name)
    assert result.capture.requests == 2, result.log  # the title and the main request
    assert result.outcome.termination is TerminationReason.SUBMITTED
    assert f"address_space_bytes={given // 2}" in result.outcome.metadata["harness_limits"]


LIMITS_READ = "OPENCODE-LIMITS-2"  # what the reading prints; its own text says $((1+1))
READ_LIMITS = ("echo OPENCODE-LIMITS-$((1+1)) $(readlink /proc/$PPID/exe) "
               "$(grep 'Max address space' /proc/$PPID/limits)")
"""Run by OpenCode's bash tool, whose parent is OpenCode's own process: that process's
executable and its RLIMIT_AS (soft, hard), as the kernel applies them."""
OPENCODE_NEEDS = 4 << 30
"""RLIMIT_AS OpenCode 1.18.33 needs for its first request on the 2-core test machine (bisected,
see the module docstring); its bash tool needs more again."""


async def test_opencode_runs_under_the_presets_address_space_with_room_to_spare(
        tok: Any, sandbox_factory: Any, gateway_rig: GatewayRig) -> None:
    """The address space OpenCode's own process gets, read from inside through its bash tool,
    is the preset's (as the job's metadata reports it) and at least twice what it needs here,
    and its bash tool works under it.

    Deterministic where a gold fix at the old fixed 4 GiB is not: there OpenCode's need sits
    at the limit, and whether it dies (SIGILL or SIGABRT in JavaScriptCore's allocator, which
    spawning the bash tool's process reaches), its bash tool answers "Out of memory", or it
    squeaks through depends on how much its threads and heap have reserved at that moment,
    which varies with load. Without the preset's raise this test fails whichever happens: no
    reading, or a reading of 4 GiB."""
    read = call("bash", command=READ_LIMITS, description="read the limits")
    result = await opencode(TASKS[0], lambda p: DONE if LIMITS_READ in p else read, tok,
                            sandbox_factory, gateway_rig)
    main = [p for p in result.engine.prompts if not is_title_request(p)]
    assert len(main) == 2 and LIMITS_READ in main[1], (result.log, [p[-1500:] for p in main])
    reading = re.search(LIMITS_READ + r" (\S+) Max address space\s+(\d+)\s+(\d+)\s+bytes",
                        main[1])
    assert reading is not None, main[1][-1500:]
    exe, soft, hard = reading.group(1), int(reading.group(2)), int(reading.group(3))
    assert exe.endswith("/opencode.exe"), exe
    applied = result.outcome.metadata["harness_limits"]
    assert soft == hard and f"address_space_bytes={soft} " in applied, (soft, applied)
    assert soft == harness_presets.resolve("opencode").limits.get("address_space_bytes")
    assert soft >= 2 * OPENCODE_NEEDS, soft
    assert result.outcome.termination is TerminationReason.SUBMITTED
    assert result.outcome.metadata["harness_exit"] == "0"


def test_opencode_starts_in_a_root_that_holds_only_its_install() -> None:
    """Its own loader and C libraries: no /usr, no /lib, nothing of an image (so it runs in a
    task's own image whatever that holds)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    install = harness_presets.resolve("opencode").install
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--tmpfs", "/", "--ro-bind",
            str(install), "/.rollout-harness", "--proc", "/proc", "--dev", "/dev",
            "--tmpfs", "/tmp", "--setenv", "HOME", "/tmp",
            "/.rollout-harness/node_modules/opencode-ai/bin/opencode.exe", *["--version"]]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
