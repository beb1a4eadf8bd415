"""A warm pool of bwrap sandboxes: made, and their first launch parked, before a job asks.

Creating a sandbox is cheap (a directory, its quota mount, a uid); what a job waits for is the
launch chain of its first command (``prlimit``, bwrap's namespaces and mounts, the seccomp
filter, ``setpriv``). A pooled sandbox has run that chain already: its first launch waits in
``runtime/envs/in_sandbox/parked_exec.py`` for the command, which ``exec`` hands it
(:meth:`BwrapSandbox.park`). A job's INIT takes a ready one; a task refills in the background.

What the pool guarantees:

- **One job per sandbox.** A sandbox leaves the pool once, by :meth:`SandboxPool.take`, and
  never comes back: its job destroys it as it would a fresh one.
- **Only identical shapes.** A sandbox is pooled per :class:`Shape` (network, limits) and
  only for the pool's own configuration, without a server-wide ``rootfs`` or image, and with
  no per-sandbox option (no ``rootfs``, image,
  ``binds``, or anything a runtime adds later): what differs between such sandboxes
  (workspace files, environment) is filled in at take time. Everything else is made cold.
- **Bounded.** At most ``size`` ready sandboxes per shape and ``max_shapes`` shapes, and no
  new one while the ready ones' processes hold ``memory_bytes`` of RSS or more.
- **Shrinks when idle.** A shape nobody took for ``idle_s`` is emptied and no longer
  refilled, until a job asks for it again.
- **Gone at stop, swept after a crash.** :meth:`close` destroys every ready sandbox; pooled
  sandboxes are ordinary sandboxes (directory, lock, meta, ``--die-with-parent``), so after a
  SIGKILL the next start-up's ``reap_stale`` removes them like any other.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout.runtime.sandbox import procs
from rollout.runtime.sandbox.base import Network, SandboxConfig, SandboxLimits
from rollout.runtime.sandbox.bwrap import BwrapSandbox

log = logging.getLogger(__name__)
PARK_TIMEOUT_S = 30.0
"""How long a new pooled sandbox's parked launch may take to come up."""
REFILL_DELAY_S = 0.1
"""The refill waits this long after a take: making a sandbox (its launch chain, the waiter's
interpreter start) costs tens of ms of CPU, which would otherwise land on the cores the job
that took one needs for its first command right then."""

POOLED_OPTIONS = frozenset({"workspace_files", "env", "network", "limits"})
"""``create_sandbox`` arguments a pooled sandbox can take on after it was made; any other
option makes the sandbox differ and is made cold."""


@dataclass(frozen=True)
class PoolSettings:
    """How big the pool may grow (``sandbox.pool_*`` config keys)."""

    size: int = 0
    """Ready sandboxes kept per shape; 0 = no pool."""
    memory_bytes: int = 512 << 20
    """No new ready sandbox while the ready ones' processes hold this much RSS."""
    idle_s: float = 60.0
    """A shape nobody took for this long is emptied (and refilled at the next demand)."""
    max_shapes: int = 4
    """Distinct shapes pooled at once; demand for more is served cold."""
    tools: tuple[str, ...] = ()
    """Tools started in each ready sandbox before a job takes it: ``bash`` (the persistent
    shell) and ``python`` (the IPython kernel, about a second to start). Only for jobs that
    open their sandbox without ``env`` (a running tool never sees variables set after it
    started): those get sandboxes of a separate shape without them."""


TOOLS = ("bash", "python")
"""What ``PoolSettings.tools`` may name."""


@dataclass(frozen=True)
class Shape:
    """What makes two pooled sandboxes interchangeable, beyond the pool's configuration."""

    network: Network = "none"
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    tools: tuple[str, ...] = ()
    """Tools already running in it (see ``PoolSettings.tools``)."""


@dataclass(frozen=True)
class PoolStats:
    ready: int
    taken: int
    misses: int
    made: int
    destroyed_idle: int
    rss_bytes: int


@dataclass
class _Lane:
    ready: collections.deque[tuple[BwrapSandbox, int]] = field(
        default_factory=collections.deque)
    """(sandbox, RSS of its parked launch in bytes), oldest first."""
    making: int = 0
    last_demand: float = field(default_factory=time.monotonic)


