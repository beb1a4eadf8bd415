"""Live pages: server-sent events fed from the same events the gRPC sessions get.

While a live page is open, the scheduler's delivery (``server/pipeline/delivery.py``) tells
the :class:`Hub` which job each event is about (accepted, stage progress, finished). The hub
appends ``(client, job)`` to one bounded log (``LOG_SIZE`` entries) and wakes the open pages,
once per loop iteration however many events arrive: the pipeline pays O(1) per event, whatever
the number of open pages. Each page's own task then reads the log from where it left off
(past the log's end it treats every job as changed), keeps the jobs it may see and show,
renders what changed and writes it, at most every ``min_interval_s``: a browser that reads
slowly gets fewer, merged updates, and one that stops reading is dropped when a write stalls
for ``WRITE_TIMEOUT_S``. Nothing is queued per page, and a dashboard nobody watches is not
told anything at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rollout.server.tenancy.auth import Principal, identity_of
from rollout.server.tenancy.ownership import sees_job

log = logging.getLogger(__name__)

MAX_DIRTY = 256
"""Changed job ids a page takes one by one; past that it treats every job as changed."""
LOG_SIZE = 4096
"""Change-log entries kept for pages that have not read them yet."""
MAX_WATCHERS = 64
"""Open live pages at once; more are refused with 503 (each costs a little per event)."""
MAX_WATCHERS_PER_IDENTITY = 8
"""Open live pages of one identity (a client id, or the operator): one tenant's pages cannot
take the others' slots."""
ADMIN_RESERVED = 8
"""Of ``MAX_WATCHERS``, slots only an admin (or the operator) may take: however many tenants
hold pages open, the operator can still watch."""
WRITE_TIMEOUT_S = 10.0
"""A write (an update or a keep-alive) that the browser has not taken within this is a stalled
stream: it is closed and its slot freed."""
KEEPALIVE_S = 15.0
MAX_STREAM_S = 600.0
"""A live stream ends after this long; the browser's EventSource reconnects at once (and is
counted again), so a page left open by a client that never reads holds its slot for at most
this long even if its socket keeps accepting bytes."""
SEND_BUFFER_BYTES = 32 * 1024
"""The kernel's send buffer of a live stream: small, so a browser that stops reading shows as
a stalled write soon (the default buffers megabytes of keep-alives without a sign)."""


@dataclass(frozen=True)
class Changes:
    """What changed since a page's last update."""

    jobs: frozenset[str]
    many: bool
    """More changed than the log holds, or than ``MAX_DIRTY``: treat every job as changed."""

    def __bool__(self) -> bool:
        return bool(self.jobs) or self.many


class Hub:
    """The change log and the open live pages. It observes the delivery only while a page is
    open, so a dashboard nobody watches costs the pipeline nothing."""

    def __init__(self, observe: Callable[[Callable[[str, str], None]], Callable[[], None]]
                 | None = None) -> None:
        self._observe = observe
        self._unobserve: Callable[[], None] | None = None
        self._watchers: set[Watcher] = set()
        self._log: deque[tuple[str, str]] = deque(maxlen=LOG_SIZE)
        self.seq = 0
        """Entries ever appended; entry ``seq - 1`` is the newest."""
        self._waking = False
        self.closing = False

    def __call__(self, client_id: str, job_id: str) -> None:
        """The delivery's observer: called on the event loop for every event; O(1)."""
        self._log.append((client_id, job_id))
        self.seq += 1
        if not self._waking:
            self._waking = True
            asyncio.get_running_loop().call_soon(self._wake_all)

    def _wake_all(self) -> None:
        self._waking = False
        for w in self._watchers:
            w.wake()

    def since(self, seq: int) -> tuple[list[tuple[str, str]], bool]:
        """Entries after ``seq`` and whether some were already dropped from the log."""
        missed = self.seq - seq
        if missed > len(self._log):
            return [], True
        return list(self._log)[len(self._log) - missed:] if missed else [], False

    @property
    def count(self) -> int:
        return len(self._watchers)

    @property
    def observing(self) -> bool:
        return self._unobserve is not None

    def refusal(self, watcher: Watcher) -> str:
        """Why ``watcher`` may not open now ("" when it may)."""
        if self.closing:
            return "the dashboard is stopping"
        mine = sum(1 for w in self._watchers if w.identity == watcher.identity)
        if mine >= MAX_WATCHERS_PER_IDENTITY:
            return (f"you already have {mine} live dashboard pages open (at most "
                    f"{MAX_WATCHERS_PER_IDENTITY}); close some")
        cap = MAX_WATCHERS if watcher.principal.admin else MAX_WATCHERS - ADMIN_RESERVED
        if len(self._watchers) >= cap:
            return "too many open dashboard pages on this server; try again later"
        return ""

    def add(self, watcher: Watcher) -> bool:
        if self.refusal(watcher):
            return False
        self._watchers.add(watcher)
        watcher.seq = self.seq
        if self._unobserve is None and self._observe is not None:
            self._unobserve = self._observe(self)
        return True

    def remove(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)
        if not self._watchers and self._unobserve is not None:
            self._unobserve()
            self._unobserve = None

    def close(self) -> None:
        self.closing = True
        for w in list(self._watchers):
            w.close()
        if self._unobserve is not None:
            self._unobserve()
            self._unobserve = None


