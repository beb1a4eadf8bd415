"""The IPython kernel runs inside the sandbox and is reached over ipc (Unix sockets)."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollout.runtime.sandbox import Sandbox, SandboxConfig, create_sandbox
from rollout.runtime.tools import make_tools
from tests.runtime.sandbox_helpers import temp_sandbox

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
