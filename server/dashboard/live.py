"""Live pages: server-sent events fed from the same events the gRPC sessions get.

While a live page is open, the scheduler's delivery (``server/pipeline/delivery.py``) tells
the :class:`Hub` every event (job accepted, stage progress, job finished). The hub does no work
of its own per event: it hands the event to each open page's :class:`Watcher`, which keeps only
*which* jobs changed (a set, bounded: past ``MAX_DIRTY`` it remembers "many changed") and, on
a job's page, that job's latest progress. The page's own task then renders what changed and
writes it, at most every ``min_interval_s``: a browser that reads slowly just gets fewer,
coalesced updates, and one that stops reading is dropped when a write stalls for
``WRITE_TIMEOUT_S``. Nothing is queued per event, so an open dashboard costs the pipeline a set
insertion per event and page, and a closed one nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rollout.server.auth import Principal, owner_of
from rollout.server.pipeline.subscription import (
    Event,
    JobAccepted,
    JobFinished,
    StageProgress,
    TrajectoryReady,
)

log = logging.getLogger(__name__)

MAX_DIRTY = 256
"""Changed job ids a watcher remembers before it says "many changed" instead."""
MAX_WATCHERS = 64
"""Open live pages at once; more are refused with 503 (each costs a little per event)."""
WRITE_TIMEOUT_S = 10.0
KEEPALIVE_S = 15.0


@dataclass(frozen=True)
class Changes:
    """What changed since a page's last update."""

    jobs: frozenset[str]
    many: bool
    """More than ``MAX_DIRTY`` jobs changed: treat every job as changed."""

    def __bool__(self) -> bool:
        return bool(self.jobs) or self.many


class Watcher:
    """One open live page: which events it wants, and what changed since it last looked."""

    def __init__(self, principal: Principal, job_id: str = "", group_id: str = "") -> None:
        self.principal = principal
        self.job_id = job_id
        self.group_id = group_id
        self._dirty: set[str] = set()
        self._many = False
        self.last_event: StageProgress | None = None
        """A job page's latest progress event (stage started / finished, turn)."""
        self._wake = asyncio.Event()
        self.closed = False

    def offer(self, client_id: str, event: Event) -> None:
        """Called on the event loop for every event; O(1), never blocks."""
        job_id = _job_of(event)
        if self.job_id and job_id != self.job_id:
            return
        if self.principal.bound and not self.principal.admin and (
                owner_of(client_id) != self.principal.client_id):
            return
        if isinstance(event, StageProgress) and self.job_id:
            self.last_event = event
        if not self._many:
            if len(self._dirty) >= MAX_DIRTY:
                self._many = True
                self._dirty.clear()
            else:
                self._dirty.add(job_id)
        self._wake.set()

    def take(self) -> Changes:
        out = Changes(frozenset(self._dirty), self._many)
        self._dirty.clear()
        self._many = False
        self._wake.clear()
        return out

    async def wait(self, seconds: float) -> None:
        """Until something changes, the page closes, or ``seconds`` pass."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    def close(self) -> None:
        self.closed = True
        self._wake.set()


def _job_of(event: Event) -> str:
    match event:
        case JobAccepted(job_id=j) | StageProgress(job_id=j):
            return j
        case JobFinished(job_id=j) | TrajectoryReady(job_id=j):
            return j
    return ""


class Hub:
    """The open live pages. It observes the delivery only while at least one is open, so a
    dashboard nobody watches costs the pipeline nothing (not even building progress events)."""

    def __init__(self, observe: Callable[[Callable[[str, Event], None]], Callable[[], None]]
                 | None = None) -> None:
        self._observe = observe
        self._unobserve: Callable[[], None] | None = None
        self._watchers: set[Watcher] = set()
        self.closing = False

    def __call__(self, client_id: str, event: Event) -> None:
        for w in self._watchers:
            w.offer(client_id, event)

    @property
    def count(self) -> int:
        return len(self._watchers)

    @property
    def observing(self) -> bool:
        return self._unobserve is not None

    def add(self, watcher: Watcher) -> bool:
        if self.closing or len(self._watchers) >= MAX_WATCHERS:
            return False
        self._watchers.add(watcher)
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
    if not hub.add(watcher):
        raise web.HTTPServiceUnavailable(text="too many open dashboard pages; close some")
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-store",
        "X-Accel-Buffering": "no"})
    try:
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        idle_since = loop.time()
        while not watcher.closed:
            await watcher.wait(refresh_s or KEEPALIVE_S)
            if watcher.closed:
                break
            changes = watcher.take()
            update = await render(changes) if changes or refresh_s else Update([])
            if update.parts:
                data = json.dumps([{"id": i, "html": h} for i, h in update.parts])
                await _write(response, f"event: parts\ndata: {data}\n\n".encode())
                idle_since = loop.time()
            if update.last:
                await _write(response, b"event: done\ndata: {}\n\n")
                break
            if not update.parts and loop.time() - idle_since >= KEEPALIVE_S:
                await _write(response, b": keep-alive\n\n")
                idle_since = loop.time()
            # Coalesce: whatever happens meanwhile goes out in the next update.
            await asyncio.sleep(min_interval_s)
    except (ConnectionResetError, TimeoutError):
        pass  # the browser went away or stopped reading; nothing is owed to it
    finally:
        hub.remove(watcher)
    return response


async def _write(response: web.StreamResponse, data: bytes) -> None:
    await asyncio.wait_for(response.write(data), WRITE_TIMEOUT_S)


def turn_counters(detail: Mapping[str, Any] | None) -> dict[str, int]:
    """A running job's agent-loop counters from its latest ``turn`` event's detail (as
    ``server/stream_events.progress_to_proto`` reads them)."""
    if not detail:
        return {}
    return {"turns": int(detail.get("turns_done", int(detail.get("turn", 0)) + 1)),
            "generated_tokens": int(detail.get("generated_tokens", 0)),
            "tool_calls": int(detail.get("tool_calls_total", 0))}
