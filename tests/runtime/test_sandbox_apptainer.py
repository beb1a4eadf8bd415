"""Contract test of the Apptainer runtime against a TEST-ONLY stand-in for the CLI.

No apptainer/singularity binary exists on our machines, so ``fake_singularity/singularity``
records every invocation and emulates just enough (it runs commands on the host, isolating
nothing). These tests check that we drive the real CLI through spython with the flags that
provide the isolation (``--containall --writable-tmpfs --no-home``, no network, our binds),
use ``instance start`` + ``exec instance://``, stop the instance on destroy, and fail with an
actionable message when the binary is missing.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout.runtime.sandbox import SandboxConfig, SandboxUnavailable, create_sandbox

pytestmark = pytest.mark.timeout(60)
FAKE_DIR = Path(__file__).parent / "fake_singularity"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[SandboxConfig, Path]]:
    d = Path(tempfile.mkdtemp(prefix="ra", dir="/tmp"))
    log = d / "calls.jsonl"
    image = d / "image.sif"
    image.write_bytes(b"SIF-fake")
    monkeypatch.setenv("PATH", f"{FAKE_DIR}:/usr/local/bin:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_SINGULARITY_LOG", str(log))
    monkeypatch.setenv("FAKE_SINGULARITY_STATE", str(d / "instances"))
    yield SandboxConfig(runtime="apptainer", image=str(image), state_dir=d / "state"), log
    shutil.rmtree(d, ignore_errors=True)


def calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def strip_quiet(argv: list[str]) -> list[str]:
    return [a for a in argv if a != "--quiet"]


async def test_instance_lifecycle_and_exec_contract(fake: tuple[SandboxConfig, Path]) -> None:
    cfg, log = fake
    sb = await create_sandbox(cfg, workspace_files={"a.txt": "hello"}, env={"K": "v"})
    start = next(strip_quiet(c) for c in calls(log) if c[1:3] == ["instance", "start"]
                 or strip_quiet(c)[:2] == ["instance", "start"])
    assert start[:2] == ["instance", "start"]
    for flag in ("--containall", "--writable-tmpfs", "--no-home", "--cleanenv"):
        assert flag in start
    assert start[start.index("--network") + 1] == "none" and "--net" in start
    binds = [start[i + 1] for i, a in enumerate(start) if a == "--bind"]
    assert f"{sb.workspace}:/workspace" in binds
    assert start[-2:] == [cfg.image, f"rollout-{sb.id}"]

    res = await sb.exec("cat a.txt; echo \" $K\"; pwd")
    assert res.exit_code == 0, res
    assert res.stdout == f"hello v\n{sb.workspace}\n"  # the fake maps /workspace to the host
    exec_call = next(c for c in calls(log) if c[0] == "exec")
    assert exec_call[:4] == ["exec", "--cleanenv", "--pwd", "/workspace"]
    assert exec_call[4] == f"instance://rollout-{sb.id}"

    bash = await sb.bash()
    assert (await bash.run("export Y=1; echo $Y")).output == "1\n"

    await sb.destroy()
    assert any(strip_quiet(c)[:2] == ["instance", "stop"] and c[-1] == f"rollout-{sb.id}"
               for c in calls(log))
    assert not sb.workspace.exists()


async def test_loopback_network_omits_the_network_namespace(
        fake: tuple[SandboxConfig, Path]) -> None:
    cfg, log = fake
    async with await create_sandbox(cfg, network="loopback"):
        start = next(strip_quiet(c) for c in calls(log) if "start" in c)
        assert "--net" not in start and "--network" not in start


async def test_failed_instance_start_cleans_up(fake: tuple[SandboxConfig, Path]) -> None:
    cfg, _ = fake
    Path(cfg.image or "").unlink()
    cfg = SandboxConfig(runtime="apptainer", image="docker://missing/image",
                        state_dir=cfg.state_dir)
    with pytest.raises(Exception, match="failed"):
        await create_sandbox(cfg)
    assert [p for p in cfg.sandboxes_dir.iterdir() if not p.name.startswith(".")] == []


async def test_missing_binary_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    cfg = SandboxConfig(runtime="apptainer", image=str(tmp_path / "x.sif"),
                        state_dir=tmp_path / "state")
    with pytest.raises(SandboxUnavailable, match="install Apptainer"):
        await create_sandbox(cfg)


async def test_stop_processes_never_kills_outside_the_instance(
        fake: tuple[SandboxConfig, Path]) -> None:
    """The stand-in CLI runs commands on the host, as an instance without its own PID namespace
    would: the kill(-1) sweep must then do nothing (it would end every process of the host)."""
    import subprocess

    cfg, log = fake
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        sb = await create_sandbox(cfg)
        try:
            await sb.stop_processes()
            assert bystander.poll() is None
            sweeps = [c for c in calls(log) if "guard" in c]
            assert len(sweeps) == 1 and "kill -KILL -1" in " ".join(sweeps[0])
        finally:
            await sb.destroy()
    finally:
        bystander.kill()
        bystander.wait()
