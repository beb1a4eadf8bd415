"""Bounds on connections to the HTTP apps the server runs (the model gateway's per-job Unix
sockets, its TCP listener, the dashboard).

Why: the gateway bounded requests but not connections. A harness that opened 25,000
half-sent requests on its own socket took the server to its file-descriptor limit: another
tenant's job then failed in INIT ("Too many open files"), running harnesses timed out, the
dashboard stopped answering, and asyncio logged one traceback per refused accept (hundreds of
MB of log in minutes). So every listener here:

- **caps its connections** (:class:`Listener`: per job lease on its socket, per TCP listener,
  per dashboard); a connection past the cap is closed as soon as it is accepted;
- draws from **one budget per process** (:class:`ConnectionBudget`), kept below the process's
  file-descriptor limit with room reserved for what else needs descriptors (the job store,
  sandboxes and their processes, gRPC, model backends): a flood of connections can use up the
  budget, never the descriptors the rest of the server needs;
- gives each connection **deadlines**: its request's headers must arrive within
  ``header_timeout_s`` of the connection (or of the previous response), its body within
  ``body_timeout_s`` of its headers, and an idle keep-alive connection is closed after
  ``idle_timeout_s``; a connection that sends half a request and waits is closed, not kept;
- on the TCP gateway port (reachable by any local process, no per-job socket), drops a
  connection that has not **authenticated** (a request with a valid job key) within
  ``auth_timeout_s``;
- logs refusals and accept errors **once per interval with a count** (:class:`EveryInterval`),
  and :func:`quiet_accept_errors` does the same for asyncio's own "socket.accept() out of
  system resource" reports, which would otherwise log a traceback per failed accept.

Hooks: :func:`unix_site` / :func:`tcp_site` replace aiohttp's ``UnixSite`` / ``TCPSite``, and
:func:`guard` adds the middleware that tells a connection when a request is in its handler.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from ssl import SSLContext
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-listener caps and deadlines (see the module docstring)."""

    max_connections: int = 32
    """Open connections one listener (one job's socket) may have; a harness needs a few."""
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    idle_timeout_s: float = 75.0
    auth_timeout_s: float = 0.0
    """0: no authentication deadline (a per-job socket is reachable only from its sandbox)."""


LEASE_LIMITS = ConnectionLimits()
TCP_LIMITS = ConnectionLimits(max_connections=256, auth_timeout_s=5.0)
DASHBOARD_LIMITS = ConnectionLimits(max_connections=256)
RESERVED_FDS = 1024
"""Descriptors the connection budget leaves to the rest of the server (the job store, sandboxes
and their pipes, gRPC, backends): this many, or a quarter of the limit when that is more, and
never more than half of it."""


class EveryInterval:
    """Log one line per ``interval_s`` for a recurring event, with how often it happened."""

    def __init__(self, what: str, interval_s: float = 10.0) -> None:
        self.what = what
        self.interval_s = interval_s
        self.count = 0
        self.total = 0
        self._last = -float("inf")

    def __call__(self, detail: str = "") -> None:
        self.count += 1
        self.total += 1
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            log.warning("%s: %d time(s) in the last %.0fs%s", self.what, self.count,
                        min(now - self._last, self.interval_s * 1000), f" ({detail})"
                        if detail else "")
            self._last, self.count = now, 0


class ConnectionBudget:
    """The process's connections to these HTTP apps, together, below the descriptor limit."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.open = 0
        self.peak = 0

    @classmethod
    def for_this_process(cls) -> ConnectionBudget:
        soft = raise_fd_limit()
        return cls(soft - max(soft // 4, min(RESERVED_FDS, soft // 2)))

    def take(self) -> bool:
        if self.open >= self.limit:
            return False
        self.open += 1
        self.peak = max(self.peak, self.open)
        return True

    def give(self) -> None:
        self.open = max(0, self.open - 1)


def raise_fd_limit() -> int:
    """Raise the soft descriptor limit to the hard one (the soft default, often 1024, is a
    relic); returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        want = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return int(soft)


_budget: ConnectionBudget | None = None


def budget() -> ConnectionBudget:
    """The process's one budget (descriptors are per process, so is this)."""
    global _budget
    if _budget is None:
        _budget = ConnectionBudget.for_this_process()
    return _budget


refused = EveryInterval("connections refused (listener or process connection budget full)")
cut_off = EveryInterval("requests cut off by their client (connection lost mid-request)")


