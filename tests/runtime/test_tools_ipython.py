"""The IPython kernel runs inside the sandbox and is reached over ipc (Unix sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import stat
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollout.runtime.sandbox import Sandbox, SandboxConfig, create_sandbox, procs
from rollout.runtime.tools import make_tools
from rollout.runtime.tools.ipython import IPythonKernel
from tests.runtime.sandbox_helpers import temp_config, temp_sandbox
from tests.util import assert_eventually, patience

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def sb() -> AsyncIterator[Sandbox]:
    async with temp_sandbox("rk") as sandbox:
        yield sandbox


async def test_kernel_lives_in_the_sandbox_over_unix_sockets(sb: Sandbox) -> None:
    kernel = await sb.ipython()
    assert kernel.transport == "ipc"
    res = await kernel.execute("import os, socket; (socket.gethostname(), os.getcwd())")
    assert res.ok, res.output
    assert res.output == f"('sandbox', '{sb.workspace_in_sandbox}')\n"
    res = await kernel.execute("open('/etc/kernel-escape', 'w')")
    assert res.status == "error" and res.error_name in ("OSError", "PermissionError")
    host_ctl, _ = sb.control_dir()
    sockets = [p for p in host_ctl.iterdir() if stat.S_ISSOCK(p.stat().st_mode)]
    assert len(sockets) == 5  # shell, iopub, stdin, control, heartbeat
    if os.geteuid() == 0:
        uid = (await kernel.execute("os.getuid()")).output.strip()
        assert uid != "0"


async def test_state_persists_and_outputs_are_collected(sb: Sandbox) -> None:
    kernel = await sb.ipython()
    assert (await kernel.execute("x = 41")).output == ""
    res = await kernel.execute("print('out'); import sys; print('err', file=sys.stderr); x + 1")
    assert res.output == "out\nerr\n42\n"
    res = await kernel.execute("1/0")
    assert res.status == "error" and res.error_name == "ZeroDivisionError"
    assert "division by zero" in res.output and "\x1b[" not in res.output
    assert (await kernel.execute("x")).output == "41\n"


async def test_timeout_interrupts_and_keeps_state(sb: Sandbox) -> None:
    kernel = await sb.ipython()
    await kernel.execute("y = 'kept'")
    res = await kernel.execute("import time\nwhile True: time.sleep(0.01)", timeout=1.0)
    assert res.status == "timeout" and "KeyboardInterrupt" in res.output
    assert (await kernel.execute("y")).output == "'kept'\n"


async def test_interrupt_ignoring_cell_restarts_kernel(sb: Sandbox) -> None:
    kernel = await sb.ipython()
    await kernel.execute("z = 1")
    res = await kernel.execute(
        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "while True: time.sleep(0.01)", timeout=0.5, interrupt_grace_s=0.5)
    assert res.status == "restarted" and "restarted" in res.output
    res = await kernel.execute("z")
    assert res.status == "error" and res.error_name == "NameError"


async def test_restart_and_tool_interface(sb: Sandbox) -> None:
    (tool,) = make_tools(sb, names=("python",))
    assert (await tool({"code": "v = 5; v * 2"})).output == "10\n"
    kernel = await sb.ipython()
    await kernel.restart()
    res = await tool({"code": "v"})
    assert res.is_error and "NameError" in res.output
    assert (await tool({"code": 3})).is_error


async def test_deep_state_dir_beyond_the_unix_socket_path_limit(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    async with await create_sandbox(SandboxConfig(state_dir=deep)) as sb:
        assert len(str(sb.control_dir()[0])) > 108
        (tool,) = make_tools(sb, names=("python",))
        assert (await tool({"code": "6 * 7"})).output == "42\n"


def _proc_state(pid: int) -> str | None:
    """The state letter of ``/proc/<pid>/stat`` ("Z" for a zombie), None when the pid is gone."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat_line.rsplit(")", 1)[1].split()[0]


async def test_a_dead_kernel_stays_ours_until_closed(sb: Sandbox) -> None:
    """Nothing but the kernel's owner reaps it: a kernel killed from outside stays a zombie (so
    its pid, tracked by the sandbox for kill-by-pid, cannot name a stranger) until ``close``
    reaps it and reports the real status. asyncio's child watcher reaped it on its own."""
    kernel = await sb.ipython()
    assert (await kernel.execute("1 + 1")).output == "2\n"
    pid = kernel.pid
    os.killpg(pid, signal.SIGKILL)
    await assert_eventually(lambda: not kernel.alive, message="the kernel's death went unseen")
    await asyncio.sleep(0.2)  # time for any other reaper to act, which would fail the test
    assert _proc_state(pid) == "Z"
    assert pid in sb._pids
    await kernel.close()
    assert kernel.exit_status == -signal.SIGKILL
    assert _proc_state(pid) is None and pid not in sb._pids


