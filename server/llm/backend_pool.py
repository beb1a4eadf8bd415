"""The LLM backend pool: implements ``runtime.llm.LLMClient`` over a set of engines.

Routing, in order of precedence:
1. **Sticky sessions** — every turn of a trajectory goes to the backend that served its previous
   turn (that backend holds the session's KV cache), as long as it is healthy and at the required
   policy version.
2. **Group affinity** — the first turn of a sample whose group already has a backend goes there
   (the group shares its prompt prefix), unless that backend is more than
   ``group_affinity_slack`` requests busier than the least-loaded one. The group table keeps
   the ``max_group_affinities`` most recently used groups: a group's samples start within
   moments of each other, so an old entry only costs memory (one per group ever seen).
3. **Least loaded** — a min-heap keyed on ``in_flight / weight``: in-flight is incremented on
   dispatch and decremented when the request ends, whether it succeeded, failed or was cancelled,
   so the keys never drift. Weights let a big backend take proportionally more.

Failures: an :class:`~rollout.server.llm.engine.EngineError` ejects the backend (the health checker
re-admits it when its probe succeeds again) and the turn is retried on another backend, up to
``max_attempts`` backends. A request that needs ``min_policy_version`` waits up to
``wait_for_backend_s`` for a backend at that version; so does one that finds no healthy backend.
Then it raises :class:`~rollout.runtime.llm.LLMUnavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rollout.runtime.llm import GenerateRequest, GenerateResult, LLMUnavailable
from rollout.server.llm.engine import Engine, EngineError

log = logging.getLogger(__name__)


@dataclass
class Backend:
    """The pool's view of one engine."""

    engine: Engine
    weight: float = 1.0
    in_flight: int = 0
    healthy: bool = True
    draining: bool = False
    """Removed from the pool: takes no new turns, closed once its in-flight turns end."""
    served: int = 0
    failures: int = 0
    last_error: str = ""
    added_at: float = 0.0
    stamp: int = 0
    """Bumped on every load change; heap entries with an older stamp are stale."""

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def score(self) -> float:
        return self.in_flight / self.weight

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version


@dataclass(frozen=True)
class BackendInfo:
    """A snapshot of one backend, for ``ListBackends`` and the CLI."""

    name: str
    kind: str
    address: str
    weight: float
    healthy: bool
    draining: bool
    in_flight: int
    policy_version: int
    served: int
    failures: int
    last_error: str
    sessions: int
    model: str = ""
    added_at: float = 0.0
    """Unix time the backend joined the pool."""


