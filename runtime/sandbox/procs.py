"""Process plumbing shared by the runtimes: run-to-completion with caps, and kill-by-uid.

Everything here is asynchronous or runs in a worker thread, so a sandbox never blocks the
event loop of the server that hosts hundreds of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import logging
import os
import random
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from rollout.runtime.sandbox.base import ExecResult
from rollout.runtime.sandbox.output import CappedOutput

T = TypeVar("T")
KILL_WAIT_S = 10.0
"""How long a SIGKILLed launcher gets to be reaped before it is left to a background thread."""
log = logging.getLogger(__name__)
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spawn")


async def run_collect(argv: Sequence[str], *, env: Mapping[str, str], timeout: float,  # noqa: ASYNC109
                      stdin: bytes | None = None, max_output: int = 1 << 20,
                      on_spawn: Callable[[int], None] | None = None,
                      on_exit: Callable[[int], None] | None = None,
                      orphan_needle: bytes | None = None, drain_grace_s: float = 0.5,
                      parked: subprocess.Popen[bytes] | None = None, request: bytes = b"",
                      ) -> ExecResult:
    """Run ``argv`` (a whole sandbox launcher line) to completion.

    Not asyncio's subprocess API: on Python 3.11 its ``wait()`` only returns once every pipe
    is closed, so a process that inherited stdout and outlived the launcher would hang us.
    Exit is watched through a pidfd instead, and pipes get ``drain_grace_s`` after it.

    On timeout or cancellation the launcher's process group is SIGKILLed; the sandbox's PID 1
    is in that group, and its death takes every process of the launch with it (including
    commands that ignore SIGINT). ``orphan_needle`` (see :func:`sweep`) is the backstop.

    ``parked``: a launch started earlier (:func:`spawn_parked`) that waits for its command,
    which ``request`` (:func:`parked_request`) gives it on its stdin; ``argv`` and ``env``
    are then unused (the pool's warm sandboxes: the launch chain ran before the job asked).
    The caller tracked it when it was spawned.
    """
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    header = b""
    if parked is not None:
        proc = parked
        header = request
    else:
        spawn = loop.run_in_executor(_SPAWNER, _popen, list(argv), dict(env),
                                     stdin is not None)
        try:
            proc = await asyncio.shield(spawn)
        except asyncio.CancelledError:
            spawn.add_done_callback(lambda f: _abandon_future(f, orphan_needle))
            raise
        if on_spawn:
            on_spawn(proc.pid)
    out, err = CappedOutput.split(max_output), CappedOutput.split(max_output)
    eofs = [asyncio.Event(), asyncio.Event()]
    exited = asyncio.Event()
    pidfd = os.pidfd_open(proc.pid)
    readers: list[int] = []
    for stream, sink, eof in ((proc.stdout, out, eofs[0]), (proc.stderr, err, eofs[1])):
        assert stream is not None
        fd = stream.fileno()
        os.set_blocking(fd, False)
        loop.add_reader(fd, _read_into, loop, fd, sink, eof)
        readers.append(fd)
    loop.add_reader(pidfd, exited.set)
    feeder = None
    if (stdin is not None or header) and proc.stdin is not None:
        feeder = _StdinFeeder(loop, proc.stdin, header + (stdin or b""))
    timed_out = stuck = False
    try:
        # asyncio.timeout, never wait_for: on Python 3.11 wait_for swallows a cancel that
        # arrives as the awaited thing completes, and a cancelled job then ran on.
        try:
            async with asyncio.timeout(timeout):
                await exited.wait()
        except TimeoutError:
            timed_out = True
            _kill_group(proc.pid, signal.SIGKILL)
            # Bounded too: a launcher stuck in the kernel past SIGKILL must not hold this
            # job (and, at shutdown, the event loop) forever; a thread reaps it later.
            try:
                async with asyncio.timeout(KILL_WAIT_S):
                    await exited.wait()
            except TimeoutError:
                stuck = True
                loop.run_in_executor(None, _abandon, proc, orphan_needle)
        try:
            async with asyncio.timeout(drain_grace_s):
                await asyncio.gather(*(e.wait() for e in eofs))
        except TimeoutError:  # something inherited the pipes and outlived the launcher
            if orphan_needle:
                await asyncio.to_thread(sweep, orphan_needle)
        code = -signal.SIGKILL if stuck else proc.wait()
    except BaseException:
        _kill_group(proc.pid, signal.SIGKILL)
        loop.run_in_executor(None, _abandon, proc, orphan_needle)
        raise
    finally:
        for fd in (*readers, pidfd):
            loop.remove_reader(fd)
        os.close(pidfd)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        if feeder is not None:
            feeder.close()
        if on_exit:
            on_exit(proc.pid)
    if code < 0:
        code = 128 - code
    stderr = err.text()
    if timed_out:
        stderr += f"\n[command timed out after {timeout:g} s and was killed]\n"
    return ExecResult(exit_code=code, stdout=out.text(), stderr=stderr, timed_out=timed_out,
                      truncated=bool(out.dropped or err.dropped),
                      duration_s=time.perf_counter() - start)


def parked_request(argv: Sequence[str], env: Mapping[str, str], cwd: str = "") -> bytes:
    """What a parked launch reads before it execs: one length line, then a JSON object with
    the command, its environment and its directory (``runtime/envs/in_sandbox/parked_exec.py``
    reads it; everything after it on the pipe is the command's own stdin)."""
    body = json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd}).encode()
    return b"%d\n" % len(body) + body


