"""Harness jobs in a task's own image without glibc: the fixtures' busybox image (one static
busybox and its applet links, no loader, no libc, no bash) and musl image (the same plus musl's
loader and libc, as Alpine has them), a Harbor task on each.

Claude Code, OpenCode and aider bring their own loader and C libraries under their install
(scripts/harness_loader.py) and the image sandbox brings a static bash under ``/.rollout`` (the
shell tools' shell), so they run there as anywhere: the task's gold step through Claude Code's
or OpenCode's shell tool, or aider's edit, earns 1. A harness whose
program is linked against the image's glibc (mini-swe-agent's venv interpreter) cannot start
there: INIT refuses it, naming the task, the image and the missing loader, as the task's fault
(an ``ImageError``, so a FAILED job with ``INVALID_TASK``), instead of an exit 127 at RUN that
would read as the service's ``HARNESS_NOT_STARTED``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.harbor import taskdir
from rollout.runtime.envs.harness import presets as harness_presets
from rollout.runtime.envs.harness.handler import HarnessHandler
from rollout.runtime.handler import JobContext
from rollout.runtime.sandbox.base import ImageSettings
from rollout.runtime.tasksets import harbor_import
from rollout.runtime.types import JobSpec, Limits, TerminationReason
from tests.fixtures.images import GLIBC_LOADER, MUSL_LOADER
from tests.runtime.envs.conftest import call
from tests.runtime.envs.harbor_helpers import image_factory
from tests.runtime.envs.harness_helpers import GatewayRig, harness_task, routed_rollout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TEST = """#!/bin/sh
mkdir -p /logs/verifier
if [ "$(cat /tmp/hello.txt 2>/dev/null)" = "hello" ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""
WROTE = "WROTE-2"  # what the gold step prints; its own text says $((1+1))


def busybox_task(top: Path, layout: Path, tag: str = "bb") -> dict[str, Any]:
    folder = top / "hello-busybox"
    for sub in ("solution", "tests"):
        (folder / sub).mkdir(parents=True)
    (folder / "instruction.md").write_text("Write hello to /tmp/hello.txt.\n")
    (folder / "solution" / "solve.sh").write_text("#!/bin/sh\necho hello > /tmp/hello.txt\n")
    (folder / "tests" / "test.sh").write_text(TEST)
    (folder / "task.toml").write_text(
        'version = "1.0"\n[agent]\ntimeout_sec = 120.0\n[verifier]\ntimeout_sec = 60.0\n'
        f'[environment]\ndocker_image = "oci:{layout}:{tag}"\n')
    return dict(harbor_import.job_line(taskdir.load(folder))["task"])


@pytest.fixture
def factory(tmp_path: Path) -> Any:
    return image_factory(tmp_path / "state", ImageSettings(cache_dir=str(tmp_path / "cache")))


def image_layout(request: pytest.FixtureRequest, image: str) -> tuple[Path, str]:
    """The fixtures' busybox image (static busybox alone) or musl image (busybox, musl's
    loader and libc, a musl-linked ``hello-musl``): its layout and tag."""
    if image == "busybox":
        return request.getfixturevalue("busybox_layout"), "bb"
    return request.getfixturevalue("musl_layout"), "musl"


def installed(name: str) -> None:
    try:
        harness_presets.resolve(name)
    except Exception as e:  # the message says what to run
        pytest.skip(f"{name} is not installed: {e}")


IN_THE_IMAGE = {
    "busybox": f"test ! -e {GLIBC_LOADER} && test ! -e /usr",
    # The musl image: its loader, no glibc's, and a program of the image linked against musl.
    "musl": f"test -f {MUSL_LOADER} && test ! -e {GLIBC_LOADER} && hello-musl claude",
}
"""What the gold step checks of the root it runs in."""


SHELL_TOOL = {"claude-code": "Bash", "opencode": "bash"}
"""Each harness's shell tool, which runs the gold step."""


def is_side_call(harness: str, prompt: str) -> bool:
    """OpenCode's session-title request, beside its main thread."""
    return harness == "opencode" and "You are a title generator" in prompt


@pytest.mark.parametrize("image", IN_THE_IMAGE)
@pytest.mark.parametrize("harness", SHELL_TOOL)
async def test_a_harness_with_its_own_runtime_runs_in_an_image_without_glibc(
        tmp_path: Path, harness: str, image: str, factory: Any, tok: Any,
        gateway_rig: GatewayRig, request: pytest.FixtureRequest) -> None:
    installed(harness)
    layout, tag = image_layout(request, image)
    task = busybox_task(tmp_path / "tasks", layout, tag)
    # The gold step writes the answer only where the image is what it says: a reward of 1 says
    # the harness and its shell tool ran in the image's own root.
    gold = call(SHELL_TOOL[harness], command=f"{IN_THE_IMAGE[image]} && "
                "echo hello > /tmp/hello.txt && echo WROTE-$((1+1))", description="write it")

    def choose(prompt: str) -> str:
        if is_side_call(harness, prompt):
            return "Write hello"
        return "Done." if WROTE in prompt else gold

    result = await routed_rollout(
        HarnessHandler(), harness_task("harbor", task, harness), choose, tokenizer=tok,
        sandbox_factory=factory, gateway=gateway_rig.gateway,
        limits=Limits(max_turns=6, run_timeout_s=120))
    assert result.reward.value == 1.0, (result.reward.info, result.log)
    main = [p for p in result.engine.prompts if not is_side_call(harness, p)]
    assert len(main) == 2 and WROTE in main[1], result.log
    assert result.outcome.termination is TerminationReason.SUBMITTED


AIDER_EDIT = ("Here it is.\n\n```diff\n--- /dev/null\n+++ /tmp/hello.txt\n@@ -0,0 +1 @@\n"
              "+hello\n```\n")
"""aider's udiff edit that creates the answer (aider runs no commands of the model's)."""


@pytest.mark.parametrize("image", IN_THE_IMAGE)
async def test_aider_edits_in_an_image_without_glibc(
        tmp_path: Path, image: str, factory: Any, tok: Any, gateway_rig: GatewayRig,
        request: pytest.FixtureRequest) -> None:
    """aider (its own interpreter and C runtime) starts in the image's root and applies the
    reply's edit there, where the task's verifier finds it."""
    installed("aider")
    layout, tag = image_layout(request, image)
    task = busybox_task(tmp_path / "tasks", layout, tag)
    result = await routed_rollout(
        HarnessHandler(), harness_task("harbor", task, "aider"), lambda p: AIDER_EDIT,
        tokenizer=tok, sandbox_factory=factory, gateway=gateway_rig.gateway,
        limits=Limits(max_turns=4, run_timeout_s=120))
    assert result.reward.value == 1.0, (result.reward.info, result.log)
    assert result.capture.requests == 1, result.log
    log = result.outcome.metadata["harness_log"]
    assert "Applied edit to /tmp/hello.txt" in log
    # The preset's model-table cache: aider asks nothing of the internet.
    assert "raw.githubusercontent.com" not in log, log
    assert result.outcome.metadata["harness_exit"] == "0"


@pytest.mark.parametrize("image", ["busybox", "musl"])
async def test_a_harness_that_needs_the_images_glibc_is_refused_at_init(
        tmp_path: Path, image: str, factory: Any, tok: Any, gateway_rig: GatewayRig,
        request: pytest.FixtureRequest) -> None:
    """Through the pipeline's INIT stage: a FAILED job, the task's fault (``INVALID_TASK``),
    whose message names the task, the harness, the image, the program and the loader. The
    same in a musl image (the ``musl_layout`` fixture: musl's loader and libc, no glibc)."""
    from rollout.server.pipeline.stages import Stage, run_stage

    installed("mini-swe-agent")
    layout, tag = image_layout(request, image)
    task = harness_task("harbor", busybox_task(tmp_path / "tasks", layout, tag),
                        "mini-swe-agent")
    spec = JobSpec(job_id="glibc-less", environment="harness", task=task,
                   limits=Limits(max_turns=6, run_timeout_s=120))
    ctx = JobContext(spec=spec, llm=None, sandbox_factory=factory,
                     gateway=gateway_rig.gateway)
    handler = HarnessHandler()
    async with ctx.resources:
        try:
            result = await run_stage(handler, ctx, Stage.INIT, 120)
        finally:
            await handler.cleanup(ctx)
    error = result.error
    assert error is not None and (error.code, error.reason) == (
        "INVALID_TASK", "IMAGE_REJECTED"), error
    assert error.message.startswith("task 'hello-busybox' (harness): harness 'mini-swe-agent'"), \
        error.message
    assert f"oci:{layout}:{tag}" in error.message, error.message
    assert f"/.rollout-harness/bin/python needs {GLIBC_LOADER}" in error.message, error.message