class BackendPool:
    """See the module docstring. Not thread-safe: use it from one event loop."""

    def __init__(self, engines: Iterable[Engine] = (), health_interval_s: float = 5.0, *,
                 max_attempts: int = 3, wait_for_backend_s: float = 30.0,
                 health_timeout_s: float = 5.0, group_affinity_slack: float = 4.0,
                 max_group_affinities: int = 4096, tokenizer: Any = None) -> None:
        if max_group_affinities < 1:
            raise ValueError(f"max_group_affinities must be >= 1, got {max_group_affinities}")
        self.health_interval_s = health_interval_s
        self.max_attempts = max_attempts
        self.wait_for_backend_s = wait_for_backend_s
        self.health_timeout_s = health_timeout_s
        self.group_affinity_slack = group_affinity_slack
        self.max_group_affinities = max_group_affinities
        self._tokenizer = tokenizer
        self._backends: dict[str, Backend] = {}
        self._heap: list[tuple[float, int, int, str]] = []
        self._tiebreak = itertools.count()
        self._sticky: dict[str, str] = {}
        self._groups: OrderedDict[str, str] = OrderedDict()
        self._changed: asyncio.Condition | None = None
        self._waiters = 0
        self._health_task: asyncio.Task[None] | None = None
        self._closers: set[asyncio.Task[None]] = set()
        for engine in engines:
            self.add(engine)

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start the periodic health checker."""
        self._condition()
        if self._health_task is None and self.health_interval_s > 0:
            self._health_task = asyncio.create_task(self._health_loop(), name="pool-health")

    async def close(self) -> None:
        """Stop health checks and close every engine."""
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        engines = [b.engine for b in self._backends.values()]
        self._backends.clear()
        await asyncio.gather(*(e.close() for e in engines), return_exceptions=True)
        await asyncio.gather(*self._closers, return_exceptions=True)

    # ----------------------------------------------------------------- membership
    def add(self, engine: Engine, weight: float = 1.0) -> None:
        """Admit a backend at run time. Its name must be unique in the pool."""
        if weight <= 0:
            raise ValueError(f"backend weight must be > 0, got {weight}")
        if not engine.name:
            raise ValueError("an engine needs a name to join the pool")
        if engine.name in self._backends:
            raise KeyError(f"backend {engine.name!r} already in the pool")
        backend = Backend(engine, weight=weight, added_at=time.time())
        self._backends[engine.name] = backend
        self._push(backend)
        self._notify()

    def remove(self, name: str) -> Backend:
        """Take a backend out: no new turns go to it; it is closed once its turns finish.

        Its sessions continue on other backends (which rebuild their KV from the prompt).
        Returns the removed backend (marked draining).
        """
        backend = self._backends.pop(name, None)
        if backend is None:
            raise KeyError(f"no backend named {name!r}")
        backend.draining = True
        for table in (self._sticky, self._groups):
            for key in [k for k, v in table.items() if v == name]:
                del table[key]
        task = asyncio.get_running_loop().create_task(self._close_when_idle(backend))
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)
        return backend

    def get(self, name: str) -> Backend:
        try:
            return self._backends[name]
        except KeyError:
            raise KeyError(f"no backend named {name!r}") from None

    def backends(self) -> list[BackendInfo]:
        sessions: dict[str, int] = {}
        for owner in self._sticky.values():
            sessions[owner] = sessions.get(owner, 0) + 1
        return [self.info(b, sessions.get(b.name, 0)) for b in self._backends.values()]

    def info(self, backend: Backend, sessions: int | None = None) -> BackendInfo:
        if sessions is None:
            sessions = sum(1 for owner in self._sticky.values() if owner == backend.name)
        engine = backend.engine
        model = getattr(engine, "model_name", None) or getattr(engine, "model", "")
        return BackendInfo(backend.name, getattr(engine, "kind", type(engine).__name__),
                           str(getattr(engine, "url", "")), backend.weight, backend.healthy,
                           backend.draining, backend.in_flight, backend.policy_version,
                           backend.served, backend.failures, backend.last_error, sessions,
                           model if isinstance(model, str) else "", backend.added_at)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is not None:
            return self._tokenizer
        for backend in self._backends.values():
            if backend.engine.tokenizer is not None:
                return backend.engine.tokenizer
        return None

    # ----------------------------------------------------------------- LLMClient
    def _turn_clock(self, request: GenerateRequest) -> tuple[float | None, float]:
        """(when the turn's own time ends or None, until when to wait for a backend)."""
        now = time.monotonic()
        ends = None if request.timeout_s is None else now + max(0.0, request.timeout_s)
        wait = now + self.wait_for_backend_s
        return ends, wait if ends is None else min(wait, ends)

    async def _route(self, request: GenerateRequest, tried: set[str], ends: float | None,
                     deadline: float) -> tuple[Backend, GenerateRequest] | None:
        """The backend for the next try of ``request`` and the request as that try sends it
        (with the turn's remaining time); None when the turn's time ran out before any
        backend took it."""
        try:
            backend = await self._select(request, tried, deadline)
        except LLMUnavailable:
            if ends is not None and time.monotonic() >= ends:
                return None
            raise
        tried.add(backend.name)
        if request.group_id:  # at dispatch, so concurrent samples of the group follow
            self._remember_group(request.group_id, backend.name)
        turn = request if ends is None else \
            dataclasses.replace(request, timeout_s=max(0.0, ends - time.monotonic()))
        return backend, turn

    def _failed(self, backend: Backend, request: GenerateRequest, exc: EngineError,
                errors: list[str]) -> None:
        """A backend failed a turn: eject it and forget the routes that pointed at it."""
        errors.append(f"{backend.name}: {exc}")
        self._eject(backend, str(exc))
        if self._sticky.get(request.session_id) == backend.name:
            del self._sticky[request.session_id]
        if self._groups.get(request.group_id) == backend.name:
            del self._groups[request.group_id]

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Route one turn (see the module docstring).

        With ``request.timeout_s`` the pool's own waits (for a backend, between retries) come
        out of the turn's time, and each backend gets only what is left: a turn whose time runs
        out before any backend took it returns ``deadline`` with no tokens.
        """
        tried: set[str] = set()
        errors: list[str] = []
        ends, deadline = self._turn_clock(request)
        while len(tried) < self.max_attempts:
            routed = await self._route(request, tried, ends, deadline)
            if routed is None:
                return _out_of_time(request)
            backend, turn = routed
            try:
                result = await self._dispatch(backend, turn)
            except EngineError as exc:
                self._failed(backend, request, exc, errors)
                continue
            self._sticky[request.session_id] = backend.name
            return result
        raise LLMUnavailable(f"turn failed on {len(tried)} backends: {'; '.join(errors)}")

    async def generate_stream(self, request: GenerateRequest,
                              ) -> AsyncGenerator[GenerateResult, None]:
        """Route one turn like :meth:`generate` and pass on its tokens as the engine produces
        them (``runtime.llm.stream_generate``'s pieces). A backend that fails before its first
        piece is ejected and the turn retried elsewhere; one that fails after sending tokens
        ends the turn with :class:`LLMUnavailable` (the caller has shown them already)."""
        tried: set[str] = set()
        errors: list[str] = []
        ends, deadline = self._turn_clock(request)
        while len(tried) < self.max_attempts:
            routed = await self._route(request, tried, ends, deadline)
            if routed is None:
                yield _out_of_time(request)
                return
            backend, turn = routed
            started = False
            backend.in_flight += 1
            self._push(backend)
            try:
                async with contextlib.aclosing(backend.engine.generate_stream(turn)) as pieces:
                    async for piece in pieces:
                        started = True
                        if piece.finish_reason:
                            backend.served += 1
                            self._sticky[request.session_id] = backend.name
                        yield piece
                        if piece.finish_reason:
                            return
                raise EngineError("the backend's stream ended without a finish reason")
            except EngineError as exc:
                self._failed(backend, request, exc, errors)
                if started:
                    raise LLMUnavailable(f"{backend.name} failed mid-turn: {exc}") from exc
            finally:
                backend.in_flight -= 1
                if backend.name in self._backends:
                    self._push(backend)
                self._notify()
        raise LLMUnavailable(f"turn failed on {len(tried)} backends: {'; '.join(errors)}")

    async def end_session(self, session_id: str) -> None:
        name = self._sticky.pop(session_id, None)
        backend = self._backends.get(name) if name else None
        if backend is not None:
            with contextlib.suppress(Exception):
                await backend.engine.release_session(session_id)

    async def abort(self, session_id: str) -> None:
        """Stop the session's in-flight turn (job cancelled)."""
        name = self._sticky.get(session_id)
        targets = [self._backends[name]] if name in self._backends else []
        for backend in targets or list(self._backends.values()):
            with contextlib.suppress(Exception):
                await backend.engine.abort(session_id)

    @property
    def group_affinities(self) -> int:
        """Groups whose backend the pool remembers (at most ``max_group_affinities``)."""
        return len(self._groups)

    def _remember_group(self, group_id: str, backend: str) -> None:
        if group_id in self._groups:
            self._groups.move_to_end(group_id)
            return
        self._groups[group_id] = backend
        while len(self._groups) > self.max_group_affinities:
            self._groups.popitem(last=False)

    # ----------------------------------------------------------------- weights
    async def update_weights(self, source: Any, version: int,
                             names: Sequence[str] | None = None) -> list[str]:
        """Rolling hot-swap: one backend at a time, so the others keep serving meanwhile.

        Each engine lets its in-flight turns finish on the old weights (see the engines).
        Returns the names updated.
        """
        targets = [self.get(n) for n in names] if names else list(self._backends.values())
        for backend in targets:
            await backend.engine.update_weights(source, version)
            self._push(backend)
            self._notify()
        return [b.name for b in targets]

    def set_policy_version(self, version: int, names: Sequence[str] | None = None) -> list[str]:
        """Record that weights were pushed to backends out of band (e.g. NCCL from the trainer)."""
        targets = [self.get(n) for n in names] if names else list(self._backends.values())
        setters = []
        for backend in targets:  # check them all before relabelling any
            setter = getattr(backend.engine, "set_policy_version", None)
            if setter is None:
                raise NotImplementedError(f"{backend.name} loads its own weights; its version "
                                          "changes only through update_weights")
            setters.append(setter)
        for setter in setters:
            setter(version)
        self._notify()
        return [b.name for b in targets]

    # ----------------------------------------------------------------- routing
    async def _select(self, request: GenerateRequest, tried: set[str],
                      deadline: float) -> Backend:
        condition = self._condition()
        while True:
            backend = self._pick(request, tried)
            if backend is not None:
                return backend
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                need = (f" at policy version >= {request.min_policy_version}"
                        if request.min_policy_version else "")
                raise LLMUnavailable(f"no healthy backend{need} within "
                                     f"{self.wait_for_backend_s:.1f}s (tried {sorted(tried)})")
            self._waiters += 1
            try:
                async with condition:
                    # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel
                    # that arrives as the condition is notified (gh-86296), and a cancelled
                    # turn would go on to pick a backend.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(min(remaining, 1.0)):
                            await condition.wait()
            finally:
                self._waiters -= 1

    def _eligible(self, backend: Backend, request: GenerateRequest, tried: set[str]) -> bool:
        return (backend.healthy and not backend.draining and backend.name not in tried
                and backend.policy_version >= request.min_policy_version)

    def _pick(self, request: GenerateRequest, tried: set[str]) -> Backend | None:
        sticky = self._backends.get(self._sticky.get(request.session_id, ""))
        if sticky is not None and self._eligible(sticky, request, tried):
            return sticky
        least = self._least_loaded(request, tried)
        group = self._backends.get(self._groups.get(request.group_id, "")) \
            if request.group_id else None
        if (group is not None and least is not None and self._eligible(group, request, tried)
                and group.score <= least.score + self.group_affinity_slack):
            return group
        return least

    def _least_loaded(self, request: GenerateRequest, tried: set[str]) -> Backend | None:
        """Pop heap entries until the freshest eligible one; push back the skipped ones."""
        skipped: list[tuple[float, int, int, str]] = []
        found: Backend | None = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            backend = self._backends.get(entry[3])
            if backend is None or entry[2] != backend.stamp:
                continue  # stale: the backend's load changed or it left
            skipped.append(entry)
            if self._eligible(backend, request, tried):
                found = backend
                break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found

    def _push(self, backend: Backend) -> None:
        backend.stamp += 1
        heapq.heappush(self._heap, (backend.score, next(self._tiebreak), backend.stamp,
                                    backend.name))
        if len(self._heap) > 8 * len(self._backends) + 64:  # drop stale entries now and then
            self._heap = [e for e in self._heap if e[3] in self._backends
                          and e[2] == self._backends[e[3]].stamp]
            heapq.heapify(self._heap)

    async def _dispatch(self, backend: Backend, request: GenerateRequest) -> GenerateResult:
        backend.in_flight += 1
        self._push(backend)
        try:
            result = await backend.engine.generate(request)
            backend.served += 1
            return result
        finally:
            backend.in_flight -= 1
            if backend.name in self._backends:
                self._push(backend)
            self._notify()

    # ----------------------------------------------------------------- health
    def _eject(self, backend: Backend, reason: str) -> None:
        backend.failures += 1
        backend.last_error = reason
        if backend.healthy:
            log.warning("ejecting backend %s: %s", backend.name, reason)
        backend.healthy = False

    async def check_health(self) -> None:
        """Probe every backend once; eject failures, re-admit recoveries."""
        async def probe(backend: Backend) -> None:
            try:
                async with asyncio.timeout(self.health_timeout_s):  # not wait_for: gh-86296
                    ok = await backend.engine.health()
            except Exception as exc:  # a probe that raises is a failed probe
                ok, reason = False, repr(exc)
            else:
                reason = "health probe failed"
            if ok and not backend.healthy:
                log.info("re-admitting backend %s", backend.name)
                backend.healthy = True
                self._push(backend)
                self._notify()
            elif not ok:
                self._eject(backend, reason)
        await asyncio.gather(*(probe(b) for b in list(self._backends.values())))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # never let the checker die
                log.exception("health check failed")

    async def _close_when_idle(self, backend: Backend) -> None:
        while backend.in_flight > 0:
            await asyncio.sleep(0.05)
        with contextlib.suppress(Exception):
            await backend.engine.close()

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def _notify(self) -> None:
        condition = self._changed
        if condition is None or self._waiters == 0:  # nobody waits: skip the wake-up task
            return

        async def wake() -> None:
            async with condition:
                condition.notify_all()
        with contextlib.suppress(RuntimeError):  # no running loop (construction time)
            task = asyncio.get_running_loop().create_task(wake())
            self._closers.add(task)
            task.add_done_callback(self._closers.discard)


def _out_of_time(request: GenerateRequest) -> GenerateResult:
    """The turn of a request whose time ran out before any backend took it: no tokens."""
    return GenerateResult([], [], "deadline", request.min_policy_version, "",
                          request.sampling.logprobs_mode)
