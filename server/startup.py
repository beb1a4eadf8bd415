"""What a server claims before it runs: its state directory (one server each) and its port.

Two servers on one state directory both "recover" the same running jobs, so each job runs twice
and its trajectory is delivered twice; two servers on one port (gRPC's default SO_REUSEPORT)
answer requests in turn. Both are refused here, at start-up, with a one-line reason that says
what to do. The state directory is claimed with an exclusive ``flock`` on ``server.lock``,
which the kernel releases when the holder dies (even by SIGKILL), so no stale lock needs manual
clean-up; the file's content names the holder for the message the next server prints.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import grpc

from rollout.server.api.errors import ServiceError

LOCK_FILE = "server.lock"


class StartupError(ServiceError):
    """The server cannot start; ``str(exc)`` says why and what to change."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str, field: str = "") -> None:
        super().__init__(message, reason, field)
        self.code = code


def state_dir_not_writable(path: Path, exc: OSError) -> StartupError:
    why = exc.strerror or str(exc)
    return StartupError(grpc.StatusCode.PERMISSION_DENIED, "STATE_DIR_NOT_WRITABLE",
                        f"cannot write the state directory {path} ({why}); make it writable "
                        "or choose another with --state-dir DIR", "server.state_dir")


class StateDirLock:
    """An exclusive claim on one state directory for the life of this process (or until
    ``release``). The lock file records ``{"pid", "address", "since"}`` of the holder."""

    def __init__(self, state_dir: Path, fd: int) -> None:
        self.state_dir = state_dir
        self._fd = fd
        self._holder: dict[str, Any] = {"pid": os.getpid(), "address": "",
                                        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    @classmethod
    def acquire(cls, state_dir: Path) -> StateDirLock:
        """Create ``state_dir`` if needed and lock it, or raise ``StartupError``."""
        not_a_dir = next((p for p in (state_dir, *state_dir.parents)
                          if p.exists() and not p.is_dir()), None)
        if not_a_dir is not None:
            problem = ("is a file, not a directory" if not_a_dir == state_dir
                       else f"cannot be created: {not_a_dir} is a file")
            raise StartupError(grpc.StatusCode.INVALID_ARGUMENT, "BAD_CONFIG",
                               f"the state directory {state_dir} {problem}; pass --state-dir "
                               "DIR naming a directory (created if missing)", "server.state_dir")
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            # O_CLOEXEC: sandboxes and kernels this server starts must not inherit the lock,
            # or one that outlived a crashed server would keep its successor out.
            fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise state_dir_not_writable(state_dir, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise state_dir_not_writable(state_dir, exc) from None
            raise StartupError(grpc.StatusCode.FAILED_PRECONDITION, "STATE_DIR_LOCKED",
                               f"state directory {state_dir} is in use by another rollout "
                               f"server ({holder}); stop that server, or give this one its own "
                               "directory with --state-dir DIR", "server.state_dir") from None
        lock = cls(state_dir, fd)
        try:
            lock._write()
        except OSError as exc:
            lock.release()
            raise state_dir_not_writable(state_dir, exc) from None
        return lock

    def record_address(self, address: str) -> None:
        """Add the address the server listens on (known only after the port is bound)."""
        self._holder["address"] = address
        with contextlib.suppress(OSError):  # the message for a rival is a courtesy
            self._write()

    def _write(self) -> None:
        data = (json.dumps(self._holder) + "\n").encode()
        # Write then truncate (never truncate first), so a rival reading at the same moment
        # sees the old or the new holder, not an empty file.
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))

    def release(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = -1


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or not info.get("pid"):
        return "pid unknown: it is still starting or its lock file was rewritten"
    where = f", listening on {info['address']}" if info.get("address") else ", still starting"
    return f"pid {info['pid']}{where}"


def check_port_range(port: int, name: str = "server.port", flag: str = "--port") -> None:
    if not 0 <= port <= 65535:
        # gRPC would take 99999 modulo 65536 and listen somewhere nobody expects.
        raise StartupError(grpc.StatusCode.INVALID_ARGUMENT, "BAD_PORT",
                           f"{name} ({flag}) must be between 0 and 65535 (0 = any free port), "
                           f"got {port}", name)


def port_in_use(host: str, port: int, what: str = "", flag: str = "--port",
                holder: str = "another rollout server or another program") -> StartupError:
    """``what``: which of the server's listeners, when it is not the gRPC one."""
    return StartupError(grpc.StatusCode.FAILED_PRECONDITION, "PORT_IN_USE",
                        f"{host}:{port}{f' ({what})' if what else ''} is already in use by "
                        f"{holder}; stop it, or choose another port with {flag} N "
                        "(0 = any free port)")


async def who_listens(host: str, port: int, service: str) -> str:
    """Ask whoever holds ``host:port`` for the health of ``service``: a rollout server answers,
    any other gRPC server says it does not know it, anything else fails to speak gRPC."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = "127.0.0.1" if host in ("", "0.0.0.0") else host
    async with grpc.aio.insecure_channel(f"{target}:{port}") as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED):
                return "another gRPC server (not a rollout server)"
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                return "another rollout server (it asks for a token)"
            return "another program"
    return "another rollout server (it answers health checks there)"


def check_port_free(host: str, port: int, what: str = "", flag: str = "--port") -> None:
    """Fail before the slow part of start-up (loading a model) when ``host:port`` cannot be
    bound. The real bind happens later and is checked again; this only answers early, and
    with a reason gRPC's own "Failed to bind" does not give."""
    check_port_range(port, flag=flag)
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise bad_host(host, exc.strerror or str(exc)) from None
    usable = 0
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as probe:
            # gRPC sets SO_REUSEADDR too, so a port in TIME_WAIT is not reported as taken.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(addr)
                usable += 1
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise port_in_use(host, port, what, flag) from None
                if exc.errno == errno.EACCES:
                    raise StartupError(grpc.StatusCode.PERMISSION_DENIED, "PORT_NOT_ALLOWED",
                                       f"not allowed to listen on {host}:{port}; ports below "
                                       f"1024 need privileges: choose another with {flag} N"
                                       ) from None
                # EADDRNOTAVAIL, EAFNOSUPPORT: gRPC skips such an address and binds the others
    if not usable:
        raise bad_host(host, "not an address of this machine")


def bad_host(host: str, why: str) -> StartupError:
    return StartupError(grpc.StatusCode.INVALID_ARGUMENT, "BAD_HOST",
                        f"cannot listen on host {host!r} ({why}); use an address of this "
                        "machine such as 127.0.0.1 or 0.0.0.0 (--host)", "server.host")