def spawn_parked(argv: Sequence[str], env: Mapping[str, str],
                 pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """Start a launch whose command is the parked waiter (blocking: call it in the spawner,
    :func:`in_spawner`, whose thread outlives the launch, as ``--die-with-parent`` needs).
    ``pass_fds``: the pipe end the waiter signals readiness on."""
    return subprocess.Popen(list(argv), env=dict(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.PIPE, pass_fds=pass_fds,
                            **launch_group())


def _popen(argv: list[str], env: dict[str, str], with_stdin: bool) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL,
                            **launch_group())


def launch_group() -> dict[str, Any]:
    """``Popen`` arguments that put a launch in a process group of its own (one ``killpg``
    ends it), and in a session of its own only while the server has a controlling terminal.

    A new session is what keeps a terminal away from the sandbox (``TIOCSTI`` input
    injection, taking the terminal's foreground), so with one it stays. Without one there
    is no terminal to keep away, and a new session would only cost time: with the kernel's
    autogroup scheduling (``kernel.sched_autogroup_enabled``) every session is a scheduling
    group of its own, and a new group starts with no load history, so the launch's processes
    wait behind the machine's other work (docs/benchmarks.md, "The first command's
    links"). Asked on every launch (one failing ``open``), since a server that leads its
    session could gain a terminal later."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:  # ENXIO: no controlling terminal
        return {"process_group": 0}
    os.close(fd)
    return {"start_new_session": True}


def _read_into(loop: asyncio.AbstractEventLoop, fd: int, sink: CappedOutput,
               eof: asyncio.Event) -> None:
    try:
        data = os.read(fd, 65536)
    except BlockingIOError:
        return
    except OSError:
        data = b""
    if data:
        sink.feed(data)
    else:
        loop.remove_reader(fd)
        eof.set()


class _StdinFeeder:
    """Writes a launch's stdin from the event loop as the pipe takes it, never from a thread.

    A blocking write in a worker thread waited forever when the command never read its stdin
    and a process it left behind kept the pipe open: the launch ended, the thread did not, and
    the end of ``asyncio.run`` (which joins the default executor's threads) hung with it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pipe: Any, data: bytes) -> None:
        self._loop, self._pipe = loop, pipe
        self._view = memoryview(data)
        self._fd = pipe.fileno()
        os.set_blocking(self._fd, False)
        self._watching = True
        loop.add_writer(self._fd, self._write)
        self._write()

    def _write(self) -> None:
        try:
            while self._view:
                self._view = self._view[os.write(self._fd, self._view):]
        except BlockingIOError:
            return  # the pipe is full: the loop calls again when it drains
        except OSError:  # EPIPE: the command closed its stdin or ended
            pass
        self.close()

    def close(self) -> None:
        if self._watching:
            self._watching = False
            self._loop.remove_writer(self._fd)
        with contextlib.suppress(OSError):
            self._pipe.close()


def _abandon(proc: subprocess.Popen[bytes], needle: bytes | None) -> None:
    """Finish off a launch nobody waits for any more (cancelled caller)."""
    with contextlib.suppress(Exception):
        stop_process(proc, kill_wait_s=KILL_WAIT_S)
    if needle:
        sweep(needle)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def _abandon_future(fut: asyncio.Future[subprocess.Popen[bytes]], needle: bytes | None) -> None:
    if not fut.cancelled() and fut.exception() is None:
        threading.Thread(target=_abandon, args=(fut.result(), needle), daemon=True).start()


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
    # setpriv drops to the uid in the child after exec, not subprocess's user=/group=: with
    # those CPython cannot vfork and falls back to fork(), which runs gRPC's at-fork handlers
    # in a server process (docs/architecture.md: never fork from the server).
    for _ in range(3):
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                            "kill", "-KILL", "-1"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, check=False, timeout=10)
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
            lock_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        fd = try_flock(lock_dir / str(uid))
        return None if fd is None else UidLease(uid, fd)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def try_flock(path: Path) -> int | None:
    """Open (creating) ``path`` and take an exclusive flock without waiting. Returns the fd,
    which holds the lock until closed, or None when another process holds it or the file
    cannot be opened: callers treat both as "someone else's"."""
    try:  # O_NOFOLLOW: a lock path is never a link (a stale sandbox dir is no place to trust)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def spawner_barrier(timeout: float = 60.0) -> None:
    """Block until every spawn queued so far has happened (call from a worker thread), so a
    teardown that sweeps afterwards also catches launches whose caller was cancelled.

    At interpreter exit the spawner is shut down and its queue drained: nothing is left to
    wait for, and the teardown that called this must go on (it unmounts the sandbox)."""
    try:
        _SPAWNER.submit(lambda: None).result(timeout=timeout)
    except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
        return
    except TimeoutError:  # a spawn stuck in the kernel: sweep what exists now
        return


def stop_process(proc: Any, *, grace_s: float = 0.0, kill_wait_s: float = 5.0,
                 leader: bool = True) -> int | None:
    """End a child we started and reap it, with every wait bounded (blocking: call it from a
    worker thread). Returns its exit status, or None when it could not be reaped in time.

    ``grace_s`` > 0: SIGTERM and SIGHUP first (to the process group when ``leader``) and that
    long to exit; then, or at once, SIGKILL to the group and the process and ``kill_wait_s``
    to be reaped. A process that stays unreaped after that (stuck in the kernel) is handed to
    a daemon thread that reaps it whenever it goes, so neither this call, nor the event loop's
    executor shutdown, nor the interpreter's exit waits on it.
    """
    if grace_s > 0 and proc.poll() is None:
        _signal(proc.pid, signal.SIGTERM, leader)
        _signal(proc.pid, signal.SIGHUP, leader)
        with contextlib.suppress(subprocess.TimeoutExpired):
            return wait_exit(proc, grace_s)
    if proc.poll() is None:  # (poll reaps: a pid already reaped may belong to someone else)
        _signal(proc.pid, signal.SIGKILL, leader)
    try:
        return wait_exit(proc, kill_wait_s)
    except subprocess.TimeoutExpired:
        log.warning("process %d did not end within %g s of SIGKILL; reaping it in the "
                    "background", proc.pid, kill_wait_s)
    threading.Thread(target=_late_reap, args=(proc,), daemon=True,
                     name=f"reap-{proc.pid}").start()
    return None


def wait_exit(proc: Any, timeout: float) -> int:
    """``proc.wait(timeout)``, woken by the kernel as the process ends (a pidfd) instead of
    by ``Popen.wait``'s polling, whose sleeps double up to 50 ms: a process that took 20 ms to
    end was reaped after ~31 ms (every sandbox teardown stops some: a rootless image
    sandbox's holder, a parked launch, a tool). Raises ``subprocess.TimeoutExpired`` as
    ``wait`` does."""
    if isinstance(proc, subprocess.Popen) and proc.returncode is None:
        try:
            fd = os.pidfd_open(proc.pid)
        except OSError:  # reaped meanwhile (ESRCH), or a kernel before 5.3: wait's own way
            fd = -1
        if fd >= 0:
            try:
                ready = select.poll()
                ready.register(fd, select.POLLIN)
                if not ready.poll(max(0.0, timeout) * 1000):
                    raise subprocess.TimeoutExpired(proc.args, timeout)
            finally:
                os.close(fd)
    return int(proc.wait(timeout=timeout))


def _signal(pid: int, sig: int, leader: bool) -> None:
    if leader:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _late_reap(proc: Any) -> None:
    with contextlib.suppress(Exception):
        proc.wait()


def join_spawner(cgroup_procs: Path) -> None:
    """Ask the spawner thread to join the sandboxes' memory cgroup, so the launches it spawns
    are born inside and skip the per-launch join (``hardening.join_thread``). Queued behind
    the spawns already asked for, never waited on: until it has run, launches join as ever."""
    from rollout.runtime.sandbox import hardening

    if not hardening.thread_joined(cgroup_procs):
        with contextlib.suppress(RuntimeError):  # the interpreter is shutting down
            _SPAWNER.submit(hardening.join_thread, cgroup_procs)


async def in_spawner(fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking spawn in one long-lived thread.

    bwrap's ``--die-with-parent`` is PR_SET_PDEATHSIG, which fires when the *thread* that
    forked it exits; default-executor threads may come and go, this one stays for the life
    of the process, so long-lived sandbox processes are not killed by a thread retiring.
    """
    return await asyncio.get_running_loop().run_in_executor(_SPAWNER, functools.partial(fn, *args))


def sweep(needle: bytes, spare: frozenset[int] = frozenset()) -> int:
    """SIGKILL every process whose command line contains ``needle``, except the pids of
    ``spare``; returns how many.

    Why: killing a bwrap launcher in the few milliseconds before its child (the sandbox's
    PID 1) has armed PR_SET_PDEATHSIG orphans that child, which then finishes setting up and
    runs the command. Launch lines carry a unique ``--setenv ROLLOUT_LAUNCH <tag>``, so
    such orphans can be found by their command line and killed.
    """
    killed = 0
    deadline = time.monotonic() + 5.0
    while True:
        found = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == os.getpid() or int(pid) in spare:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if needle not in f.read():  # zombies have an empty cmdline
                        continue
                os.kill(int(pid), signal.SIGKILL)
                found += 1
            except (OSError, ProcessLookupError):
                continue
        killed += found
        if not found or time.monotonic() > deadline:
            return killed
        time.sleep(0.005)  # let the SIGKILLed processes finish dying, then look again
