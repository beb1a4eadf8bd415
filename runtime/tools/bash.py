"""A persistent bash session over a pty, driven by a sentinel protocol.

Why a pty and a sentinel instead of tmux or one process per command: one long-lived shell
keeps ``cd`` and ``export`` between calls, and reading the pty directly with the event loop's
reader is cheap, whereas tmux send-keys/capture-pane polls a screen (``rollout bench tools``
compares the two).

Protocol: each command is sent as one line, ``eval $'<command, ANSI-C quoted>'; printf
'\\x1e…<nonce>_<seq>__<status>\\x1e\\n' "$?"``. Quoting the command as a single ``eval``
argument means unbalanced quotes or a heredoc inside it cannot swallow the sentinel; the random
nonce means command output cannot fake one. The terminal runs without echo, without CR/LF
translation and without canonical line editing (which would truncate lines at 4 KiB).

Timeouts: Ctrl-C (SIGINT to the foreground job) first, then, if no sentinel comes back within
a grace period, the whole shell (its PID namespace) is killed and a new one starts on the next
call; the result says that cwd and environment were reset.

Spawning: never a Python-level fork in the server. ``pty.fork()`` (what ptyprocess does) runs
the interpreter's at-fork handlers, and gRPC registers some (``os.register_at_fork``) whose
child half can crash the forked child of a busy multi-threaded server: about one shell in 15
then never came up. Instead the server opens the pty pair itself (``os.openpty``) and starts
``setsid --ctty <launcher>`` with ``subprocess.Popen`` and no ``preexec_fn``: CPython then
starts the child through ``_posixsubprocess`` with vfork and runs no Python code in it, and
util-linux's ``setsid`` makes the pty the controlling terminal (so Ctrl-C still reaches the
foreground job) before it execs the launcher under the same pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import secrets
import signal
import struct
import subprocess
import termios
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollout.runtime.sandbox.output import CappedOutput
from rollout.runtime.tools.base import DEFAULT_SIGNALS, ToolResult

DEFAULT_MAX_OUTPUT = 16 * 1024
TRUNCATION_NOTICE = ("[... {dropped} bytes of output truncated; redirect to a file and view "
                     "parts of it to see more ...]")
SHELL_ARGV = ("bash", "--norc", "--noprofile", "--noediting")
SHELL_ENV = {"PS1": "", "PS2": "", "PS0": "", "PROMPT_COMMAND": "", "HISTFILE": "/dev/null"}


class BashError(RuntimeError):
    """The shell could not be started."""


@dataclass(frozen=True)
class BashResult:
    output: str
    exit_code: int
    """-1 when the command never finished (timeout kill, shell exit)."""
    timed_out: bool = False
    truncated: bool = False
    restarted: bool = False
    """The shell died or was killed; the next command runs in a fresh one."""


def ansi_c_quote(text: str) -> str:
    """Quote ``text`` as a bash ``$'...'`` word that survives being sent as one line."""
    out = []
    for ch in text:
        o = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif ch == "'":
            out.append("\\'")
        elif ch == "\n":
            out.append("\\n")
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\x{o:02x}")
        else:
            out.append(ch)
    return "$'" + "".join(out) + "'"


def _new_sink(limit: int) -> CappedOutput:
    """Equal head and tail halves (at least one byte each); the notice tells the model how
    to see what was dropped."""
    half = max(limit // 2, 1)
    return CappedOutput(half, half, TRUNCATION_NOTICE)


class BashSession:
    """One shell. Use :meth:`start` (inside a sandbox, or on the host for baselines)."""

    def __init__(self, proc: Any, sandbox: Any, max_output: int) -> None:
        self._proc = proc
        self._sandbox = sandbox
        self._fd: int = proc.fd
        self.max_output = max_output
        self._nonce = secrets.token_hex(6)
        self._sentinel = re.compile(
            rb"\x1e__RS_" + self._nonce.encode() + rb"_(\d+r?)__(-?\d+)\x1e\n?")
        self._seq = 0
        self._pending = bytearray()
        self._sink = _new_sink(max_output)
        self._done: tuple[str, int] | None = None
        self._want: int = -1
        self._event = asyncio.Event()
        self._lock = asyncio.Lock()
        self.alive = True
        self._loop = asyncio.get_running_loop()
        os.set_blocking(self._fd, False)
        self._loop.add_reader(self._fd, self._on_readable)

    # -- lifecycle ---------------------------------------------------------------------------
    @classmethod
    async def start(cls, sandbox: Any = None, *, argv: Sequence[str] | None = None,
                    env: Mapping[str, str] | None = None, cwd: str | None = None,
                    max_output: int = DEFAULT_MAX_OUTPUT,
                    start_timeout: float = 20.0) -> BashSession:
        """Start a shell in ``sandbox`` (or, with ``sandbox=None``, ``argv`` on the host)."""
        from rollout.runtime.sandbox.procs import in_spawner
        if sandbox is not None:
            full = sandbox.command_argv(list(argv or SHELL_ARGV), cwd=cwd, tty=True)
            full_env = sandbox.spawn_env({**SHELL_ENV, **(env or {})})
        else:
            full = list(argv or SHELL_ARGV)
            full_env = {**os.environ, "TERM": "dumb", **SHELL_ENV, **(env or {})}
        spawn = asyncio.ensure_future(in_spawner(
            spawn_pty, full, full_env, None if sandbox is not None else cwd))
        try:
            proc = await asyncio.shield(spawn)
        except OSError as e:
            raise BashError(f"could not start bash: {e}") from e
        except asyncio.CancelledError:
            spawn.add_done_callback(_discard_spawned)
            raise
        if sandbox is not None:
            sandbox.track(proc.pid)
        session = cls(proc, sandbox, max_output)
        first = await session.run("true", timeout=start_timeout)
        if first.exit_code != 0:
            await session.close()
            raise BashError(f"bash did not come up: {first.output.strip()[:500]}")
        return session

    async def close(self) -> None:
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        self.alive = False
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._fd)
        # The launcher leads the pty's process group, which also holds the sandbox's PID 1:
        # SIGKILL to that group ends the launch, whatever the shell's jobs trap or ignore.
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(_reap, proc)
        if self._sandbox is not None and hasattr(self._sandbox, "untrack"):
            self._sandbox.untrack(proc.pid)

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else -1

    # -- I/O ---------------------------------------------------------------------------------
    def _on_readable(self) -> None:
        try:
            data = os.read(self._fd, 65536)
        except BlockingIOError:
            return
        except OSError:  # EIO: the shell side of the pty is gone
            data = b""
        if not data:
            self.alive = False
            self._loop.remove_reader(self._fd)
            self._sink.feed(bytes(self._pending))
            self._pending.clear()
            self._event.set()
            return
        self._pending += data
        self._scan()

    def _scan(self) -> None:
        buf = self._pending
        pos = 0
        for m in self._sentinel.finditer(buf):
            self._sink.feed(bytes(buf[pos:m.start()]))
            pos = m.end()
            ident = m.group(1).decode()
            if ident.rstrip("r") == str(self._want):
                self._done = (ident, int(m.group(2)))
                self._event.set()
        rest = buf[pos:]
        keep = rest.rfind(b"\x1e")
        if keep >= 0 and len(rest) - keep < 64:  # maybe the start of a sentinel
            self._sink.feed(bytes(rest[:keep]))
            self._pending = bytearray(rest[keep:])
        else:
            self._sink.feed(bytes(rest))
            self._pending = bytearray()

    async def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self._fd, view)
                view = view[n:]
            except BlockingIOError:
                fut: asyncio.Future[None] = self._loop.create_future()
                self._loop.add_writer(self._fd, _resolve, fut)
                try:
                    await fut
                finally:
                    self._loop.remove_writer(self._fd)

    def _sentinel_cmd(self, ident: str, status: str = '"$?"') -> str:
        return f"printf '\\036__RS_{self._nonce}_{ident}__%d\\036\\n' {status}"

    async def _wait(self, timeout: float) -> bool:  # noqa: ASYNC109
        # asyncio.timeout, never wait_for: on Python 3.11 wait_for swallows a cancel that
        # arrives as the event is set, and the cancelled job then went on to its next stage.
        try:
            async with asyncio.timeout(timeout):
                await self._event.wait()
        except TimeoutError:
            return False
        return True

    async def run(self, command: str, timeout: float = 60.0,  # noqa: ASYNC109
                  interrupt_grace_s: float = 1.0) -> BashResult:
        """Run one command; cwd and environment carry over to the next."""
        async with self._lock:
            if self._proc is None or not self.alive:
                return BashResult("[the shell is not running]", -1, restarted=True)
            self._seq += 1
            self._want = self._seq
            self._sink = _new_sink(self.max_output)
            self._done = None
            self._event.clear()
            line = f"eval {ansi_c_quote(command)}; {self._sentinel_cmd(str(self._seq))}\n"
            try:
                await self._write(line.encode("utf-8", "surrogateescape"))
                finished = await self._wait(timeout)
                if not finished and self.alive:
                    return await self._on_timeout(timeout, interrupt_grace_s)
            except BaseException:
                # Cancelled mid-command: the shell state is unknown, so it must not be reused.
                await self.close()
                raise
            if self._done is None:  # EOF: the command ended the shell (exit, exec, crash)
                await self.close()
                return BashResult(self._sink.text() + "\n[the shell exited; a new one starts "
                                  "with the next command]", -1, truncated=bool(self._sink.dropped),
                                  restarted=True)
            return BashResult(self._sink.text(), self._done[1],
                              truncated=bool(self._sink.dropped))

    async def _on_timeout(self, timeout: float, grace: float) -> BashResult:  # noqa: ASYNC109
        await self._write(b"\x03")
        await self._write((self._sentinel_cmd(f"{self._seq}r", "130") + "\n").encode())
        if await self._wait(grace) and self._done is not None:
            return BashResult(self._sink.text() + f"\n[timed out after {timeout:g} s; "
                              "interrupted with Ctrl-C]", 130, timed_out=True,
                              truncated=bool(self._sink.dropped))
        text = self._sink.text()
        await self.close()
        return BashResult(text + f"\n[timed out after {timeout:g} s and ignored Ctrl-C: the "
                          "shell was killed; the next command runs in a new shell (working "
                          "directory and environment were reset)]", -1, timed_out=True,
                          truncated=bool(self._sink.dropped), restarted=True)


class PtyChild:
    """A process whose stdin, stdout and stderr are the slave side of a pty we hold the master
    of; ``pid`` leads its own session, with the pty as its controlling terminal."""

    def __init__(self, popen: subprocess.Popen[bytes], fd: int) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.fd = fd

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def close(self, force: bool = True) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def spawn_pty(argv: Sequence[str], env: Mapping[str, str], cwd: str | None = None,
              rows: int = 50, cols: int = 250) -> PtyChild:
    """Start ``argv`` on a new pty without forking the calling Python process (see the module
    docstring). Blocking; the sandbox runs it in its spawner thread."""
    master, slave = os.openpty()  # both non-inheritable; Popen dup2()s the slave to 0, 1, 2
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        # The terminal's final modes before the child exists: an interactive bash saves the
        # modes it starts with and puts them back whenever a job dies of a signal, so modes set
        # after the spawn (on a loaded machine, after bash had saved cooked ones) came back
        # with the first Ctrl-C, and every later line ended in CR LF.
        _raw_terminal(slave)
        popen = subprocess.Popen([*DEFAULT_SIGNALS, "setsid", "--ctty", *argv],
                                 stdin=slave, stdout=slave, stderr=slave, env=dict(env),
                                 cwd=cwd, close_fds=True)
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    return PtyChild(popen, master)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _raw_terminal(fd: int) -> None:
    """No echo, no CR/LF mangling, no 4 KiB canonical line limit; keep ^C -> SIGINT."""
    attrs = termios.tcgetattr(fd)
    attrs[1] &= ~termios.ONLCR
    attrs[3] &= ~(termios.ICANON | termios.ECHO | termios.ECHONL)
    attrs[3] |= termios.ISIG
    attrs[6][termios.VMIN] = 1
    attrs[6][termios.VTIME] = 0
    termios.tcsetattr(fd, termios.TCSANOW, attrs)


def _discard_spawned(fut: asyncio.Future[Any]) -> None:
    """A shell whose starter was cancelled: kill it and release its pty."""
    if fut.cancelled() or fut.exception() is not None:
        return
    proc = fut.result()
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(proc.pid, signal.SIGKILL)
    threading.Thread(target=_reap, args=(proc,), daemon=True).start()


REAP_WAIT_S = 5.0
"""How long a killed shell gets to be reaped before a background thread takes it over. An
unbounded ``wait()`` here once was the suspect of a suite hang: it runs in the event loop's
default executor, whose shutdown at the end of ``asyncio.run`` joins every such thread."""


def _reap(proc: Any) -> None:
    from rollout.runtime.sandbox.procs import stop_process

    with contextlib.suppress(Exception):
        stop_process(proc.popen, kill_wait_s=REAP_WAIT_S)
    with contextlib.suppress(Exception):
        proc.close(force=True)


class BashTool:
    """The agent-facing ``bash`` tool: one persistent shell per sandbox."""

    name = "bash"
    description = ("Run a bash command in a persistent shell inside the sandbox. The working "
                   "directory and exported variables persist between calls. Long output is "
                   "truncated in the middle. Interactive programs are not supported.")
    parameters: Mapping[str, Any] = {
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The command(s) to run."},
            "timeout": {"type": "number", "description": "Seconds before the command is "
                        "interrupted (default 60)."},
        },
        "required": ["command"],
    }

    def __init__(self, sandbox: Any, default_timeout: float = 60.0,
                 max_timeout: float = 600.0) -> None:
        self.sandbox = sandbox
        self.default_timeout = default_timeout
        self.max_timeout = max_timeout

    async def run(self, command: str, timeout: float | None = None) -> BashResult:  # noqa: ASYNC109
        """Python API for handlers; restarts a shell that died since the last call."""
        session = await self.sandbox.bash()
        t = min(timeout if timeout is not None else self.default_timeout, self.max_timeout)
        return await session.run(command, timeout=t)

    async def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        command = arguments.get("command")
        if not isinstance(command, str) or not command.strip():
            return ToolResult("bash needs a non-empty string argument 'command'", is_error=True)
        timeout = arguments.get("timeout")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            return ToolResult("'timeout' must be a positive number of seconds", is_error=True)
        res = await self.run(command, float(timeout) if timeout is not None else None)
        out = res.output
        if res.exit_code not in (0, -1):
            out += f"\n[exit code {res.exit_code}]"
        return ToolResult(out, is_error=res.exit_code != 0)
