"""The persistent pty bash session and the ``bash`` tool, inside a bubblewrap sandbox."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator

import pytest

from rollout.runtime.sandbox import Sandbox, procs
from rollout.runtime.tools import make_tools, tool_schema
from rollout.runtime.tools.bash import BashSession, BashTool, ansi_c_quote, spawn_pty
from tests.runtime.sandbox_helpers import host_has, temp_sandbox
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def sb() -> AsyncIterator[Sandbox]:
    async with temp_sandbox("rb") as sandbox:
        yield sandbox


async def test_cwd_env_and_exit_codes_persist(sb: Sandbox) -> None:
    bash = await sb.bash()
    assert (await bash.run("mkdir -p sub && cd sub && export X=7")).exit_code == 0
    res = await bash.run("pwd; echo $X")
    assert res.output == f"{sb.workspace_in_sandbox}/sub\n7\n"
    assert (await bash.run("false")).exit_code == 1
    assert (await bash.run("(exit 42)")).exit_code == 42
    assert await sb.bash() is bash  # cached per sandbox


async def test_runs_inside_the_sandbox(sb: Sandbox) -> None:
    bash = await sb.bash()
    res = await bash.run("hostname; touch /etc/x 2>&1 | grep -c Read-only")
    assert res.output == "sandbox\n1\n"


async def test_awkward_commands(sb: Sandbox) -> None:
    bash = await sb.bash()
    res = await bash.run("cat <<'EOF'\nline 'one'\n  \"two\" $HOME \\n\nEOF")
    assert res.output == "line 'one'\n  \"two\" $HOME \\n\n"
    res = await bash.run("echo 'unbalanced")
    assert res.exit_code == 2 and "unexpected EOF" in res.output
    assert (await bash.run("echo still here")).output == "still here\n"
    res = await bash.run("printf 'no newline'")
    assert res.output == "no newline"
    long_line = "x" * 20000  # beyond the 4 KiB canonical-mode line limit of a tty
    res = await bash.run(f"echo {long_line} | wc -c")
    assert res.output == "20001\n"
    assert (await bash.run("printf 'a\\tb\\r\\n'")).output == "a\tb\r\n"


async def test_undecodable_bytes_survive(sb: Sandbox) -> None:
    bash = await sb.bash()
    res = await bash.run("printf 'ok \\xff\\xfe end\\n'")
    assert res.output == "ok \\xff\\xfe end\n"
    res = await bash.run("echo 'héllo ✓'")
    assert res.output == "héllo ✓\n"


async def test_output_is_truncated_with_notice(sb: Sandbox) -> None:
    session = await BashSession.start(sb, max_output=2000)
    try:
        res = await session.run("seq 1 100000")
        assert res.truncated
        assert "bytes of output truncated" in res.output
        assert res.output.startswith("1\n2\n3\n")
        assert res.output.endswith("99999\n100000\n")
        assert len(res.output) < 2300
        assert (await session.run("echo after")).output == "after\n"
    finally:
        await session.close()


async def test_timeout_interrupts_then_session_continues(sb: Sandbox) -> None:
    bash = await sb.bash()
    await bash.run("cd /tmp && export KEEP=1")
    res = await bash.run("echo started; sleep 30", timeout=0.5)
    assert res.timed_out and res.exit_code == 130 and not res.restarted
    assert "started" in res.output and "interrupted" in res.output
    assert (await bash.run("pwd; echo $KEEP")).output == "/tmp\n1\n"


async def test_ctrl_c_works_when_the_server_itself_ignores_sigint(sb: Sandbox) -> None:
    """A server started in the background of a script (`rollout serve &`) ignores SIGINT, and
    children inherit that: the shell must still be interruptible."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        bash = await sb.bash()
    finally:
        signal.signal(signal.SIGINT, previous)
    res = await bash.run("echo started; sleep 30", timeout=0.5)
    assert res.timed_out and res.exit_code == 130 and not res.restarted, res.output


