"""A musl image (Alpine-like: busybox, musl's loader and libc, no glibc) as a bwrap sandbox's
root, built offline by the ``musl_layout`` fixture (the mirror has no Alpine).

The sandbox's own tools do not need the image's C library (the persistent bash falls back to
the static one under ``/.rollout``, the editor and the in-sandbox scripts run on the server's
interpreter through its own loader), so they work there as in any image; a program linked
against musl runs. The harness environment's INIT check of a harness's program
(``in_sandbox/harness_program.py``, run in the image's root) accepts a musl-linked program
there and refuses a glibc-linked one, naming the loader it needs; in an image without musl it
refuses the musl-linked one the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.common import SANDBOX_KEY
from rollout.runtime.envs.harness.handler import check_program
from rollout.runtime.envs.harness.presets import HarnessSpec
from rollout.runtime.handler import JobContext
from rollout.runtime.sandbox import SandboxConfig, create_sandbox
from rollout.runtime.sandbox.base import ImageSettings
from rollout.runtime.sandbox.images import ImageError
from rollout.runtime.tools.editor import EditorTool
from rollout.runtime.types import JobSpec
from tests.fixtures.images import GLIBC_LOADER, MUSL_LOADER

pytestmark = pytest.mark.timeout(180)


async def image_sandbox(tmp_path: Path, ref: str) -> Any:
    settings = ImageSettings(cache_dir=str(tmp_path / "cache"))
    return await create_sandbox(SandboxConfig(state_dir=tmp_path / "state", images=settings),
                                image=ref)


async def init_check(sandbox: Any, *command: str) -> None:
    """The harness environment's INIT check of a harness whose command is ``command``."""
    ctx = JobContext(spec=JobSpec(job_id="musl", environment="harness", task={}))
    ctx.state[SANDBOX_KEY] = sandbox
    await check_program(ctx, HarnessSpec(name="c-agent", command=command, install=None))


async def test_the_sandbox_tools_and_a_musl_program_work_in_a_musl_image(
        tmp_path: Path, musl_layout: Path) -> None:
    async with await image_sandbox(tmp_path, f"oci:{musl_layout}:musl") as sb:
        r = await sb.exec(["sh", "-c", f"test -f {MUSL_LOADER} && test ! -e {GLIBC_LOADER} "
                           "&& test ! -e /usr/lib/x86_64-linux-gnu && echo musl-only"])
        assert r.stdout.strip() == "musl-only", r.output
        r = await sb.exec(["hello-musl", "musl"])
        assert r.ok and r.stdout == "hello from musl\n", r.output
        # The glibc twin cannot start: the kernel finds no loader for it.
        r = await sb.exec(["sh", "-c", "hello-glibc glibc; echo exit=$?"])
        assert "hello from" not in r.stdout and "exit=127" in r.stdout, r.output
        # The image has no bash: the persistent shell is the static one under /.rollout.
        bash = await sb.bash()
        out = await bash.run("cd /tmp && export WHO=bash && hello-musl $WHO > said.txt")
        assert out.exit_code == 0, out.output
        assert (await bash.run("pwd; cat said.txt")).output.split() == [
            "/tmp", "hello", "from", "bash"]
        editor = EditorTool(sb)
        created = await editor({"command": "create", "path": "/workspace/notes.txt",
                                "file_text": "musl\n"})
        assert not created.is_error, created.output
        edited = await editor({"command": "str_replace", "path": "/workspace/notes.txt",
                               "old_str": "musl", "new_str": "musl edited"})
        assert not edited.is_error, edited.output
        assert (await bash.run("cat /workspace/notes.txt")).output.strip() == "musl edited"


async def test_the_init_check_takes_a_musl_program_and_refuses_a_glibc_one_in_a_musl_image(
        tmp_path: Path, musl_layout: Path) -> None:
    ref = f"oci:{musl_layout}:musl"
    async with await image_sandbox(tmp_path, ref) as sb:
        await init_check(sb, "/usr/local/bin/hello-musl", "--task", "t")
        await init_check(sb, "env", "X=1", "hello-musl")  # a bare name, on the image's PATH
        with pytest.raises(ImageError) as refused:
            await init_check(sb, "hello-glibc")
    assert refused.value.reason == "IMAGE_REJECTED" and refused.value.task_fault
    message = str(refused.value)
    assert message.startswith(f"harness 'c-agent' cannot start in image {ref}"), message
    assert f"/usr/local/bin/hello-glibc needs {GLIBC_LOADER}" in message, message
    assert "musl" in message  # the message says what kind of image lacks it


async def test_a_musl_program_is_refused_in_an_image_without_musl(
        tmp_path: Path, musl_layout: Path) -> None:
    async with await image_sandbox(tmp_path, f"oci:{musl_layout}:bare") as sb:
        r = await sb.exec(["sh", "-c", "hello-musl; echo exit=$?"])
        assert "hello from" not in r.stdout and "exit=127" in r.stdout, r.output
        with pytest.raises(ImageError) as refused:
            await init_check(sb, "hello-musl")
    assert f"/usr/local/bin/hello-musl needs {MUSL_LOADER}" in str(refused.value)
