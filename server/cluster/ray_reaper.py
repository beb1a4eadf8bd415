"""Take the private Ray of ``rollout serve --workers N`` down with the server, even by SIGKILL.

Ray shares the fate of the processes ``ray.init`` starts itself (the kernel kills GCS and raylet
when the server dies), but not of the ones the raylet starts: its dashboard agent and
runtime-env agent notice the raylet is gone within seconds and then spend a minute trying to
report that to the dead GCS before they exit, and node-agent workers can linger too. A server
restarted meanwhile finds a machine still busy with the old cluster.

This is a small process of its own (spawned, never forked from the gRPC server process, in its
own session so a signal to the server's group does not take it first). Its stdin is a pipe
from the server: the kernel closes it when the server dies, however it dies. It then kills
every process it saw the raylet start (listed every second while the raylet lives, each with
its start time, so a pid reused since is left alone). A graceful stop closes the pipe after
``ray.shutdown``; the sweep then finds nothing left, or the stragglers.

Run as ``python -m rollout.server.cluster.ray_reaper``; it reads the raylet's pid from stdin,
then waits for end of file.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

POLL_S = 1.0
"""How often the raylet's process tree is listed (Ray starts workers on demand)."""


def spawn(raylet_pid: int) -> subprocess.Popen[bytes]:
    """Start the reaper for this server's Ray; keep the returned object referenced until the
    cluster is shut down, then :func:`release` it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout.server.cluster.ray_reaper"], stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
        start_new_session=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdin is not None
    proc.stdin.write(f"{raylet_pid}\n".encode())
    proc.stdin.flush()
    return proc


def release(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """A graceful stop: close the pipe (the reaper sweeps once) and wait for it."""
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2:].split()  # the name may hold spaces and parentheses
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Live descendants of ``root``: pid -> start time (which tells a reused pid apart)."""
    parent_of: dict[int, tuple[int, int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            parent_of[int(entry.name)] = st
    found: dict[int, int] = {}
    frontier = {root}
    while frontier:
        frontier = {pid for pid, (ppid, _) in parent_of.items()
                    if ppid in frontier and pid not in found}
        found.update({pid: parent_of[pid][1] for pid in frontier})
    return found


def sweep(known: dict[int, int]) -> list[int]:
    """SIGKILL the processes of ``known`` that are still the same processes."""
    killed = []
    for pid, started in known.items():
        st = _stat(pid)
        if st is None or st[1] != started or pid == os.getpid():
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the terminal is the server's
    first = sys.stdin.buffer.readline().strip()
    if not first.isdigit():
        return 0
    raylet = int(first)
    # Orphans lose every trace of the raylet (Ray's agents even rewrite their environment
    # with their process titles), so what it started is listed while it lives.
    known: dict[int, int] = {}
    stdin = sys.stdin.buffer.fileno()
    while True:
        known.update(descendants(raylet))
        ready, _, _ = select.select([stdin], [], [], POLL_S)
        if ready and not os.read(stdin, 4096):  # the server closed the pipe, or died
            break
    sweep(known)
    return 0


if __name__ == "__main__":
    sys.exit(main())
