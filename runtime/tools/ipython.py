"""A persistent IPython kernel inside the sandbox, reached over ZeroMQ ``ipc`` (Unix sockets).

Why ipc: the sandbox has no network, and Unix sockets in a bind-mounted directory are the one
channel that crosses the sandbox wall without opening one; they are also faster than loopback
TCP. The kernel runs *inside* the sandbox (``python -m ipykernel_launcher``) with a connection
file whose ``ip`` is the socket path prefix as the sandbox sees it; the client gets the same
file with the host-side path.

Timeouts send ``interrupt_request`` on the control channel (ipykernel answers by raising
KeyboardInterrupt in the running cell; a signal would not cross the PID namespace); if the
kernel stays busy it is killed and restarted, and the result says that state was lost.

The kernel is started with ``subprocess.Popen`` and no ``preexec_fn``: CPython then spawns it
through ``_posixsubprocess`` (vfork) without running Python's at-fork handlers, so gRPC's fork
hooks never run in the server for a tool start (keep it that way: a ``preexec_fn`` here would
bring them back).

One owner reaps the kernel's process: :class:`_KernelProcess`, after a pidfd on the event loop
says it exited. Not asyncio's subprocess API: on Python 3.11 its ThreadedChildWatcher reaps in
a thread of its own, while ``Process.kill()`` goes through ``Popen.send_signal``, which polls
(``waitpid(WNOHANG)``) first. A kernel that died a moment before (killed by the sandbox's
``stop_processes`` or by ``close``'s own ``killpg``) was then reaped by that poll whenever the
watcher thread had not run yet, and the watcher logged "Unknown child process pid N, will report
returncode 255" and reported 255. Worse, a pid reaped behind our back can be reused while the
sandbox still tracks it, and its kill-by-pid would reach a stranger; a pid we alone reap stays
ours (a zombie at worst) until we reap it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import queue
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rollout.runtime.sandbox import procs
from rollout.runtime.sandbox.base import python_argv
from rollout.runtime.timeouts import scaled
from rollout.runtime.tools.base import DEFAULT_SIGNALS, ToolResult

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CHANNELS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
_counter = itertools.count(1)
MAX_UNIX_PATH = 100
KERNEL_STARTUP_S = 30.0
"""Base deadline for a kernel to answer ``kernel_info``; stretched by ``ROLLOUT_TIMEOUT_SCALE``
because importing IPython on a loaded machine takes many times its idle ~0.5 s."""
KILL_WAIT_S = 5.0
"""How long a SIGKILLed kernel gets to exit before a daemon thread is left to reap it."""


_BIND_WITH_UMASK = ("import os, sys\n"
                    "from ipykernel.kernelapp import IPKernelApp\n"
                    "app = IPKernelApp.instance()\n"
                    "old = os.umask({umask})\n"
                    "app.initialize(sys.argv[1:])\n"
                    "os.umask(old)\n"
                    "app.start()\n")
"""What ``ipykernel_launcher`` does, with the sockets bound under another umask (a sandbox's
``kernel_socket_umask``: a server that is not the kernel's user connects to them); the
code the kernel runs keeps the usual one."""


class KernelError(RuntimeError):
    """The kernel could not be started or answered nothing."""


@dataclass
class CellResult:
    output: str
    """stdout/stderr, the result's text/plain, display data and tracebacks, in order."""
    status: Literal["ok", "error", "timeout", "restarted"] = "ok"
    error_name: str = ""
    data: list[Mapping[str, Any]] = field(default_factory=list)
    """Rich outputs (display_data / execute_result bundles), e.g. image/png."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


_OPEN_CONTEXTS: set[Any] = set()
"""The ZeroMQ context of every kernel client until its kernel is closed. A client dropped
without :meth:`IPythonKernel.close` makes its context, channels and sockets one garbage cycle;
the collector clears the context's weak references to its sockets before any finaliser runs,
so the context's ``__del__`` closes none of them and ``zmq_ctx_term`` then waits for them for
ever, in whichever thread the collector happened to run (a loaded test run hung a worker so).
Held here, an unclosed kernel's context is a leak, never a hang."""


class IPythonKernel:
    """One kernel process plus its client. ``await IPythonKernel.start(sandbox)``."""

    def __init__(self, sandbox: Any, transport: str, python: str) -> None:
        self.sandbox = sandbox
        self.transport = transport
        self.python = python
        self._proc: _KernelProcess | None = None
        self.exit_status: int | None = None
        """How the last kernel process ended (``Popen.returncode``: negative for a signal), set
        when it is reaped; None while none has ended or when it could not be reaped in time."""
        self._client: Any = None
        self._context: Any = None
        self._lock = asyncio.Lock()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._dir_fd = -1

    @classmethod
    async def start(cls, sandbox: Any = None, *, transport: Literal["ipc", "tcp"] = "ipc",
                    python: str | None = None,
                    startup_timeout: float | None = None) -> IPythonKernel:
        """Start a kernel in ``sandbox`` (``None``: on the host, used for baselines);
        ``startup_timeout`` defaults to the scaled ``KERNEL_STARTUP_S``."""
        py = python or (getattr(sandbox, "python", None) if sandbox else None) or sys.executable
        kernel = cls(sandbox, transport, py)
        try:
            await kernel._launch(scaled(KERNEL_STARTUP_S) if startup_timeout is None
                                 else startup_timeout)
        except BaseException:
            # Failed or cancelled after the client opened (a job cancelled while its python
            # tool starts): close what was opened, whatever happens to this task meanwhile.
            with contextlib.suppress(BaseException):
                await asyncio.shield(kernel.close())
            raise
        return kernel

    def _dirs(self) -> tuple[Path, str]:
        if self.sandbox is not None:
            host, inside = self.sandbox.control_dir()
            return Path(host), str(inside)
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="ipk")
        return Path(self._tmp.name), self._tmp.name

    async def _launch(self, timeout: float) -> None:  # noqa: ASYNC109
        from jupyter_client.asynchronous import AsyncKernelClient
        host_dir, inside_dir = self._dirs()
        n = next(_counter)
        info: dict[str, Any] = {"transport": self.transport, "key": secrets.token_hex(16),
                                "signature_scheme": "hmac-sha256", "kernel_name": "python3"}
        if self.transport == "ipc":
            host_ip, inside_ip = str(host_dir / f"k{n}"), f"{inside_dir}/k{n}"
            if len(host_ip) + 3 > MAX_UNIX_PATH:
                # Unix socket paths max out at 107 bytes; reach a deep control dir through a
                # directory fd instead, which the kernel (binding its short in-sandbox path)
                # never needs to know about.
                self._dir_fd = os.open(host_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                host_ip = f"/proc/self/fd/{self._dir_fd}/k{n}"
            if len(inside_ip) + 3 > MAX_UNIX_PATH:
                raise KernelError(f"in-sandbox socket path {inside_ip!r} is too long")
            info.update(zip(_CHANNELS, range(1, 6), strict=True))
        else:
            host_ip = inside_ip = "127.0.0.1"
            info.update(zip(_CHANNELS, _free_ports(5), strict=True))
        conn_host = host_dir / f"k{n}.json"
        conn_host.write_text(json.dumps({**info, "ip": inside_ip}))
        # An image sandbox runs the server's interpreter through the host's loader (the
        # image's libc may be another, or absent); an interpreter given explicitly runs as is.
        python = (python_argv(self.sandbox) if self.sandbox is not None and self.python ==
                  getattr(self.sandbox, "python", None) else [self.python])
        umask = getattr(self.sandbox, "kernel_socket_umask", None)
        start = (["-m", "ipykernel_launcher"] if umask is None else
                 ["-c", _BIND_WITH_UMASK.format(umask=umask)])
        argv = [*python, *start, "-f", f"{inside_dir}/k{n}.json",
                "--HistoryManager.enabled=False", "--IPKernelApp.log_level=ERROR"]
        if self.sandbox is not None:
            full, env = self.sandbox.command_argv(argv), self.sandbox.spawn_env()
        else:
            full, env = argv, {**os.environ, "MPLBACKEND": "Agg"}
        log = os.open(host_dir / f"k{n}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                      | os.O_CLOEXEC, 0o644)
        try:
            # The spawner thread, as for the bash tool: bwrap's --die-with-parent fires when
            # the thread that started it ends, and that one lives as long as the process.
            spawn = asyncio.ensure_future(procs.in_spawner(
                _spawn, [*DEFAULT_SIGNALS, *full], env, log))
            try:
                popen = await asyncio.shield(spawn)
            except asyncio.CancelledError:
                spawn.add_done_callback(_discard_spawned)
                raise
        finally:
            os.close(log)
        self._proc = _KernelProcess(popen, self.sandbox)
        import zmq.asyncio

        self._context = zmq.asyncio.Context()
        _OPEN_CONTEXTS.add(self._context)
        client = AsyncKernelClient(context=self._context)
        client_info: dict[str, Any] = {**info, "ip": host_ip}
        client.load_connection_info(client_info)  # type: ignore[arg-type]
        # No heartbeat thread: whether the kernel lives is asked of its process (see
        # _wait_ready), and that thread, when the kernel died at once, raced the close
        # and died itself with a ZeroMQ error printed to the server's log.
        client.start_channels(hb=False)
        self._client = client
        self._log = host_dir / f"k{n}.log"
        ready = asyncio.ensure_future(_wait_ready(client, timeout))
        died = asyncio.ensure_future(self._proc.exited.wait())
        try:
            done, _ = await asyncio.wait({ready, died}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for fut in (ready, died):
                fut.cancel()
        if ready not in done or ready.cancelled() or ready.exception() is not None:
            detail = self._log.read_bytes()[-2000:].decode(errors="replace") \
                if self._log.exists() else ""
            exited = self._proc.exited.is_set()
            await self.close()
            code = self.exit_status
            if exited:
                raise KernelError(f"IPython kernel exited (status {code}) before answering: "
                                  f"{detail}")
            raise KernelError(f"IPython kernel did not answer within {timeout:g} s (on a "
                              f"loaded machine, raise ROLLOUT_TIMEOUT_SCALE): {detail}")

    @property
    def alive(self) -> bool:
        return self._proc is not None and not self._proc.exited.is_set()

    @property
    def pid(self) -> int:
        """The running kernel's launcher pid (-1 when none): valid until :meth:`close`, which
        alone reaps it, even after the kernel died."""
        return self._proc.pid if self._proc is not None else -1

    async def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.stop_channels()
            self._client = None
        context, self._context = self._context, None
        if context is not None:
            with contextlib.suppress(Exception):
                context.destroy(linger=0)
            _OPEN_CONTEXTS.discard(context)
        proc, self._proc = self._proc, None
        if proc is not None:
            self.exit_status = await proc.stop(KILL_WAIT_S)
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    async def restart(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """A fresh kernel (all variables are lost)."""
        async with self._lock:
            await self.close()
            await self._launch(scaled(KERNEL_STARTUP_S) if timeout is None else timeout)

    async def interrupt(self) -> None:
        if self._client is not None:
            msg = self._client.session.msg("interrupt_request", {})
            self._client.control_channel.send(msg)

    async def execute(self, code: str, timeout: float = 60.0,  # noqa: ASYNC109
                      interrupt_grace_s: float = 2.0) -> CellResult:
        async with self._lock:
            if not self.alive or self._client is None:
                await self.close()
                await self._launch(scaled(KERNEL_STARTUP_S))
                prefix = "[the kernel had died and was restarted; earlier state is lost]\n"
            else:
                prefix = ""
            res = await self._execute(code, timeout, interrupt_grace_s)
            if prefix:
                res.output = prefix + res.output
            return res

    async def _execute(self, code: str, timeout: float, grace: float) -> CellResult:  # noqa: ASYNC109
        client = self._client
        msg_id = client.execute(code, store_history=True, allow_stdin=False)
        parts: list[str] = []
        rich: list[Mapping[str, Any]] = []
        state = {"error": ""}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        interrupted = False
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                if interrupted:
                    await self.close()
                    await self._launch(scaled(KERNEL_STARTUP_S))
                    return CellResult("".join(parts) + f"\n[timed out after {timeout:g} s and "
                                      "ignored the interrupt: the kernel was restarted, all "
                                      "variables are lost]", "restarted", "Timeout", rich)
                interrupted = True
                await self.interrupt()
                deadline = loop.time() + grace
                continue
            try:
                msg = await client.get_iopub_msg(timeout=remaining)
            except Exception:  # queue.Empty on timeout
                if not self.alive:
                    await self.close()
                    await self._launch(scaled(KERNEL_STARTUP_S))
                    return CellResult("".join(parts) + "\n[the kernel died (out of memory or "
                                      "killed); it was restarted, all variables are lost]",
                                      "restarted", "KernelDied", rich)
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if self._collect(msg, parts, rich, state):
                break
        with contextlib.suppress(Exception):
            await client.get_shell_msg(timeout=1.0)
        out = "".join(parts)
        if interrupted:
            return CellResult(out + f"\n[timed out after {timeout:g} s; interrupted]",
                              "timeout", "KeyboardInterrupt", rich)
        return CellResult(out, "error" if state["error"] else "ok", state["error"], rich)

    @staticmethod
    def _collect(msg: Mapping[str, Any], parts: list[str], rich: list[Mapping[str, Any]],
                 state: dict[str, str]) -> bool:
        kind, content = msg["msg_type"], msg["content"]
        if kind == "status":
            return bool(content.get("execution_state") == "idle")
        if kind == "stream":
            parts.append(content.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            data = content.get("data", {})
            rich.append(data)
            text = data.get("text/plain", "")
            others = [k for k in data if k != "text/plain"]
            if others and not text:
                text = f"[{', '.join(others)} output]"
            parts.append(text + "\n")
        elif kind == "error":
            state["error"] = content.get("ename", "Error")
            parts.append(_ANSI.sub("", "\n".join(content.get("traceback", []))) + "\n")
        return False


class _KernelProcess:
    """The kernel's launcher process, and its only reaper.

    Exit is observed through a pidfd on the event loop, which does not reap: an exited launcher
    stays a zombie until :meth:`stop`, so its pid and process group id (it leads a session)
    cannot be handed to another process before then, and signalling them (here, or the
    sandbox's kill of its tracked pids) reaches only ours.
    """

    def __init__(self, popen: subprocess.Popen[bytes], sandbox: Any) -> None:
        self.popen = popen
        self.pid = popen.pid
        self._sandbox = sandbox
        if sandbox is not None:
            sandbox.track(popen.pid)
        self.exited = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._pidfd = os.pidfd_open(popen.pid)
        self._loop.add_reader(self._pidfd, self._on_exit)

    def _on_exit(self) -> None:
        self._loop.remove_reader(self._pidfd)
        self.exited.set()

    def _unwatch(self) -> None:
        if self._pidfd >= 0:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1

    async def stop(self, wait_s: float) -> int | None:
        """SIGKILL the launch (its process group holds the sandbox's PID 1) unless it already
        exited, wait up to ``wait_s`` for the exit, and reap it. Returns its exit status, or
        None when it outlived the wait (a daemon thread reaps it whenever it goes)."""
        if not self.exited.is_set():
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(self.pid, signal.SIGKILL)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):  # (not wait_for: see tools/bash.py _wait)
                    await self.exited.wait()
        finally:  # also when cancelled: the process was killed, it must still be reaped
            self._unwatch()
            # Untracked before the reap: from then on its pid may name a stranger.
            if self._sandbox is not None and hasattr(self._sandbox, "untrack"):
                self._sandbox.untrack(self.pid)
            # poll() reaps only an exited child, and only ours: nothing else waits for it.
            if self.popen.poll() is None:
                threading.Thread(target=self.popen.wait, daemon=True,
                                 name=f"reap-kernel-{self.pid}").start()
        return self.popen.returncode


def _spawn(argv: list[str], env: dict[str, str], log: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            start_new_session=True)


def _discard_spawned(fut: asyncio.Future[subprocess.Popen[bytes]]) -> None:
    """A kernel whose starter was cancelled while it spawned: kill it and reap it."""
    if fut.cancelled() or fut.exception() is not None:
        return
    popen = fut.result()
    with contextlib.suppress(Exception):
        procs.kill_pid(popen.pid)
    threading.Thread(target=popen.wait, daemon=True, name=f"reap-kernel-{popen.pid}").start()


async def _wait_ready(client: Any, timeout: float) -> None:  # noqa: ASYNC109
    """Until the kernel answers ``kernel_info`` on shell and iopub delivers too (ZeroMQ
    subscriptions join late, so a reply alone does not prove iopub is connected).

    Not ``client.wait_for_ready``: without a KernelManager it judges liveness by heartbeats,
    and its heartbeat channel calls a kernel dead after 1 s without a pong, which is an
    ordinary start on a loaded machine (the kernel binds its heartbeat only once IPython has
    imported). Whether the process died is the caller's question, asked of the process.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        client.kernel_info()
        try:
            reply = await client.get_shell_msg(timeout=1.0)
            if reply["msg_type"] != "kernel_info_reply":
                continue
            await client.get_iopub_msg(timeout=0.2)
        except queue.Empty:
            continue  # not up yet (or iopub not joined): ask again
        with contextlib.suppress(queue.Empty):  # drop the status messages of the requests
            while True:
                await client.get_iopub_msg(timeout=0.2)
        return
    raise TimeoutError(f"no kernel_info reply within {timeout:g} s")


class IPythonTool:
    """The agent-facing ``python`` tool: a persistent IPython kernel in the sandbox."""

    name = "python"
    description = ("Execute Python code in a persistent IPython kernel inside the sandbox. "
                   "Variables and imports persist between calls. The value of the last "
                   "expression is shown; use print() for anything else.")
    parameters: Mapping[str, Any] = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "Python code to execute."},
            "timeout": {"type": "number", "description": "Seconds before the cell is "
                        "interrupted (default 60)."},
        },
        "required": ["code"],
    }

    def __init__(self, sandbox: Any, default_timeout: float = 60.0,
                 max_output: int = 16 * 1024, max_timeout: float = 600.0) -> None:
        self.sandbox = sandbox
        self.default_timeout = default_timeout
        self.max_output = max_output
        self.max_timeout = max_timeout

    async def run(self, code: str, timeout: float | None = None) -> CellResult:  # noqa: ASYNC109
        kernel = await self.sandbox.ipython()
        return await kernel.execute(code, min(timeout or self.default_timeout, self.max_timeout))

    async def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult("python needs a string argument 'code'", is_error=True)
        timeout = arguments.get("timeout")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            return ToolResult("'timeout' must be a positive number of seconds", is_error=True)
        res = await self.run(code, float(timeout) if timeout is not None else None)
        out = res.output
        if len(out) > self.max_output:
            half = self.max_output // 2
            out = (f"{out[:half]}\n[... {len(out) - 2 * half} characters truncated ...]\n"
                   f"{out[-half:]}")
        return ToolResult(out, is_error=not res.ok)