async def test_sigint_ignoring_command_kills_and_restarts_shell(sb: Sandbox) -> None:
    bash = await sb.bash()
    old_pid = bash.pid
    res = await bash.run("trap '' INT; sleep 30", timeout=0.5, interrupt_grace_s=0.3)
    assert res.timed_out and res.restarted and "killed" in res.output
    await assert_eventually(lambda: not os.path.exists(f"/proc/{old_pid}"))
    fresh = await sb.bash()
    assert fresh is not bash and fresh.pid != old_pid
    assert (await fresh.run("echo fresh")).output == "fresh\n"


async def test_exit_ends_the_shell_and_the_tool_restarts_it(sb: Sandbox) -> None:
    tool = BashTool(sb)
    res = await tool({"command": "exit 3"})
    assert "shell exited" in res.output
    res = await tool({"command": "echo back"})
    assert res.output == "back\n" and not res.is_error


async def test_cancellation_mid_command_kills_the_shell(sb: Sandbox) -> None:
    bash = await sb.bash()
    pid = bash.pid
    task = asyncio.create_task(bash.run("sleep 300"))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_eventually(lambda: not os.path.exists(f"/proc/{pid}"))
    assert (await (await sb.bash()).run("echo ok")).output == "ok\n"


async def test_tool_interface(sb: Sandbox) -> None:
    tools = make_tools(sb, names=("bash",))
    (tool,) = tools
    schema = tool_schema(tool)
    assert schema["function"]["name"] == "bash"
    assert schema["function"]["parameters"]["required"] == ["command"]
    res = await tool({"command": "echo hi; false"})
    assert res.is_error and res.output == "hi\n\n[exit code 1]"
    assert (await tool({"command": ""})).is_error
    assert (await tool({"command": "true", "timeout": -1})).is_error
    res = await tool({"command": "sleep 5", "timeout": 0.3})
    assert res.is_error and "interrupted with Ctrl-C" in res.output


async def test_host_session_for_baselines() -> None:
    session = await BashSession.start(None, cwd="/")
    try:
        assert (await session.run("pwd")).output == "/\n"
    finally:
        await session.close()


def test_the_terminal_is_raw_before_the_shell_starts() -> None:
    """An interactive bash saves the terminal modes it starts with and restores them when a
    job dies of a signal: modes set after the spawn came back cooked after the first Ctrl-C
    on a loaded machine (lines ending in CR LF). So the child's very first look at its
    terminal must already show the final modes."""
    child = spawn_pty(["stty", "-a"], {"PATH": os.environ["PATH"]})
    try:
        assert child.wait(timeout=30) == 0
        out = b""
        with contextlib.suppress(OSError):  # EIO once the child's side is closed
            while chunk := os.read(child.fd, 65536):
                out += chunk
    finally:
        child.close()
    modes = out.decode().split()
    for mode in ("-onlcr", "-icanon", "-echo", "-echonl", "isig"):
        assert mode in modes, out.decode()
    assert b"\r\n" not in out


def test_ansi_c_quote_round_trips_through_bash() -> None:
    import subprocess
    for text in ["plain", "it's", "back\\slash", "multi\nline", "ctl\x01\x1b[0m", "ünï ✓", ""]:
        out = subprocess.run(["bash", "-c", f"printf %s {ansi_c_quote(text)}"],
                             capture_output=True).stdout
        assert out.decode() == text


# -- teardown waits are bounded ---------------------------------------------------------------

IGNORE_TERM_HUP = "trap '' TERM HUP"


async def test_closing_a_shell_whose_jobs_ignore_term_and_hup_leaves_nothing(
        sb: Sandbox) -> None:
    """The shell and a background job both ignore SIGTERM and SIGHUP (what a hang-up of the
    pty sends): close() still ends every process of the launch and returns."""
    marker = f"deaf{os.getpid()}"
    bash = await sb.bash()
    res = await bash.run(f"{IGNORE_TERM_HUP}; ({IGNORE_TERM_HUP}; exec -a {marker} sleep 300) "
                         "& echo started")
    assert res.output.strip().endswith("started")
    await assert_eventually(lambda: host_has(marker))
    async with asyncio.timeout(30):
        await bash.close()
    assert not bash.alive
    await assert_eventually(lambda: not host_has(marker))


