"""Behaviour of the bubblewrap sandbox: exec, files, env, lifetime, crash reaping."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout.runtime.sandbox import (
    SandboxConfig,
    SandboxError,
    SandboxLimits,
    create_sandbox,
    procs,
    reap_stale,
)
from tests.runtime.sandbox_helpers import host_has, temp_config
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def cfg() -> Iterator[SandboxConfig]:
    with temp_config("rt") as config:
        yield config


def sandbox_dirs(cfg: SandboxConfig) -> list[str]:
    root = cfg.sandboxes_dir
    return [e for e in os.listdir(root) if not e.startswith(".")] if root.exists() else []


async def test_exec_runs_in_workspace_with_files_and_env(cfg: SandboxConfig) -> None:
    async with await create_sandbox(cfg, workspace_files={"pkg/a.py": "print(6 * 7)"},
                                    env={"GREETING": "hi"}) as sb:
        res = await sb.exec("pwd; python pkg/a.py; echo $GREETING; echo err >&2; exit 3")
        assert res.exit_code == 3
        assert res.stdout == f"{sb.workspace_in_sandbox}\n42\nhi\n"
        assert res.stderr == "err\n"
        assert not res.timed_out


async def test_server_environment_does_not_leak(cfg: SandboxConfig,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECRET_TOKEN", "s3cr3t")
    async with await create_sandbox(cfg) as sb:
        res = await sb.exec("env")
        assert "s3cr3t" not in res.stdout
        assert "PATH=" in res.stdout


async def test_exec_argv_stdin_and_cwd(cfg: SandboxConfig) -> None:
    async with await create_sandbox(cfg) as sb:
        res = await sb.exec(["cat"], stdin=b"piped\n")
        assert res.stdout == "piped\n"
        res = await sb.exec(["pwd"], cwd="/tmp")
        assert res.stdout == "/tmp\n"


async def test_files_roundtrip_and_shared_tmp(cfg: SandboxConfig) -> None:
    async with await create_sandbox(cfg) as sb:
        await sb.put_file("d/e/f.txt", b"data\xff")
        assert (await sb.exec("cat d/e/f.txt")).stdout == "data\\xff"
        await sb.exec("echo made > out.txt; echo t > /tmp/t")
        assert await sb.get_file("out.txt") == b"made\n"
        assert await sb.get_file(f"{sb.workspace_in_sandbox}/out.txt") == b"made\n"
        # /tmp is shared by all processes of one sandbox
        assert (await sb.exec("cat /tmp/t")).stdout == "t\n"
        with pytest.raises(FileNotFoundError):
            await sb.get_file("missing.txt")


async def test_host_file_api_never_follows_sandbox_symlinks(cfg: SandboxConfig,
                                                            tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("host secret")
    async with await create_sandbox(cfg) as sb:
        # A hostile sandbox plants symlinks pointing at host paths (valid on the host side).
        os.symlink(victim, sb.workspace / "link")
        os.symlink(tmp_path, sb.workspace / "dirlink")
        with pytest.raises(PermissionError):
            await sb.get_file("link")
        with pytest.raises(PermissionError):
            await sb.put_file("link", b"overwritten")
        with pytest.raises(PermissionError):
            await sb.put_file("dirlink/victim.txt", b"overwritten")
        with pytest.raises(PermissionError):
            await sb.get_file("../../etc/passwd")
    assert victim.read_text() == "host secret"


async def test_output_is_capped_with_notice(cfg: SandboxConfig) -> None:
    async with await create_sandbox(cfg) as sb:
        res = await sb.exec("seq 1 200000", max_output=1000)
        assert res.truncated
        assert "bytes of output truncated" in res.stdout
        assert res.stdout.startswith("1\n2\n")
        assert res.stdout.endswith("199999\n200000\n")
        assert len(res.stdout) < 1200


async def test_destroy_is_idempotent_and_removes_everything(cfg: SandboxConfig) -> None:
    sb = await create_sandbox(cfg)
    await sb.exec("sleep 60 &")
    path = sb.workspace.parent
    assert path.exists()
    await sb.destroy()
    await sb.destroy()
    assert not path.exists()
    assert sandbox_dirs(cfg) == []
    with pytest.raises(SandboxError):
        await sb.exec("true")


async def test_context_manager_destroys_on_error(cfg: SandboxConfig) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        async with await create_sandbox(cfg):
            assert len(sandbox_dirs(cfg)) == 1
            raise RuntimeError("boom")
    assert sandbox_dirs(cfg) == []


async def test_cancelled_exec_kills_the_command(cfg: SandboxConfig) -> None:
    marker = f"cancelme{os.getpid()}"
    async with await create_sandbox(cfg) as sb:
        task = asyncio.create_task(sb.exec(f"exec -a {marker} sleep 300"))
        await assert_eventually(lambda: host_has(marker))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_eventually(lambda: not host_has(marker))


async def test_cancelled_creation_leaves_nothing(cfg: SandboxConfig) -> None:
    for delay in (0, 0.001, 0.003, 0.01):
        task = asyncio.create_task(create_sandbox(cfg, workspace_files={"a": "b"}))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            sb = await task
        except asyncio.CancelledError:
            continue
        await sb.destroy()  # finished before the cancel landed
    await assert_eventually(lambda: sandbox_dirs(cfg) == [])


async def test_unknown_option_and_bad_network_are_rejected(cfg: SandboxConfig) -> None:
    with pytest.raises(SandboxError):
        await create_sandbox(cfg, network="internet")  # type: ignore[arg-type]
    with pytest.raises(SandboxError, match="unknown sandbox options"):
        await create_sandbox(cfg, colour="red")
    assert sandbox_dirs(cfg) == []


async def test_rootfs_directory_becomes_the_root(cfg: SandboxConfig, tmp_path: Path) -> None:
    """A minimal rootfs (dash + setpriv and their libraries) replaces the host root."""
    rootfs = tmp_path / "rootfs"
    for binary in ("/bin/dash", "/usr/bin/setpriv"):
        out = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
        libs = [w for w in out.split() if w.startswith("/")]
        for f in (binary, *libs):
            real = os.path.realpath(f)
            for dest in {f, real}:
                target = rootfs / dest.lstrip("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                if not target.exists():
                    shutil.copy2(real, target)
    (rootfs / "bin" / "sh").unlink(missing_ok=True)
    os.symlink("dash", rootfs / "bin" / "sh")
    (rootfs / "etc").mkdir()
    (rootfs / "etc" / "rootfs-marker").write_text("mine\n")
    async with await create_sandbox(cfg, rootfs=rootfs) as sb:
        res = await sb.exec(["/bin/sh", "-c", "read m < /etc/rootfs-marker; echo $m; "
                             "test -e /work && echo has-work; test -e /usr/bin/python3 "
                             "&& echo has-python; echo x > /etc/new || echo ro"])
        assert res.stdout == "mine\nro\n", res


async def test_reap_stale_cleans_after_a_crashed_server(cfg: SandboxConfig) -> None:
    """A server process is SIGKILLed with a live sandbox; start-up reaping removes it."""
    marker = f"orphan{os.getpid()}"
    script = textwrap.dedent(f"""
        import asyncio, sys
        from pathlib import Path
        from rollout.runtime.sandbox import SandboxConfig, create_sandbox
        async def main():
            sb = await create_sandbox(SandboxConfig(state_dir=Path({str(cfg.state_dir)!r})))
            proc = await asyncio.create_subprocess_exec(
                *sb.command_argv(["bash", "-c", "exec -a {marker} sleep 300"]),
                env=sb.spawn_env())
            print("ready", flush=True)
            await asyncio.sleep(300)
        asyncio.run(main())
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    server = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
    try:
        assert server.stdout is not None
        assert (await asyncio.to_thread(server.stdout.readline)).strip() == b"ready"
        await assert_eventually(lambda: host_has(marker))
        live = await asyncio.to_thread(reap_stale, cfg.sandboxes_dir)
        assert len(live.live) == 1 and not live.removed  # still owned: must not be touched
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()
    await assert_eventually(lambda: not host_has(marker))  # --die-with-parent
    report = await asyncio.to_thread(reap_stale, cfg.sandboxes_dir)
    assert len(report.removed) == 1
    assert sandbox_dirs(cfg) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="per-sandbox uids need a root server")