class Listener:
    """One listening socket's connections: its cap, its deadlines, its count."""

    def __init__(self, name: str, limits: ConnectionLimits,
                 shared: ConnectionBudget | None = None) -> None:
        self.name = name
        self.limits = limits
        self.shared = shared or budget()
        self.open: set[_Guarded] = set()
        self.refused = 0
        self.expired = 0

    def admit(self) -> bool:
        if len(self.open) >= self.limits.max_connections or not self.shared.take():
            self.refused += 1
            refused(self.name)
            return False
        return True

    def close_all(self) -> None:
        for conn in list(self.open):
            conn.abort()


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, with this module's count and deadlines."""

    def __init__(self, listener: Listener, make: Callable[[], Any]) -> None:
        self.listener = listener
        self._make = make
        self.inner: Any = None
        self.transport: asyncio.Transport | None = None
        self.in_handler = 0
        self.authenticated = False
        self.request: web.BaseRequest | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._auth_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol, passed on -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.listener.admit():
            transport.abort()  # type: ignore[attr-defined]
            return
        self.listener.open.add(self)
        _BY_TRANSPORT[id(transport)] = self
        self.inner = self._make()
        self.inner.connection_made(transport)
        limits = self.listener.limits
        self._arm(limits.header_timeout_s)
        if limits.auth_timeout_s:
            self._auth_timer = asyncio.get_running_loop().call_later(
                limits.auth_timeout_s, self._auth_expired)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._auth_timer is not None:
            self._auth_timer.cancel()
        if self.inner is None:
            return
        _BY_TRANSPORT.pop(id(self.transport), None)
        if self in self.listener.open:
            self.listener.open.discard(self)
            self.listener.shared.give()
        self.inner.connection_lost(exc)

    # -- deadlines -------------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        self._disarm()
        if seconds > 0:
            self._timer = asyncio.get_running_loop().call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        request = self.request
        if self.in_handler and (request is None or request.content.is_eof()):
            return  # a request being answered (its body is in): no deadline of ours
        self.listener.expired += 1
        self.abort()

    def _auth_expired(self) -> None:
        self._auth_timer = None
        if not self.authenticated:
            self.listener.expired += 1
            self.abort()

    def abort(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def request_started(self, request: web.BaseRequest) -> None:
        self.in_handler += 1
        self.request = request
        self._arm(self.listener.limits.body_timeout_s)  # its body must follow its headers

    def request_done(self, status: int) -> None:
        self.in_handler = max(0, self.in_handler - 1)
        self.request = None
        if status != 401:
            self.authenticated = True
        if not self.in_handler:
            limits = self.listener.limits
            # The next request's headers are due within the idle time of a keep-alive.
            self._arm(limits.idle_timeout_s)


_BY_TRANSPORT: dict[int, _Guarded] = {}


def connection_of(request: web.BaseRequest) -> _Guarded | None:
    transport = request.transport
    return _BY_TRANSPORT.get(id(transport)) if transport is not None else None


@web.middleware
async def _track(request: web.Request, handler: Callable[[web.Request],
                                                         Awaitable[web.StreamResponse]]
                 ) -> web.StreamResponse:
    conn = connection_of(request)
    if conn is None:
        return await handler(request)
    conn.request_started(request)
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except ConnectionError as exc:
        # The client went away mid-request (a body cut off, a connection dropped): nothing
        # is owed to it, and aiohttp would log a traceback for each one.
        cut_off(str(exc))
        status = 400
        return web.Response(status=400, text="the connection was lost")
    finally:
        conn.request_done(status)


def guard(app: web.Application) -> web.Application:
    """Add the middleware that tells each connection when a request is in its handler (call
    before the app's runner is set up; first, so it sees every answer)."""
    app.middlewares.insert(0, _track)
    return app


class GuardedUnixSite(web.UnixSite):
    __slots__ = ("listener",)

    def __init__(self, runner: web.BaseRunner, path: str, listener: Listener) -> None:
        super().__init__(runner, path)
        self.listener = listener

    async def start(self) -> None:
        self._runner._reg_site(self)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_unix_server(
            lambda: _Guarded(self.listener, server), self._path,
            ssl=self._ssl_context, backlog=self._backlog)


class GuardedTCPSite(web.TCPSite):
    __slots__ = ("listener",)

    def __init__(self, runner: web.BaseRunner, host: str, port: int, listener: Listener, *,
                 ssl_context: SSLContext | None = None) -> None:
        super().__init__(runner, host, port, ssl_context=ssl_context, reuse_port=False)
        self.listener = listener

    async def start(self) -> None:
        self._runner._reg_site(self)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Guarded(self.listener, server), self._host, self._port,
            ssl=self._ssl_context, backlog=self._backlog, reuse_address=self._reuse_address,
            reuse_port=self._reuse_port)
        if self._server.sockets:
            self._bound_port = self._server.sockets[0].getsockname()[1]
        else:
            self._bound_port = self._port


def unix_site(runner: web.BaseRunner, path: str, name: str,
              limits: ConnectionLimits = LEASE_LIMITS) -> GuardedUnixSite:
    return GuardedUnixSite(runner, path, Listener(name, limits))


def tcp_site(runner: web.BaseRunner, host: str, port: int, name: str,
             limits: ConnectionLimits, ssl_context: SSLContext | None = None) -> GuardedTCPSite:
    return GuardedTCPSite(runner, host, port, Listener(name, limits), ssl_context=ssl_context)


accept_failed = EveryInterval("socket.accept() out of system resource (file descriptors)")


def quiet_accept_errors(loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Report asyncio's failed accepts (EMFILE, ENFILE, ENOBUFS, ENOMEM) once per interval
    with a count instead of a traceback each; every other report goes where it went before."""
    loop = loop or asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    if getattr(previous, "_rollout_quiet", False):
        return

    def handler(lp: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if str(context.get("message", "")).startswith("socket.accept() out of system"):
            accept_failed(str(context.get("exception", "")))
            return
        if previous is not None:
            previous(lp, context)
        else:
            lp.default_exception_handler(context)

    handler._rollout_quiet = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handler)
