"""The build network's allow-list: a Dockerfile's ``RUN`` steps reach the hosts it names and
the image registries, and nothing else.

buildah's ``--network`` knows only the host's network or none, and proxy variables alone are
advice a ``RUN`` step may ignore. So a confined build runs buildah in a network namespace of its
own (``unshare --net``: only a loopback, no route out) in which this module listens on
loopback before buildah starts (the listening sockets are made by a thread that enters the
namespace for that moment, ``setns``), and serves them from the server's own network:

- ``127.0.0.1:PROXY_PORT`` is an HTTP proxy (``CONNECT`` for HTTPS, absolute-URI requests for
  plain HTTP) that connects only to allowed hosts and answers every other with ``403`` and a
  line naming the host and the setting, which the build log shows; buildah hands
  ``HTTP_PROXY``/``HTTPS_PROXY`` (and the lower-case spellings) to every ``RUN`` step, which
  ``apt``, ``pip``, ``curl`` and Python's ``urllib`` honour.
- a registry of ``registries.conf`` on loopback (an offline cluster's mirror on the build
  machine) gets its port forwarded as is: Go, which buildah is written in, never proxies
  loopback addresses.

A step that ignores the proxy (its own sockets, a hard-coded resolver) has no route anywhere.
The registries named in ``registries.conf`` (locations and mirrors) are allowed
automatically, so ``FROM`` works; a ``FROM`` of another registry needs its hosts listed.
A root server makes the namespace with ``unshare --net`` and enters it (``setns``) to listen. A
rootless server cannot enter a namespace (``setns`` wants ``CAP_SYS_ADMIN`` in the caller's
own user namespace), so :mod:`netns_listen` moves into a user, network and mount namespace
of its own, the server maps that user namespace as rootless buildah maps its own (0 itself,
1.. its subordinate ranges), the helper listens inside and passes the sockets out
(``SCM_RIGHTS``), then becomes buildah; a rootless server without subordinate ids cannot
confine its builds.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import ipaddress
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rollout.runtime.sandbox.images import subids

_CLONE_NEWNET = 0x40000000
PROXY_PORT = 3128
READY_S = 30.0
HEAD_LIMIT = 64 << 10
SETTING = "sandbox.image_build_hosts"
MAX_CONNECTIONS = 128
"""Connections one :class:`AllowListProxy` serves at once (the in-sandbox relay's own bound)."""
MAX_NOTED = 1000
"""Refusals (and failures) one :class:`AllowListProxy` records; later ones are answered alike."""
HELPER = Path(__file__).with_name("netns_listen.py")
_LOOPBACK = ("localhost", "127.0.0.1", "::1", "[::1]")


@dataclass(frozen=True)
class AllowList:
    """Hosts a build may reach: ``host`` (ports 80 and 443), ``host:port``, or ``*.domain``
    (every name below ``domain``, ports 80 and 443)."""

    entries: tuple[str, ...]

    def allows(self, host: str, port: int) -> bool:
        host = host.strip("[]").lower().rstrip(".")
        for entry in self.entries:
            name, _, want = entry.lower().rpartition(":") if _has_port(entry) else (
                entry.lower(), "", "")
            ports = {int(want)} if want else {80, 443}
            if port not in ports:
                continue
            name = name.strip("[]")
            if name.startswith("*."):
                if host.endswith(name[1:]):
                    return True
            elif host == name:
                return True
        return False


def _has_port(entry: str) -> bool:
    head, sep, tail = entry.rpartition(":")
    return bool(sep) and tail.isdigit() and (not head.startswith("[") or head.endswith("]"))


def check_entries(entries: Sequence[str]) -> tuple[str, ...]:
    """The entries of ``sandbox.image_build_hosts``, checked; ValueError says which is bad."""
    out = []
    for entry in entries:
        e = entry.strip()
        name = e.rpartition(":")[0] if _has_port(e) else e
        bare = name.removeprefix("*.").strip("[]")
        if not bare or any(c.isspace() or c in "/@?#," for c in e) or bare.startswith("."):
            raise ValueError(f"{entry!r} is not a host, host:port or *.domain")
        out.append(e)
    return tuple(out)


def registry_endpoints(conf_path: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(allow-list entries, loopback ports to forward) for the registries a registries.conf
    names (each ``location`` and mirror ``location``); unreadable or absent: none."""
    try:
        conf = tomllib.loads(Path(conf_path).read_text()) if conf_path else {}
    except (OSError, tomllib.TOMLDecodeError):
        return (), ()
    locations: list[str] = []
    for reg in conf.get("registry", []) if isinstance(conf.get("registry"), list) else []:
        if not isinstance(reg, Mapping):
            continue
        locations.append(str(reg.get("location") or reg.get("prefix") or ""))
        for mirror in reg.get("mirror", []) if isinstance(reg.get("mirror"), list) else []:
            if isinstance(mirror, Mapping):
                locations.append(str(mirror.get("location", "")))
    allow: list[str] = []
    forwards: list[int] = []
    for loc in locations:
        hostport = loc.split("/", 1)[0]
        if not hostport:
            continue
        parts = urlsplit(f"//{hostport}")
        host, port = parts.hostname or "", parts.port
        if host in _LOOPBACK:
            forwards.append(port or 443)
        elif host:
            allow.append(f"{host}:{port}" if port else host)
    return tuple(allow), tuple(sorted(set(forwards)))


def proxy_env(port: int = PROXY_PORT) -> dict[str, str]:
    url = f"http://127.0.0.1:{port}"
    return {"HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url,
            "NO_PROXY": "localhost,127.0.0.1,::1", "no_proxy": "localhost,127.0.0.1,::1"}


class Egress:
    """The listeners of one confined build and the thread serving them."""

    def __init__(self, allow: AllowList, forwards: Sequence[int]) -> None:
        self.allow = allow
        self.forwards = tuple(forwards)
        self.port = next(p for p in range(PROXY_PORT, PROXY_PORT + 100)
                         if p not in self.forwards)
        self.proxy = AllowListProxy(allow, "rollout build network",
                                    f"only the image registries and {SETTING}")
        self._socks: list[tuple[socket.socket, int | None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def refused(self) -> list[str]:
        """``host:port`` of every request the allow-list refused, in order."""
        return self.proxy.refused

    def ports(self) -> tuple[int, ...]:
        """The loopback ports inside the build's namespace: the proxy's, then the forwards."""
        return (self.port, *self.forwards)

    def adopt(self, fds: Sequence[int]) -> None:
        """Take the listening sockets made inside the namespace (in :meth:`ports` order)."""
        for fd, upstream in zip(fds, (None, *self.forwards), strict=True):
            sock = socket.socket(fileno=fd)
            sock.setblocking(False)
            self._socks.append((sock, upstream))

    def bind_in(self, pid: int) -> None:
        """Make the listening sockets inside the network namespace of ``pid``."""
        outcome: dict[str, BaseException] = {}

        def work() -> None:
            libc = ctypes.CDLL(None, use_errno=True)
            own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(target, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into the build's network: {os.strerror(err)}")
                try:
                    for port, upstream in zip(self.ports(), (None, *self.forwards),
                                              strict=True):
                        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                        sock.bind(("127.0.0.1", port))
                        sock.listen(128)
                        sock.setblocking(False)
                        self._socks.append((sock, upstream))
                finally:
                    # This thread ends right after; back in the server's namespace anyway.
                    libc.setns(own, _CLONE_NEWNET)
            except BaseException as e:
                outcome["error"] = e
            finally:
                os.close(own)
                os.close(target)

        t = threading.Thread(target=work, name="build-egress-bind")
        t.start()
        t.join()
        if "error" in outcome:
            self.close()
            raise outcome["error"]

    def start(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(loop)
            for sock, upstream in self._socks:
                loop.run_until_complete(asyncio.start_server(
                    self.proxy.handle if upstream is None else self._forwarder(upstream),
                    sock=sock, limit=HEAD_LIMIT))
            started.set()
            loop.run_forever()

        self._thread = threading.Thread(target=serve, name="build-egress", daemon=True)
        self._thread.start()
        started.wait(10)

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and self._thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(10)
            with contextlib.suppress(Exception):
                for task in asyncio.all_tasks(loop):
                    task.cancel()
                loop.close()
        for sock, _ in self._socks:
            with contextlib.suppress(OSError):
                sock.close()
        self._socks = []

    def _forwarder(self, port: int):  # type: ignore[no-untyped-def]
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_r, up_w = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", port), READY_S)
            except (OSError, TimeoutError):
                writer.close()
                return
            await _pipe(reader, writer, up_r, up_w)
        return handle

class AllowListProxy:
    """An HTTP proxy (``CONNECT`` for HTTPS, absolute-URI requests for plain HTTP) that
    connects only to the hosts of ``allow`` and answers every other request with ``403`` and a
    line naming the host and what is reachable. Serve :meth:`handle` with
    ``asyncio.start_server`` or ``start_unix_server``.

    A host is checked by the name the request gives, then resolved once here and connected to
    at that address; a name that resolves to a loopback, link-local or unspecified address is
    refused unless the allowed entry itself names a loopback (``127.0.0.1:8080``,
    ``localhost``): an allowed name is never a way to the server's own services.

    What the other side controls is bounded: at most ``max_connections`` at once (one past
    them is closed unanswered), the first :data:`MAX_NOTED` refusals and failures recorded,
    and :meth:`close` ends every connection still open (an upstream that never closes would
    otherwise hold its task and descriptors after the command that opened it is gone)."""

    def __init__(self, allow: AllowList, label: str, reachable: str, *,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.allow, self.label, self.reachable = allow, label, reachable
        self.max_connections = max_connections
        self.refused: list[str] = []
        """``host:port`` of the requests the allow-list refused, in order."""
        self.failed: list[str] = []
        """``host:port: why`` of the allowed hosts that could not be reached (a 502)."""
        self._open: set[asyncio.Task[Any]] = set()

    def close(self) -> None:
        """End every connection still open (their handlers are cancelled)."""
        for task in list(self._open):
            task.cancel()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is None or len(self._open) >= self.max_connections:
            writer.close()
            return
        self._open.add(task)
        try:
            await self._serve(reader, writer)
        finally:
            self._open.discard(task)
            writer.close()

    def _note(self, into: list[str], what: str) -> None:
        if len(into) < MAX_NOTED:
            into.append(what)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READY_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError):
            writer.close()
            return
        line, _, rest = head.partition(b"\r\n")
        parts = line.decode("latin-1").split()
        if len(parts) != 3:
            await _answer(writer, 400, "not an HTTP proxy request")
            return
        method, target, version = parts
        if method.upper() == "CONNECT":
            split = urlsplit(f"//{target}")
            try:
                host, port, forward = split.hostname or "", split.port or 443, b""
            except ValueError:
                await _answer(writer, 400, f"not a host:port: {target[:100]!r}")
                return
        else:
            split = urlsplit(target)
            try:
                port = split.port or 80
            except ValueError:
                port = -1
            if split.scheme != "http" or not split.hostname or port < 0:
                await _answer(writer, 400, f"this proxy takes http:// URLs and CONNECT, "
                                           f"not {target[:100]!r}")
                return
            host = split.hostname
            path = (split.path or "/") + (f"?{split.query}" if split.query else "")
            forward = f"{method} {path} {version}\r\n".encode("latin-1") + rest
        address = await self._address(host, port) if self.allow.allows(host, port) else None
        if address is None:
            self._note(self.refused, f"{host}:{port}")
            await _answer(writer, 403, f"{self.label}: {host}:{port} is not allowed "
                                       f"({self.reachable})")
            return
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection(address, port),
                                                READY_S)
        except (OSError, TimeoutError) as e:
            self._note(self.failed, f"{host}:{port}: {e or type(e).__name__}")
            await _answer(writer, 502, f"{self.label}: {host}:{port}: {e}")
            return
        if forward:
            up_w.write(forward)
        else:
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await _pipe(reader, writer, up_r, up_w)

    async def _address(self, host: str, port: int) -> str | None:
        """The address to connect to for an allowed ``host``; None where it resolves to
        this machine's own addresses without being named as one."""
        bare = host.strip("[]")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                bare, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return bare  # the connection's own error names it
        if not infos:
            return bare
        address = str(infos[0][4][0])
        ip = ipaddress.ip_address(address)
        local = ip.is_loopback or ip.is_link_local or ip.is_unspecified
        if local and not _names_loopback(bare):
            return None
        return address


def _names_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _answer(writer: asyncio.StreamWriter, code: int, text: str) -> None:
    reason = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway"}[code]
    body = (text + "\n").encode()
    writer.write(f"HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain\r\nContent-Length: "
                 f"{len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    with contextlib.suppress(OSError):
        await writer.drain()
    writer.close()


async def _pipe(r1: asyncio.StreamReader, w1: asyncio.StreamWriter,
                r2: asyncio.StreamReader, w2: asyncio.StreamWriter) -> None:
    async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(1 << 16):
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                if dst.can_write_eof():
                    dst.write_eof()

    try:
        await asyncio.gather(copy(r1, w2), copy(r2, w1))
    finally:
        for w in (w1, w2):
            w.close()


def run_confined(argv: Sequence[str], egress: Egress, log_path: Path, timeout: float,
                 env: Mapping[str, str], ids: subids.SubIds | None = None) -> int | None:
    """Run ``argv`` (buildah) with its output appended to ``log_path`` in a network namespace
    whose only exits are ``egress``'s listeners; None when killed at the deadline. A root
    server (``ids`` None) makes the namespace with ``unshare --net`` and its listeners by
    ``setns``; a rootless one (``ids``: its subordinate ranges) cannot enter a namespace, so
    :mod:`netns_listen` makes them inside a user namespace of the server's own and hands them
    out."""
    if ids is not None:
        return _run_rootless(argv, egress, log_path, timeout, env, ids)
    ip = shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip")
                                     if os.path.exists(p)), "ip")
    # The namespace's loopback comes up, then the shell says so and waits until the
    # listeners are there before it becomes buildah (its output then goes to the log).
    script = ('"$1" link set lo up || exit 97; log=$2; shift 2; echo ready; '
              'read -r _ || exit 98; exec "$@" >>"$log" 2>&1')
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            ["unshare", "--net", "--", "sh", "-c", script, "sh", ip, str(log_path), *argv],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
            env={**env, **proxy_env(egress.port)}, start_new_session=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        ok, _, _ = select.select([proc.stdout], [], [], READY_S)
        if not ok or proc.stdout.readline().strip() != b"ready":
            raise OSError(errno.EIO, "the build's network namespace did not come up "
                                     f"(the build log ends: {_log_tail(log_path)})")
        egress.bind_in(proc.pid)
        egress.start()
        proc.stdin.write(b"go\n")
        proc.stdin.close()
        return _wait(proc, timeout)
    finally:
        proc.stdout.close()
        _stop(proc, egress)


def _run_rootless(argv: Sequence[str], egress: Egress, log_path: Path, timeout: float,
                  env: Mapping[str, str], ids: subids.SubIds) -> int | None:
    """:func:`run_confined` for a server that is not root: :mod:`netns_listen` moves into a
    user, network and mount namespace of its own, the server maps the user namespace (0
    itself, 1.. its ranges, as rootless buildah maps its own), the helper sends the listeners
    made inside, then becomes buildah, told it already runs in its user namespace (so it does
    not make another, with no network namespace, of its own)."""
    ours, theirs = socket.socketpair()
    ours.settimeout(READY_S)
    run_env = {**env, **proxy_env(egress.port), "_CONTAINERS_USERNS_CONFIGURED": "done",
               "_CONTAINERS_ROOTLESS_UID": str(os.getuid()),
               "_CONTAINERS_ROOTLESS_GID": str(os.getgid())}
    try:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(HELPER), str(theirs.fileno()),
                 *map(str, egress.ports()), "--", *argv],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=run_env,
                pass_fds=(theirs.fileno(),), start_new_session=True)
    finally:
        theirs.close()
    try:
        try:
            _expect(ours, b"mapme")
            errors = subids.write_maps(proc.pid, ids, READY_S)
            if errors:
                raise OSError(errno.EPERM, "could not map the build's user namespace: "
                                           + "; ".join(errors))
            ours.sendall(b"go\n")
            want = len(egress.ports())
            msg, fds, _, _ = socket.recv_fds(ours, 64, want)
            if msg.strip() != b"fds" or len(fds) != want:
                for fd in fds:
                    os.close(fd)
                raise OSError(errno.EIO, "no listeners came back")
            egress.adopt(fds)
            egress.start()
            ours.sendall(b"run\n")
        except (OSError, TimeoutError) as e:
            raise OSError(errno.EIO, f"the build's network namespace did not come up ({e}; "
                                     f"the build log ends: {_log_tail(log_path)})") from e
        return _wait(proc, timeout)
    finally:
        ours.close()
        _stop(proc, egress)


def _expect(ctrl: socket.socket, word: bytes) -> None:
    got = b""
    while not got.endswith(b"\n"):
        chunk = ctrl.recv(64)
        if not chunk:
            raise OSError(errno.EIO, f"the helper ended before {word.decode()!r}")
        got += chunk
    if got.strip() != word:
        raise OSError(errno.EIO, f"the helper said {got[:80]!r}, not {word.decode()!r}")


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def _stop(proc: subprocess.Popen[bytes], egress: Egress) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    egress.close()


def _log_tail(log_path: Path, limit: int = 400) -> str:
    try:
        data = log_path.read_bytes()[-limit:]
    except OSError:
        return "(no log)"
    return data.decode(errors="replace").strip() or "(empty)"