async def test_reaper_kills_leftover_processes_of_a_dead_sandbox_uid(
        cfg: SandboxConfig) -> None:
    sandbox_dir = cfg.sandboxes_dir / "deadbeef0000"
    sandbox_dir.mkdir(parents=True)
    uid = cfg.uid_base + cfg.uid_count + 7  # outside the range live sandboxes draw from
    (sandbox_dir / "meta.json").write_text(f'{{"uid": {uid}}}')
    stray = subprocess.Popen(["sleep", "300"], user=uid, group=uid, extra_groups=[])
    try:
        report = await asyncio.to_thread(reap_stale, cfg.sandboxes_dir)
        assert report.removed == ["deadbeef0000"]
        assert uid in report.killed_uids
        assert await asyncio.to_thread(stray.wait, 10) == -signal.SIGKILL
        assert not procs.uid_has_processes(uid)
    finally:
        stray.kill()
        stray.wait()


async def test_wall_clock_timeout_default_from_limits(cfg: SandboxConfig) -> None:
    async with await create_sandbox(cfg, limits=SandboxLimits(default_timeout_s=0.5)) as sb:
        res = await sb.exec("sleep 30")
        assert res.timed_out
        assert res.exit_code == 128 + signal.SIGKILL
        assert "timed out" in res.stderr


async def test_works_as_job_context_sandbox_factory(cfg: SandboxConfig) -> None:
    import functools

    from rollout.runtime.handler import JobContext
    from rollout.runtime.types import JobSpec

    ctx = JobContext(spec=JobSpec(job_id="j1", environment="test", task={}),
                     sandbox_factory=functools.partial(create_sandbox, cfg))
    sb = await ctx.open_sandbox(workspace_files={"x": "1"}, network="none")
    assert (await sb.exec("cat x")).stdout == "1"
    await ctx.resources.aclose()  # what the scheduler does when the job ends
    assert sb.destroyed and sandbox_dirs(cfg) == []
