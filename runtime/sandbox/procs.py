"""Process plumbing shared by the runtimes: run-to-completion with caps, and kill-by-uid.

Everything here is asynchronous or runs in a worker thread, so a sandbox never blocks the
event loop of the server that hosts hundreds of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from runtime.sandbox.base import ExecResult

T = TypeVar("T")


class _Capped:
    """Keeps the head and the tail of a stream; drops (and counts) the middle."""

    def __init__(self, limit: int) -> None:
        self.head_limit = limit // 2
        self.tail_limit = limit - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def feed(self, data: bytes) -> None:
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            extra = len(self.tail) - self.tail_limit
            if extra > 0:
                del self.tail[:extra]
                self.dropped += extra

    def text(self) -> str:
        head = self.head.decode("utf-8", "backslashreplace")
        tail = self.tail.decode("utf-8", "backslashreplace")
        if self.dropped:
            return f"{head}\n[... {self.dropped} bytes of output truncated ...]\n{tail}"
        return head + tail


async def _pump(stream: asyncio.StreamReader | None, sink: _Capped) -> None:
    if stream is None:
        return
    while chunk := await stream.read(65536):
        sink.feed(chunk)


async def run_collect(argv: Sequence[str], *, env: Mapping[str, str], timeout: float,  # noqa: ASYNC109
                      stdin: bytes | None = None, max_output: int = 1 << 20,
                      on_spawn: object = None, on_exit: object = None,
                      kill_grace_s: float = 0.0) -> ExecResult:
    """Run ``argv`` (a whole sandbox launcher line) to completion.

    On timeout or cancellation the process is killed: the launcher is the sandbox's PID
    namespace anchor, so killing it takes every descendant with it, including commands that
    ignore SIGINT/SIGTERM.
    """
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *argv, env=dict(env), stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    if callable(on_spawn):
        on_spawn(proc.pid)
    out, err = _Capped(max_output), _Capped(max_output)
    timed_out = False
    try:
        if stdin is not None and proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                proc.stdin.write(stdin)
                await proc.stdin.drain()
            proc.stdin.close()
        pumps = asyncio.gather(_pump(proc.stdout, out), _pump(proc.stderr, err), proc.wait())
        try:
            await asyncio.wait_for(asyncio.shield(pumps), timeout)
        except TimeoutError:
            timed_out = True
            _kill_group(proc.pid, signal.SIGINT if kill_grace_s else signal.SIGKILL)
            if kill_grace_s:
                try:
                    await asyncio.wait_for(asyncio.shield(proc.wait()), kill_grace_s)
                except TimeoutError:
                    _kill_group(proc.pid, signal.SIGKILL)
            await pumps
    except BaseException:
        _kill_group(proc.pid, signal.SIGKILL)
        raise
    finally:
        if proc.returncode is None:
            _kill_group(proc.pid, signal.SIGKILL)
        if callable(on_exit):
            on_exit(proc.pid)
    code = proc.returncode if proc.returncode is not None else -1
    if code < 0:
        code = 128 - code
    stderr = err.text()
    if timed_out:
        stderr += f"\n[command timed out after {timeout:g} s and was killed]\n"
    return ExecResult(exit_code=code, stdout=out.text(), stderr=stderr, timed_out=timed_out,
                      truncated=bool(out.dropped or err.dropped),
                      duration_s=time.perf_counter() - start)


def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def kill_pid(pid: int) -> None:
    """SIGKILL a launcher we started (and its session, when it leads one)."""
    _kill_group(pid, signal.SIGKILL)


def kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` with one ``kill(-1)`` issued *as* that uid.

    kill(-1) reaches all processes the caller may signal, so it stops a fork bomb that a
    pid-by-pid scan would chase forever. Only meaningful (and only called) when the server is
    root and each sandbox has its own uid.
    """
    for _ in range(3):
        subprocess.run(["kill", "-KILL", "-1"], user=uid, group=uid, extra_groups=[],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        if not uid_has_processes(uid):
            return


def uid_has_processes(uid: int) -> bool:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                return True
        except OSError:
            continue
    return False


class UidLease:
    """An exclusive claim on one sandbox uid, held by an flock for the sandbox's lifetime.

    File locks die with the process, so a crashed server's uids become free again and
    several servers on one host never hand out the same uid.
    """

    def __init__(self, uid: int, fd: int) -> None:
        self.uid = uid
        self._fd = fd

    @classmethod
    def acquire(cls, lock_dir: Path, base: int, count: int) -> UidLease:
        lock_dir.mkdir(parents=True, exist_ok=True)
        start = random.randrange(count)
        for i in range(count):
            uid = base + (start + i) % count
            fd = os.open(lock_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return cls(uid, fd)
        raise RuntimeError(f"all {count} sandbox uids from {base} are in use")

    @staticmethod
    def try_claim(lock_dir: Path, uid: int) -> UidLease | None:
        """Claim a specific uid if nobody holds it (the reaper uses this)."""
        try:
            fd = os.open(lock_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return UidLease(uid, fd)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spawn")


async def in_spawner(fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking spawn in one long-lived thread.

    bwrap's ``--die-with-parent`` is PR_SET_PDEATHSIG, which fires when the *thread* that
    forked it exits; default-executor threads may come and go, this one stays for the life
    of the process, so long-lived sandbox processes are not killed by a thread retiring.
    """
    return await asyncio.get_running_loop().run_in_executor(_SPAWNER, functools.partial(fn, *args))
