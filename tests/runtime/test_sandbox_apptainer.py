"""Contract test of the Apptainer runtime against a TEST-ONLY stand-in for the CLI.

No apptainer/singularity binary exists on our machines, so ``fake_singularity/singularity``
records every invocation and emulates just enough (it runs commands on the host, isolating
nothing). These tests check that we drive the real CLI with the flags that provide the
isolation (``--containall --writable-tmpfs --no-home``, no network, our binds) and the bounds
(rlimits, the memory cgroup, cgroup flags, the disk quota), use ``instance start`` + ``exec
instance://``, stop the instance on destroy, and fail with an actionable message when the
binary is missing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.sandbox import (
    SandboxConfig,
    SandboxLimits,
    SandboxUnavailable,
    apptainer,
    create_sandbox,
    hardening,
)

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
    # No admin-configured host directory (apptainer.conf "bind path") reaches a job.
    assert start[start.index("--no-mount") + 1] == "hostfs,bind-paths"
    binds = [start[i + 1] for i, a in enumerate(start) if a == "--bind"]
    assert f"{sb.workspace}:/workspace" in binds
    assert start[-2:] == [cfg.image, f"rollout-{sb.id}"]

    res = await sb.exec("cat a.txt; echo \" $K\"; pwd")
    assert res.exit_code == 0, res
    assert res.stdout == f"hello v\n{sb.workspace}\n"  # the fake maps /workspace to the host
    exec_call = [a for a in next(c for c in calls(log) if c[0] == "exec") if a != "--no-privs"]
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


# -- bounds: the same limits as bwrap, where Apptainer can take them ---------------------------


def limits_seen(log: Path) -> list[dict[str, Any]]:
    """What each CLI invocation ran under, as the stand-in itself read it from the kernel."""
    path = Path(f"{log}.limits")
    return [json.loads(line) for line in path.read_text().splitlines()]


def group_name(cfg: SandboxConfig) -> str:
    return hardening.GROUP_PREFIX + hardening._state_hash(os.path.abspath(cfg.state_dir))


async def test_instance_and_launches_run_under_the_sandbox_limits(
        fake: tuple[SandboxConfig, Path]) -> None:
    base, log = fake
    limits = SandboxLimits(open_files=321, address_space_bytes=3 << 30, processes=77)
    cfg = dataclasses.replace(base, limits=limits)
    async with await create_sandbox(cfg) as sb:
        res = await sb.exec("ulimit -n; ulimit -v")
        assert res.stdout.split() == ["321", str((3 << 30) // 1024)], res
        argv = sb.command_argv(["true"])
        assert argv[argv.index("prlimit") + 1:argv.index("--")] == limits.prlimit_args()
    seen = limits_seen(log)
    start = next(s for s in seen if strip_quiet(s["argv"])[:2] == ["instance", "start"])
    # The instance's own processes start under the rlimits too, not only exec'd commands.
    assert (start["nofile"], start["as"]) == (321, 3 << 30)
    opts = strip_quiet(start["argv"])
    if apptainer.cgroup_limits_possible():
        assert opts[opts.index("--memory") + 1] == str(3 << 30)
        assert opts[opts.index("--memory-swap") + 1] == str(3 << 30)  # memory + swap: no swap
        assert opts[opts.index("--pids-limit") + 1] == "77"
    if os.geteuid() == 0:
        assert "--no-privs" in opts
        assert all("--no-privs" in s["argv"] for s in seen if s["argv"][:1] == ["exec"])
    if hardening._memory_root() is not None:
        # Instance start and every launch joined the state dir's shared memory cgroup.
        for s in seen:
            if s["argv"][:1] == ["exec"] or strip_quiet(s["argv"])[:2] == ["instance", "start"]:
                assert any(line.endswith("/" + group_name(cfg)) for line in s["cgroups"]), s


async def test_no_cgroup_flags_when_the_memory_cap_is_off(
        fake: tuple[SandboxConfig, Path]) -> None:
    base, log = fake
    cfg = dataclasses.replace(base, memory_bytes=-1)
    async with await create_sandbox(cfg):
        pass
    start = next(strip_quiet(c) for c in calls(log) if strip_quiet(c)[:2] == ["instance", "start"])
    assert not {"--memory", "--memory-swap", "--pids-limit"} & set(start)
    assert all(not any(line.endswith("/" + group_name(cfg)) for line in s["cgroups"])
               for s in limits_seen(log))


@pytest.mark.skipif(os.geteuid() != 0, reason="the disk quota needs a root server")
async def test_workspace_and_tmp_are_a_size_limited_tmpfs(
        fake: tuple[SandboxConfig, Path]) -> None:
    base, _ = fake
    cfg = dataclasses.replace(base, disk_bytes=8 << 20)
    sb = await create_sandbox(cfg)
    try:
        assert str(sb.path) in mounted(cfg.sandboxes_dir)
        # The binds of /workspace and /tmp come from that tmpfs: 8 MiB for both together.
        for sub in ("workspace", "tmp"):
            st = os.statvfs(sb.path / sub)
            assert st.f_blocks * st.f_frsize == 8 << 20
        res = await sb.exec("head -c 12M /dev/zero > big; echo $?")
        assert res.stdout.strip() != "0" and "No space left" in res.stderr, res
    finally:
        await sb.destroy()
    assert mounted(cfg.sandboxes_dir) == [] and not sb.path.exists()


def mounted(below: Path) -> list[str]:
    prefix = os.path.realpath(below) + "/"
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(prefix)]