def _deaf_process(extra: str = "") -> subprocess.Popen[bytes]:
    """A process group whose leader and child ignore TERM and HUP; prints once both run."""
    proc = subprocess.Popen(
        ["bash", "-c", f"{IGNORE_TERM_HUP}; {extra} sleep 300 & echo ready; wait"],
        stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_stop_process_escalates_to_sigkill_of_the_group() -> None:
    proc = await asyncio.to_thread(_deaf_process, f"{IGNORE_TERM_HUP};")
    try:
        code = await asyncio.to_thread(procs.stop_process, proc, grace_s=0.3, kill_wait_s=10)
        assert code == -signal.SIGKILL  # TERM and HUP were ignored: only SIGKILL ended it
        await assert_eventually(lambda: not _group_alive(proc.pid))  # the child went too
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def test_stop_process_lets_a_listening_process_end_on_term() -> None:
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    code = await asyncio.to_thread(procs.stop_process, proc, grace_s=10, kill_wait_s=10)
    assert code == -signal.SIGTERM


class _Unreapable:
    """A child that SIGKILL does not end in time (one stuck in the kernel, which a test
    cannot produce on demand): every wait times out until ``gone`` is set."""

    def __init__(self, real: subprocess.Popen[bytes]) -> None:
        self.real, self.pid, self.returncode = real, real.pid, None
        self.gone = threading.Event()

    def poll(self) -> int | None:
        return None

    def wait(self, timeout: float | None = None) -> int:
        if not self.gone.wait(timeout):
            raise subprocess.TimeoutExpired("stuck", timeout or 0)
        return self.real.wait()


async def test_stop_process_gives_up_waiting_and_leaves_the_reaping_to_a_daemon() -> None:
    real = await asyncio.to_thread(_deaf_process)
    stuck = _Unreapable(real)
    try:
        code = await asyncio.to_thread(procs.stop_process, stuck, grace_s=0.1, kill_wait_s=0.2)
        assert code is None
        reaper = next(t for t in threading.enumerate() if t.name == f"reap-{real.pid}")
        assert reaper.daemon  # never holds up the interpreter's exit
        stuck.gone.set()
        await asyncio.to_thread(reaper.join, 10)
        assert real.returncode == -signal.SIGKILL
    finally:
        stuck.gone.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(real.pid, signal.SIGKILL)
        real.wait()


def test_wait_exit_wakes_as_the_process_ends_not_at_a_poll(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``Popen.wait(timeout)`` polls, sleeping 0.5, 1, 2 ... up to 50 ms between looks, so a
    process that took 20 ms to end was reaped after some 31 (a rootless image sandbox's holder
    at every teardown). ``procs.wait_exit`` sleeps in ``poll(2)`` on a pidfd instead: it never
    calls the polling loop's sleep."""
    naps: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(subprocess.time, "sleep", lambda s: (naps.append(s), real_sleep(s)))
    proc = subprocess.Popen(["sleep", "0.2"])
    assert procs.wait_exit(proc, 30) == 0
    assert naps == [], naps
    assert procs.wait_exit(proc, 30) == 0  # reaped already: its status again
    slow = subprocess.Popen(["sleep", "300"])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            procs.wait_exit(slow, 0.05)
    finally:
        slow.kill()
        assert procs.wait_exit(slow, 30) == -signal.SIGKILL
    # The control: Popen's own timed wait does nap.
    proc = subprocess.Popen(["sleep", "0.2"])
    proc.wait(timeout=30)
    assert naps, "Popen.wait(timeout) no longer polls: wait_exit may have no reason to be"