class SandboxPool:
    """Ready bwrap sandboxes for one :class:`SandboxConfig`; use from one event loop."""

    def __init__(self, config: SandboxConfig, settings: PoolSettings) -> None:
        self.config = config
        self.settings = settings
        self._lanes: dict[Shape, _Lane] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._taken = self._misses = self._made = self._idle_gone = 0
        self._last_take = 0.0
        self._backoff_s = 0.0

    # -- taking ------------------------------------------------------------------------------
    def shape_for(self, config: SandboxConfig, options: Mapping[str, Any]) -> Shape | None:
        """The shape a ``create_sandbox`` call asks for, or None when it cannot be pooled."""
        if (self.settings.size <= 0 or config != self.config or config.runtime != "bwrap"
                or config.rootfs is not None or config.image  # an image root: made cold
                or not POOLED_OPTIONS.issuperset(options)):
            return None
        return Shape(options.get("network") or "none", options.get("limits") or config.limits,
                     () if options.get("env") else self.settings.tools)

    async def take(self, config: SandboxConfig, **options: Any) -> BwrapSandbox | None:
        """A ready sandbox with ``workspace_files`` written and ``env`` set, or None (the
        caller then makes one cold): an unpoolable request, an empty or closed pool."""
        if self._closed:
            return None
        shape = self.shape_for(config, options)
        if shape is None:
            return None
        lane = self._lane(shape)
        if lane is None:
            return None
        lane.last_demand = self._last_take = time.monotonic()
        self._ensure_running()
        while lane.ready:
            sandbox, _ = lane.ready.popleft()
            self._wake.set()  # refill behind it
            if sandbox.destroyed:
                continue
            self._taken += 1
            try:
                files = options.get("workspace_files") or {}
                env = options.get("env") or {}
                if files:
                    await asyncio.to_thread(sandbox.prepare, files, env)
                else:
                    sandbox.prepare({}, env)
            except BaseException:
                await sandbox.destroy()
                raise
            return sandbox
        self._misses += 1
        self._wake.set()
        return None

    def _lane(self, shape: Shape) -> _Lane | None:
        lane = self._lanes.get(shape)
        if lane is None:
            if len(self._lanes) >= self.settings.max_shapes:
                return None
            lane = self._lanes[shape] = _Lane()
        return lane

    # -- filling -----------------------------------------------------------------------------
    def start(self, *shapes: Shape) -> None:
        """Begin filling ``shapes`` (default: the configuration's plain shape) now, so the
        first jobs find ready sandboxes. Needs a running event loop."""
        if self.settings.size <= 0 or self._closed:
            return
        for shape in shapes or (Shape(limits=self.config.limits, tools=self.settings.tools),):
            self._lane(shape)
        self._ensure_running()

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._fill_forever(),
                                                                 name="sandbox-pool")
        self._wake.set()

    async def _fill_forever(self) -> None:
        while not self._closed:
            self._wake.clear()
            await self._shrink_idle()
            shape = self._next_to_fill()
            if shape is None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(self.settings.idle_s, 5.0)):
                        await self._wake.wait()
                continue
            delay = self._last_take + REFILL_DELAY_S - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
                continue  # the lanes may have changed meanwhile
            try:
                await self._make_one(shape)
                self._backoff_s = 0.0
            except asyncio.CancelledError:
                raise
            except Exception:  # a failing runtime must not spin: back off, then try again
                self._backoff_s = min(60.0, max(1.0, 2 * self._backoff_s))
                log.exception("sandbox pool: making a sandbox failed; jobs get cold ones "
                              "(next try in %g s)", self._backoff_s)
                await asyncio.sleep(self._backoff_s)

    def _next_to_fill(self) -> Shape | None:
        if self.rss_bytes() >= self.settings.memory_bytes:
            return None
        now = time.monotonic()
        for shape, lane in self._lanes.items():
            if (now - lane.last_demand < self.settings.idle_s
                    and len(lane.ready) + lane.making < self.settings.size):
                return shape
        return None

    async def _make_one(self, shape: Shape) -> None:
        lane = self._lanes[shape]
        lane.making += 1
        try:
            sandbox = await BwrapSandbox.create(self.config, workspace_files={}, env={},
                                                network=shape.network, limits=shape.limits)
            try:
                await procs.in_spawner(sandbox.park)
                if not await sandbox.wait_parked(PARK_TIMEOUT_S):
                    raise RuntimeError(f"the parked launch of sandbox {sandbox.id} did not "
                                       f"come up within {PARK_TIMEOUT_S:g} s")
                for tool in shape.tools:
                    await (sandbox.bash() if tool == "bash" else sandbox.ipython())
                rss = await asyncio.to_thread(_tree_rss, *sandbox.tracked_pids)
            except BaseException:
                await sandbox.destroy()
                raise
        finally:
            lane.making -= 1
        if self._closed or self._lanes.get(shape) is not lane:
            await sandbox.destroy()
            return
        lane.ready.append((sandbox, rss))
        self._made += 1

    async def _shrink_idle(self) -> None:
        now = time.monotonic()
        for shape, lane in list(self._lanes.items()):
            if now - lane.last_demand >= self.settings.idle_s:
                del self._lanes[shape]
                gone = [sb for sb, _ in lane.ready]
                lane.ready.clear()
                self._idle_gone += len(gone)
                await asyncio.gather(*(sb.destroy() for sb in gone), return_exceptions=True)

    # -- stopping ----------------------------------------------------------------------------
    async def close(self) -> None:
        """Stop refilling and destroy every ready sandbox (idempotent)."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        ready = [sb for lane in self._lanes.values() for sb, _ in lane.ready]
        self._lanes.clear()
        await asyncio.gather(*(sb.destroy() for sb in ready), return_exceptions=True)

    # -- figures -----------------------------------------------------------------------------
    def rss_bytes(self) -> int:
        return sum(rss for lane in self._lanes.values() for _, rss in lane.ready)

    def ready_count(self, shape: Shape | None = None) -> int:
        lanes = self._lanes.values() if shape is None else [self._lanes.get(shape) or _Lane()]
        return sum(len(lane.ready) for lane in lanes)

    def stats(self) -> PoolStats:
        return PoolStats(self.ready_count(), self._taken, self._misses, self._made,
                         self._idle_gone, self.rss_bytes())


def _tree_rss(*pids: int) -> int:
    """Resident memory of ``pids`` and their descendants (each launch's bwrap, the sandbox's
    init and the waiter or tool), from /proc; 0 for what is gone."""
    total, todo = 0, list(pids)
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return total
