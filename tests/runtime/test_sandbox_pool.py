"""The warm sandbox pool: each ready sandbox goes to one job only and never comes back; a job
gets its own files and environment in it, and its first command runs in the parked launch;
only plain shapes are pooled; the pool stays within its count and memory bounds, shrinks when
idle, is empty after close and after a server stop, and what a SIGKILLed server's pool left
is swept by the next start."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollout.runtime.sandbox import SandboxConfig, create_sandbox
from rollout.runtime.sandbox.bwrap import BwrapSandbox
from rollout.runtime.sandbox.pool import PoolSettings, SandboxPool, Shape
from tests.runtime.sandbox_helpers import temp_config
from tests.util import assert_eventually, mounts_below, scaled

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def cfg() -> object:
    with temp_config("rpool") as c:
        yield c


@pytest.fixture
async def pool(cfg: SandboxConfig) -> AsyncIterator[SandboxPool]:
    p = SandboxPool(cfg, PoolSettings(size=2))
    try:
        yield p
    finally:
        await p.close()


def entries(cfg: SandboxConfig) -> list[str]:
    root = cfg.sandboxes_dir
    return sorted(e for e in os.listdir(root) if not e.startswith(".")) if root.exists() else []


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


async def test_each_ready_sandbox_goes_to_one_job_and_never_back(
        cfg: SandboxConfig, pool: SandboxPool) -> None:
    pool.start()
    seen_ids: set[str] = set()
    seen_pids: set[int] = set()
    taken: list[BwrapSandbox] = []
    for k in range(5):
        await assert_eventually(lambda: pool.ready_count() == 2, timeout=60)
        ready_ids = {sb.id for lane in pool._lanes.values() for sb, _ in lane.ready}
        sb = await create_sandbox(cfg, pool=pool, workspace_files={"task.txt": f"job {k}"},
                                  env={"JOB": str(k)})
        assert isinstance(sb, BwrapSandbox)
        assert sb.id in ready_ids, "taken from the pool, not made cold"
        assert sb.id not in seen_ids and sb.parked_pid not in seen_pids
        seen_ids.add(sb.id)
        seen_pids.add(sb.parked_pid or -1)
        taken.append(sb)
        assert all(s.id != sb.id for lane in pool._lanes.values() for s, _ in lane.ready)
    # Concurrent takes: never the same one twice.
    await assert_eventually(lambda: pool.ready_count() == 2, timeout=60)
    many = await asyncio.gather(*(create_sandbox(cfg, pool=pool) for _ in range(4)))
    ids = [sb.id for sb in many]
    assert len(set(ids)) == 4 and not set(ids) & seen_ids
    assert pool.stats().taken >= 7
    # The job's files and environment are there, and its first command runs in the parked
    # launch (whose process ends with the command), as the sandbox's own uid.
    for k, sb in enumerate(taken):
        parked = sb.parked_pid
        res = await sb.exec("cat task.txt; echo \" $JOB\"; id -u")
        assert res.ok, res
        lines = res.stdout.splitlines()
        assert lines[0] == f"job {k} {k}"
        if os.geteuid() == 0:
            assert int(lines[1]) == (sb.owner() or (0, 0))[0] != 0
        assert sb.parked_pid is None and parked is not None and not alive(parked)
        again = await sb.exec(["cat", "task.txt"])  # later commands: ordinary launches
        assert again.stdout == f"job {k}"
    for sb in [*taken, *many]:
        await sb.destroy()
    await assert_eventually(lambda: pool.ready_count() == 2, timeout=60)
    ready_ids = {sb.id for lane in pool._lanes.values() for sb, _ in lane.ready}
    assert not ready_ids & (seen_ids | set(ids)), "a destroyed sandbox came back"
    assert set(entries(cfg)) == ready_ids


async def test_stdin_cwd_timeout_and_a_missing_command_in_the_parked_launch(
        cfg: SandboxConfig, pool: SandboxPool) -> None:
    pool.start()
    await assert_eventually(lambda: pool.ready_count() == 2, timeout=60)
    first = await create_sandbox(cfg, pool=pool)
    res = await first.exec("pwd; cat", stdin=b"fed", cwd="/tmp")
    assert (res.exit_code, res.stdout) == (0, "/tmp\nfed")
    await first.destroy()
    second = await create_sandbox(cfg, pool=pool)
    missing = await second.exec(["no-such-command-here"])
    assert missing.exit_code == 127 and "no-such-command-here" in missing.stderr
    await second.destroy()
    await assert_eventually(lambda: pool.ready_count() >= 1, timeout=60)
    third = await create_sandbox(cfg, pool=pool)
    slow = await third.exec("sleep 30", timeout=0.3)
    assert slow.timed_out
    await third.destroy()


async def test_only_plain_shapes_are_pooled(cfg: SandboxConfig, pool: SandboxPool,
                                            tmp_path: Path) -> None:
    pool.start()
    await assert_eventually(lambda: pool.ready_count() == 2, timeout=60)
    ready_ids = {sb.id for lane in pool._lanes.values() for sb, _ in lane.ready}
    (tmp_path / "data").mkdir()
    differing = [
        await create_sandbox(cfg, pool=pool, binds=[(str(tmp_path / "data"), "/data", False)]),
        await create_sandbox(cfg, pool=pool, rootfs="/"),
        await create_sandbox(SandboxConfig(state_dir=cfg.state_dir, seccomp=False),
                             pool=pool),
    ]
    for sb in differing:
        assert sb.id not in ready_ids
        await sb.destroy()
    assert pool.ready_count() == 2 and pool.stats().taken == 0
    assert pool.shape_for(cfg, {"network": "loopback"}) == Shape("loopback", cfg.limits)
    assert pool.shape_for(cfg, {"image": "x"}) is None
    imaged = SandboxConfig(state_dir=cfg.state_dir, image="docker://busybox")
    assert SandboxPool(imaged, PoolSettings(size=2)).shape_for(imaged, {}) is None


async def test_bounded_by_memory(cfg: SandboxConfig) -> None:
    tight = SandboxPool(cfg, PoolSettings(size=3, memory_bytes=1, idle_s=3600))
    try:
        tight.start()
        await assert_eventually(lambda: tight.stats().made >= 1, timeout=60)
        assert tight.stats().rss_bytes > 0
        await asyncio.sleep(scaled(1.0))
        assert tight.stats().made == 1 and tight.ready_count() == 1, \
            "the memory bound stops the filling at one"
    finally:
        await tight.close()


async def test_emptied_when_idle(cfg: SandboxConfig) -> None:
    idle = SandboxPool(cfg, PoolSettings(size=2, idle_s=1.0))
    try:
        idle.start()
        await assert_eventually(lambda: idle.stats().made >= 1, timeout=60)
        # Nobody takes: the shape is emptied, its sandboxes destroyed, and it is not refilled.
        await assert_eventually(lambda: idle.ready_count() == 0 and not entries(cfg)
                                and idle.stats().destroyed_idle >= 1, timeout=60)
        made = idle.stats().made
        await asyncio.sleep(scaled(1.5))
        assert idle.stats().made == made and not entries(cfg)
    finally:
        await idle.close()


async def test_close_destroys_every_ready_sandbox(cfg: SandboxConfig) -> None:
    pool = SandboxPool(cfg, PoolSettings(size=3))
    pool.start()
    await assert_eventually(lambda: pool.ready_count() == 3, timeout=60)
    pids = [sb.parked_pid for lane in pool._lanes.values() for sb, _ in lane.ready]
    await pool.close()
    assert entries(cfg) == [] and mounts_below(Path(cfg.state_dir)) == []
    assert not any(pid is not None and alive(pid) for pid in pids)
    cold = await create_sandbox(cfg, pool=pool)  # closed: made cold
    await cold.destroy()
    assert pool.ready_count() == 0 and entries(cfg) == []


def _serve(state: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "rollout.entrypoints.cli", "serve", "--state-dir", str(state),
         "--port", "0", "--set", "llm.backends=[]", "--set", "sandbox.pool_size=2"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _launch_pids(state: Path) -> list[int]:
    needle = str(state / "sandboxes").encode()
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if needle in f.read():
                        found.append(int(pid))
            except OSError:
                continue
    return found


async def test_a_sigkilled_servers_pool_is_swept_by_the_next_start_which_empties_its_own(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = SandboxConfig(state_dir=state)
    proc = _serve(state)
    try:
        assert proc.stdout is not None
        line = await asyncio.to_thread(proc.stdout.readline)
        assert "listening on" in line, line
        await assert_eventually(lambda: len(entries(cfg)) == 2 and len(_launch_pids(state)) >= 2,
                                timeout=60)
        before = set(entries(cfg))
        launches = _launch_pids(state)
    finally:
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait)
    # --die-with-parent ends the parked launches; their directories and mounts stay.
    await assert_eventually(lambda: not any(alive(p) for p in launches), timeout=30)
    assert set(entries(cfg)) == before
    second = _serve(state)
    try:
        assert second.stdout is not None
        line = await asyncio.to_thread(second.stdout.readline)
        assert "listening on" in line, line
        await assert_eventually(lambda: len(entries(cfg)) == 2, timeout=60)
        assert not set(entries(cfg)) & before, "the start-up sweep removed the dead pool's"
        if os.geteuid() == 0:
            mounted = {Path(m).name for m in mounts_below(state / "sandboxes")}
            assert not mounted & before
    finally:
        second.send_signal(signal.SIGTERM)  # a graceful stop empties the pool
        await asyncio.to_thread(second.wait, scaled(60))
    assert second.returncode == 0
    assert entries(cfg) == [] and mounts_below(state) == []


def test_the_pool_keys_reach_the_factory_and_bad_values_are_refused(tmp_path: Path) -> None:
    from rollout.runtime.types import InvalidArgument
    from rollout.server.app import build_sandbox_factory, sandbox_pool_of
    from rollout.server.config import load_config

    plain = load_config(None, [f"server.state_dir={tmp_path}"], environ={})
    assert sandbox_pool_of(build_sandbox_factory(plain)) is None, "off by default"
    cfg = load_config(None, [f"server.state_dir={tmp_path}", "sandbox.pool_size=3",
                             "sandbox.pool_memory_bytes=1000000", "sandbox.pool_idle_s=5",
                             'sandbox.pool_tools=["bash"]'], environ={})
    factory = build_sandbox_factory(cfg)
    pool = sandbox_pool_of(factory)
    assert isinstance(pool, SandboxPool) and pool.config is factory.args[0]
    assert pool.settings == PoolSettings(size=3, memory_bytes=1_000_000, idle_s=5.0,
                                         tools=("bash",))
    for bad, key in (("sandbox.pool_size=-1", "sandbox.pool_size"),
                     ('sandbox.pool_tools=["editor"]', "sandbox.pool_tools")):
        with pytest.raises(InvalidArgument) as err:
            load_config(None, [bad], environ={})
        assert err.value.reason == "BAD_CONFIG" and err.value.field == key


async def test_a_servers_jobs_take_pooled_sandboxes_and_its_stop_leaves_nothing(
        tmp_path: Path) -> None:
    from rollout.runtime.handler import AgentHandler, HandlerRegistry, JobContext, RunOutcome
    from rollout.runtime.types import Reward, TerminationReason, Turn
    from rollout.server.app import Server, sandbox_pool_of
    from tests.client.conftest import make_config
    from tests.server.handlers import spec

    seen: dict[str, tuple[str, set[str], str]] = {}

    class PoolInit(AgentHandler):
        name = "poolinit"

        async def init(self, ctx: JobContext) -> None:
            pool = sandbox_pool_of(ctx.sandbox_factory)
            ready = {sb.id for lane in pool._lanes.values() for sb, _ in lane.ready}
            sb = await ctx.open_sandbox(workspace_files={"task.txt": ctx.spec.job_id},
                                        env={"JOB": ctx.spec.job_id})
            res = await sb.exec('cat task.txt; echo " $JOB"')
            seen[ctx.spec.job_id] = (sb.id, ready, res.stdout)

        async def run(self, ctx: JobContext) -> RunOutcome:
            return RunOutcome(turns=[Turn([1], [2], [-0.1])],
                              termination=TerminationReason.NO_TOOL_CALL)

        async def eval(self, ctx: JobContext) -> Reward:
            return Reward(1.0)

    state = tmp_path / "state"
    cfg = make_config(state)
    cfg.sandbox.pool_size = 2
    registry = HandlerRegistry()
    registry.register("poolinit", PoolInit())
    server = await Server(cfg, registry=registry).start()
    try:
        pool = sandbox_pool_of(server.sandbox_factory)
        assert isinstance(pool, SandboxPool)
        for k in range(3):
            await assert_eventually(lambda: pool.ready_count() == 2, timeout=60)
            assert server.scheduler is not None
            await server.scheduler.submit([spec(f"p{k}", env="poolinit")], "t")
            await assert_eventually(lambda k=k: f"p{k}" in seen, timeout=60)
            sid, ready, out = seen[f"p{k}"]
            assert sid in ready and out == f"p{k} p{k}\n"
            await assert_eventually(lambda sid=sid: sid not in entries(SandboxConfig(
                state_dir=state)), timeout=30)  # destroyed with its job
        assert len({sid for sid, _, _ in seen.values()}) == 3
    finally:
        await server.stop(0.2)
    assert entries(SandboxConfig(state_dir=state)) == [] and mounts_below(state) == []


async def test_tools_started_ahead_serve_the_job_and_env_jobs_get_sandboxes_without(
        cfg: SandboxConfig) -> None:
    pool = SandboxPool(cfg, PoolSettings(size=1, tools=("bash", "python")))
    try:
        pool.start()
        await assert_eventually(lambda: pool.ready_count() == 1, timeout=120)
        sb = await create_sandbox(cfg, pool=pool, workspace_files={"n.txt": "41"})
        shell, kernel = sb._bash, sb._ipython
        assert shell is not None and shell.alive and kernel is not None
        assert await sb.bash() is shell and await sb.ipython() is kernel, "not started again"
        res = await shell.run("cat n.txt")
        assert res.output.strip() == "41"
        out = await kernel.execute("print(int(open('n.txt').read()) + 1)")
        assert out.output.strip() == "42"
        assert pool.stats().rss_bytes >= 0
        await sb.destroy()
        # A job that sets an environment gets a sandbox whose tools start after it (they see
        # its variables): another shape, without tools started ahead.
        with_env = await create_sandbox(cfg, pool=pool, env={"X": "1"})
        assert with_env._bash is None and with_env._ipython is None
        assert (await (await with_env.bash()).run("echo $X")).output.strip() == "1"
        await with_env.destroy()
        assert pool.shape_for(cfg, {"env": {"X": "1"}}) == Shape("none", cfg.limits, ())
        assert pool.shape_for(cfg, {}) == Shape("none", cfg.limits, ("bash", "python"))
    finally:
        await pool.close()
