"""Launches are born in the sandboxes' memory cgroup: the spawner thread joins it once (cgroup
v1), so a launch skips the per-launch join; one spawned from any other thread still joins in
its prologue (the cap never depends on the shortcut); and when the last sandbox goes, the
thread leaves and the group is removed."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from rollout.runtime.sandbox import SandboxConfig, create_sandbox, hardening, procs
from tests.runtime.sandbox_helpers import temp_config

pytestmark = pytest.mark.timeout(120)


def _v1_memory() -> bool:
    root = hardening._memory_root()
    return root is not None and root[1] == "v1"


@pytest.fixture
def cfg() -> object:
    with temp_config("rcgj") as c:
        yield c


def _group_of(pid: int | str) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        return next(line.strip().split(":", 2)[2] for line in f
                    if "memory" in line.split(":")[1].split(","))


@pytest.mark.skipif(not _v1_memory(), reason="needs a writable cgroup v1 memory controller")
async def test_launches_are_born_in_the_group_and_the_group_goes_with_the_last_sandbox(
        cfg: SandboxConfig) -> None:
    # The thread joins the first sandbox group of the process only; with another state dir's
    # sandboxes alive (an earlier test's), launches here join one by one, as before.
    free = not hardening._THREAD_GROUP
    sb = await create_sandbox(cfg)
    group_procs = Path(sb._prefix[4])  # type: ignore[attr-defined]
    group = "/" + group_procs.parent.name
    await procs.in_spawner(lambda: None)  # the queued join has run
    assert hardening.thread_joined(group_procs) == free
    tid = await procs.in_spawner(lambda: __import__("threading").get_native_id())
    assert (_group_of(f"self/task/{tid}") == group) == free
    # A launch from the spawner: in the group (born there).
    run = asyncio.create_task(sb.exec("sleep 2"))
    try:
        async with asyncio.timeout(30):
            while not sb._pids:
                await asyncio.sleep(0.01)
        assert _group_of(next(iter(sb._pids))) == group
        # A launch from another thread: its prologue joins.
        other = await asyncio.to_thread(
            subprocess.Popen, sb.command_argv(["sleep", "2"]), env=sb.spawn_env())
        try:
            await asyncio.sleep(0.3)
            assert _group_of(other.pid) == group
        finally:
            other.kill()
            await asyncio.to_thread(other.wait)
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
    await sb.destroy()
    assert not hardening.thread_joined(group_procs)
    assert _group_of(f"self/task/{tid}") != group
    assert not group_procs.parent.exists()
    assert os.path.exists(f"/proc/self/task/{tid}"), "the spawner thread lives on"
