"""Blocking wrapper around the async client, for scripts and trainers without an event loop.

The async client runs on a private event loop in a daemon thread; every method submits a
coroutine there and waits for it. That keeps one implementation (resume, de-duplication, acks)
and lets a trainer call the client from any thread, including from inside another framework's
event loop, which ``asyncio.run`` per call would not allow.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterable, Iterator
from typing import Any, TypeVar

from rollout.client.aio import DEFAULT_ADDRESS, RolloutClient
from rollout.client.session import Session
from rollout.client.specs import SpecLike
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb

T = TypeVar("T")


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-client",
                                        daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self.run(agen.__anext__())  # type: ignore[arg-type]
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None and not self.loop.is_closed():
                self.run(aclose())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()


class SessionSync:
    """Blocking view of :class:`rollout.client.session.Session` (same guarantees)."""

    def __init__(self, session: Session, runner: _LoopThread) -> None:
        self._s = session
        self._r = runner

    def __enter__(self) -> SessionSync:
        self._r.run(self._s.start())
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    @property
    def session(self) -> Session:
        return self._s

    def submit(self, specs: SpecLike | Iterable[SpecLike]) -> list[str]:
        return self._r.run(self._s.submit(specs))

    def submit_group(self, template: SpecLike, n: int, group_id: str,
                     finish_after: int = 0) -> list[str]:
        return self._r.run(self._s.submit_group(template, n, group_id, finish_after))

    def ack(self, delivery_ids: Iterable[int]) -> None:
        self._r.run(self._s.ack(list(delivery_ids)))

    def cancel(self, job_ids: Iterable[str] = (), group_ids: Iterable[str] = ()) -> None:
        self._r.run(self._s.cancel(list(job_ids), list(group_ids)))

    def close(self) -> None:
        self._r.run(self._s.close())

    def abort(self) -> None:
        self._r.run(self._s.aclose())

    def events(self) -> Iterator[pb.StreamRolloutsResponse]:
        return self._r.iterate(self._s.events())

    def trajectories(self) -> Iterator[pb.TrajectoryReady]:
        return self._r.iterate(self._s.trajectories())


class RolloutClientSync:
    """``with RolloutClientSync(addr) as client: client.status()`` — see ``RolloutClient``."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, token: str | None = None,
                 max_message_bytes: int = 64 << 20, timeout_s: float | None = 30.0) -> None:
        self._r = _LoopThread()
        self._c = RolloutClient(address, token=token, max_message_bytes=max_message_bytes,
                                timeout_s=timeout_s)

    def __enter__(self) -> RolloutClientSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._r.loop.is_closed():
            self._r.run(self._c.close())
            self._r.stop()

    @property
    def aio(self) -> RolloutClient:
        return self._c

    def get_job(self, job_id: str, *, include_trajectory: bool = False,
                include_text: bool = False) -> pb.GetJobResponse:
        return self._r.run(self._c.get_job(job_id, include_trajectory=include_trajectory,
                                           include_text=include_text))

    def list_jobs(self, **filters: Any) -> Iterator[job_pb2.Job]:
        return self._r.iterate(self._c.list_jobs(**filters))

    def cancel(self, *, job_id: str = "", group_id: str = "") -> list[str]:
        return self._r.run(self._c.cancel(job_id=job_id, group_id=group_id))

    def status(self) -> pb.GetServerStatusResponse:
        return self._r.run(self._c.status())

    def submit_rollout(self, spec: SpecLike, **options: Any
                       ) -> Iterator[pb.SubmitRolloutResponse]:
        """See :meth:`RolloutClient.submit_rollout` (``progress``, ``batch_progress``,
        ``on_wire``: called on the client's own thread)."""
        return self._r.iterate(self._c.submit_rollout(spec, **options))

    def session(self, client_id: str, **options: Any) -> SessionSync:
        """Use as ``with client.session("trainer-0") as s: ...``."""
        return SessionSync(self._c.session(client_id, **options), self._r)