async def test_kernel_status_is_real_when_a_reaper_thread_lags(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Regression: "Unknown child process pid N, will report returncode 255" in the quickstart.

    asyncio's ThreadedChildWatcher reaps each child in a thread of its own; when that thread
    ran late (a loaded machine), ``Process.kill()`` in the kernel's close polled the child
    already killed by the sandbox's ``stop_processes`` (Popen.send_signal polls first), reaped
    it, and the watcher then logged the warning and reported 255. Injected fault: every such
    watcher thread sees its child's exit without reaping it, then waits a moment before its
    ``waitpid`` (as a descheduled thread would). Kernels are started, killed as before EVAL
    and closed several times, with other processes launched and reaped around them."""
    real_waitpid = os.waitpid

    def lagging_waitpid(pid: int, options: int) -> tuple[int, int]:
        if threading.current_thread().name.startswith("asyncio-waitpid") and pid > 0:
            with contextlib.suppress(ChildProcessError):
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            time.sleep(0.05)
        return real_waitpid(pid, options)

    monkeypatch.setattr(os, "waitpid", lagging_waitpid)
    caplog.set_level(logging.WARNING, logger="asyncio")
    statuses = []
    with temp_config("rl") as cfg:
        for i in range(4):
            async with await create_sandbox(cfg) as sb:
                kernel = await sb.ipython()
                ran = await asyncio.gather(kernel.execute(f"{i} * 3"), sb.exec("exit 3"),
                                           sb.exec("true"))
                assert ran[0].output == f"{i * 3}\n" and ran[1].exit_code == 3
                if i % 2:  # also the close of a kernel nobody killed first
                    await kernel.close()
                else:
                    await sb.stop_processes()
                statuses.append(kernel.exit_status)
    assert statuses == [-signal.SIGKILL] * 4
    assert not [r for r in caplog.records if "child process" in r.getMessage()]


def _our_children() -> set[int]:
    """Pids of this process's children (zombies included), from every thread's list."""
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            pids.update(int(p) for p in (task / "children").read_text().split())
    return pids


async def test_a_start_cancelled_while_spawning_leaves_no_process(sb: Sandbox) -> None:
    """The kernel spawns in the spawner thread: a start cancelled while it waits there still
    gets its process, which must be killed and reaped, not left running or a zombie."""
    before = _our_children()
    busy = asyncio.ensure_future(procs.in_spawner(time.sleep, 0.5))  # the spawn queues behind
    start = asyncio.ensure_future(IPythonKernel.start(sb))
    await asyncio.sleep(0.1)
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    await busy
    await assert_eventually(lambda: _our_children() - before == set(),
                            message="the cancelled start's kernel was left behind")
    assert not sb._pids



def test_a_start_cancelled_after_its_client_opened_cannot_hang_the_collector(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A start cancelled while the kernel's client waits for it to answer (a job cancelled
    while its python tool starts) left that client, its channels open, to the garbage
    collector: context, channels and sockets are one cycle, the collector clears the
    context's weak references to its sockets before any finaliser runs, and ZeroMQ's context
    then waited for ever for sockets it could no longer close, in whatever thread collected (a
    loaded test run lost a worker so). The start now closes what it opened; and a client's
    context is held until its kernel is closed."""
    from rollout.runtime.tools import ipython

    reached = threading.Event()

    async def never_ready(client: object, timeout: float) -> None:
        reached.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(ipython, "_wait_ready", never_ready)
    held = getattr(ipython, "_OPEN_CONTEXTS", set())
    before = set(held)

    async def cancelled_start() -> None:
        async with temp_sandbox("rk") as sandbox:
            start = asyncio.ensure_future(IPythonKernel.start(sandbox, startup_timeout=600))
            while not reached.is_set():
                await asyncio.sleep(0.01)
            start.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await start

    asyncio.run(cancelled_start())
    assert _collects_within(patience(30)), "gc.collect() hung on a cancelled start's context"
    assert set(held) == before, "the cancelled start left its client's context open"


def _collects_within(seconds: float) -> bool:
    """Whether a full collection, in a thread of its own, ends within ``seconds``."""
    import gc

    collector = threading.Thread(target=gc.collect, daemon=True)
    collector.start()
    collector.join(seconds)
    return not collector.is_alive()


def test_a_kernel_dropped_without_close_cannot_hang_the_collector() -> None:
    """An owner that drops a started kernel without ``close`` leaks it, but its client's
    ZeroMQ context is held until then, so the collector never finalises it (which hung)."""
    from rollout.runtime.tools import ipython

    held = getattr(ipython, "_OPEN_CONTEXTS", set())
    before = set(held)

    async def dropped() -> None:
        async with temp_sandbox("rk") as sandbox:
            kernel = await IPythonKernel.start(sandbox)
            assert (await kernel.execute("1 + 1")).output == "2\n"
            kernel._client.execute("2 + 2")  # a request on its way

    asyncio.run(dropped())
    collected = _collects_within(patience(30))
    for leaked in set(held) - before:
        leaked.destroy(linger=0)
        held.discard(leaked)
    assert collected, "gc.collect() hung on a dropped kernel's ZeroMQ context"