class Watcher:
    """One open live page: which jobs it may see and shows, and where it is in the log."""

    def __init__(self, hub: Hub, principal: Principal, job_id: str = "") -> None:
        self.hub = hub
        self.principal = principal
        self.job_id = job_id
        self.identity = identity_of(principal)
        self.seq = 0
        """The log position this page has read up to."""
        self._wake = asyncio.Event()
        self.closed = False

    def _visible(self, client_id: str, job_id: str) -> bool:
        if self.job_id and job_id != self.job_id:
            return False
        return sees_job(self.principal, client_id)

    def wake(self) -> None:
        self._wake.set()

    def take(self) -> Changes:
        """The changes since the last call (in the page's own task, not the pipeline's)."""
        self._wake.clear()
        entries, missed = self.hub.since(self.seq)
        self.seq = self.hub.seq
        if missed:
            return Changes(frozenset(), True)
        jobs = {job for client, job in entries if self._visible(client, job)}
        if len(jobs) > MAX_DIRTY:
            return Changes(frozenset(), True)
        return Changes(frozenset(jobs), False)

    async def wait(self, seconds: float) -> None:
        """Until something changes, the page closes, or ``seconds`` pass."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    def close(self) -> None:
        self.closed = True
        self._wake.set()


@dataclass(frozen=True)
class Update:
    """What a page's render produced: its changed parts as ``(element id, html)`` pairs."""

    parts: list[tuple[str, str]]
    last: bool = False
    """Nothing will change any more (a job page showed its finished trajectory): the stream
    ends after this update."""


Render = Callable[[Changes], Awaitable[Update]]


async def stream(request: web.Request, hub: Hub, watcher: Watcher, render: Render, *,
                 min_interval_s: float, refresh_s: float) -> web.StreamResponse:
    """Serve one page's event stream until the browser goes or the server stops.

    ``refresh_s``: also render this often without events (throughput and latency change
    without any event of the page's own jobs); 0 = only on events.
    """
    refusal = hub.refusal(watcher)
    if refusal or not hub.add(watcher):
        raise web.HTTPServiceUnavailable(text=refusal or "too many open dashboard pages")
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-store",
        "X-Accel-Buffering": "no"})
    try:
        _small_send_buffer(request)
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        idle_since = opened = loop.time()
        # The first update is the page's whole live state, whatever the log says: a browser
        # that reconnects (EventSource does after a dropped stream) holds a page rendered
        # before the events it missed, and nothing in the log after ``watcher.seq`` says so.
        first = True
        while not watcher.closed and loop.time() - opened < MAX_STREAM_S:
            if not first:
                await watcher.wait(refresh_s or KEEPALIVE_S)
            if watcher.closed:
                break
            changes = Changes(frozenset(), True) if first else watcher.take()
            first = False
            update = await render(changes) if changes or refresh_s else Update([])
            if update.parts:
                data = json.dumps([{"id": i, "html": h} for i, h in update.parts])
                await _write(response, f"event: parts\ndata: {data}\n\n".encode(), request)
                idle_since = loop.time()
            if update.last:
                await _write(response, b"event: done\ndata: {}\n\n", request)
                break
            if not update.parts and loop.time() - idle_since >= KEEPALIVE_S:
                await _write(response, b": keep-alive\n\n", request)
                idle_since = loop.time()
            # Coalesce: whatever happens meanwhile goes out in the next update.
            await asyncio.sleep(min_interval_s)
    except (ConnectionResetError, TimeoutError):
        pass  # the browser went away or stopped reading; nothing is owed to it
    finally:
        hub.remove(watcher)
    return response


async def _write(response: web.StreamResponse, data: bytes, request: web.Request) -> None:
    """Write and wait until the browser has taken what is buffered: a write that stays in the
    buffer for ``WRITE_TIMEOUT_S`` is a stalled stream (``TimeoutError``), keep-alives
    included (aiohttp itself waits only once its own buffer passes 64 KiB)."""
    async with asyncio.timeout(WRITE_TIMEOUT_S):
        await response.write(data)
        transport = request.transport
        while transport is not None and not transport.is_closing() and \
                transport.get_write_buffer_size() > 0:
            await asyncio.sleep(min(0.1, WRITE_TIMEOUT_S / 10))
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the browser went away")


def _small_send_buffer(request: web.Request) -> None:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)


def turn_counters(detail: Mapping[str, Any] | None) -> dict[str, int]:
    """A running job's agent-loop counters from its latest ``turn`` event's detail (as
    ``server/stream_events.progress_to_proto`` reads them)."""
    if not detail:
        return {}
    return {"turns": int(detail.get("turns_done", int(detail.get("turn", 0)) + 1)),
            "generated_tokens": int(detail.get("generated_tokens", 0)),
            "tool_calls": int(detail.get("tool_calls_total", 0))}
