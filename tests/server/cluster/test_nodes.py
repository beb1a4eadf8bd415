"""The node abstraction without Ray: placement, stages kept on one node, a node that dies.

The nodes here are in-process (each wraps a real ``LocalNode`` running the scripted
environment); a dying one fails its calls with ``NodeLost`` exactly as a Ray node whose actor
died does (``ray_backend.RayNode``), so the scheduler's side of a node death is tested fast and
deterministically. The Ray cluster itself is tested in ``test_ray_cluster.py``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.handler import HandlerRegistry, JobContext, ProgressFn
from rollout.runtime.types import JobSpec, JobState, Stage
from rollout.server.cluster.node import LocalNode, NodeLost, NodeSet
from rollout.server.pipeline.stages import StageResult
from rollout.server.pipeline.subscription import JobFinished, TrajectoryReady
from rollout.server.scheduler import PipelineConfig, Scheduler
from rollout.server.store import JobStore
from tests.server.handlers import ScriptedHandler, spec
from tests.util import assert_eventually

ROOT = Path(__file__).resolve().parents[3]


class _Resources:
    def __init__(self, registry: HandlerRegistry) -> None:
        self.registry = registry
        self.llm = None
        self.sandbox_factory = None


class TestNode:
    """An in-process node that records what ran on it and can die (its calls then fail)."""

    __test__ = False

    def __init__(self, name: str, registry: HandlerRegistry, slots: int) -> None:
        self.name = name
        self.slots = slots
        self.held = 0
        self.alive = True
        self.dead = False
        self.ran: list[tuple[str, Stage]] = []
        self._inner = LocalNode(_Resources(registry), name)
        self._calls: set[asyncio.Future[Any]] = set()

    def open_context(self, spec: JobSpec, progress: ProgressFn) -> JobContext:
        return self._inner.open_context(spec, progress)

    async def _guard(self, coro: Any) -> Any:
        if self.dead:
            coro.close()
            raise NodeLost(self.name, "dead")
        task = asyncio.ensure_future(coro)
        self._calls.add(task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if self.dead:
                raise NodeLost(self.name, "died mid-call") from None
            task.cancel()
            raise
        finally:
            self._calls.discard(task)

    async def run_stage(self, ctx: JobContext, stage: Stage, timeout_s: float) -> StageResult:
        self.ran.append((ctx.spec.job_id, stage))
        result: StageResult = await self._guard(self._inner.run_stage(ctx, stage, timeout_s))
        return result

    async def release(self, ctx: JobContext, deadline_s: float) -> None:
        await self._guard(self._inner.release(ctx, deadline_s))

    def capacity(self) -> dict[str, int]:
        return self._inner.capacity()

    def die(self, waiters: list[asyncio.Task[Any]]) -> None:
        """Every call in flight fails with NodeLost (its work is abandoned, as on a dead host)."""
        self.dead = True
        for task in waiters:
            task.cancel()


async def _scheduler(tmp_path: Path, nodes: NodeSet, registry: HandlerRegistry,
                     **config: Any) -> tuple[Scheduler, JobStore]:
    store = JobStore(tmp_path / "jobs.db")
    await store.open()
    config.setdefault("cleanup_deadline_s", 5.0)
    sched = Scheduler(store, registry, nodes=nodes, config=PipelineConfig(**config))
    await sched.start()
    return sched, store


async def _deliveries(sub: Any, n: int, seen: dict[str, int], timeout: float = 20.0) -> None:
    """Count TrajectoryReady per job id until ``n`` JobFinished arrived."""
    finished = 0
    async with asyncio.timeout(timeout):
        async for ev in sub:
            if isinstance(ev, TrajectoryReady):
                seen[ev.job_id] = seen.get(ev.job_id, 0) + 1
            elif isinstance(ev, JobFinished):
                finished += 1
                if finished == n:
                    return


async def test_least_loaded_node_with_a_free_slot() -> None:
    reg = HandlerRegistry()
    a, b = TestNode("a", reg, slots=2), TestNode("b", reg, slots=4)
    nodes = NodeSet({"a": a, "b": b})
    got = [(await nodes.acquire()).name for _ in range(6)]
    # Worked by hand: load = held/slots, ties to the node given fewer jobs, then by name.
    # a 0/2 b 0/4 -> a; a 1/2 b 0/4 -> b; a .5 b .25 -> b; a .5 b .5 (a:1, b:2) -> a;
    # a full -> b, b.
    assert got == ["a", "b", "b", "a", "b", "b"]
    assert (a.held, b.held) == (2, 4)
    waiting = asyncio.ensure_future(nodes.acquire())
    await asyncio.sleep(0.05)
    assert not waiting.done()  # every slot is taken
    nodes.give_back(a)
    assert (await asyncio.wait_for(waiting, 5)) is a
    nodes.add(c := TestNode("c", reg, slots=1))  # a node that joins takes the next job
    assert (await nodes.acquire()) is c


async def test_stages_of_a_job_stay_on_its_node(tmp_path: Path) -> None:
    handler = ScriptedHandler()
    reg = HandlerRegistry()
    reg.register("scripted", handler)
    a, b = TestNode("a", reg, slots=2), TestNode("b", reg, slots=2)
    sched, store = await _scheduler(tmp_path, NodeSet({"a": a, "b": b}), reg)
    try:
        sub = await sched.attach("t")
        ids = [f"j{i}" for i in range(8)]
        await sched.submit([spec(j, sleep={"run": 0.05}) for j in ids], "t")
        seen: dict[str, int] = {}
        await _deliveries(sub, len(ids), seen)
        assert seen == dict.fromkeys(ids, 1)
        for j in ids:
            on_a = [s for job, s in a.ran if job == j]
            on_b = [s for job, s in b.ran if job == j]
            assert sorted([on_a, on_b], key=len) == [[], [Stage.INIT, Stage.RUN, Stage.EVAL]]
        assert a.ran and b.ran
        assert a.held == b.held == 0  # every slot came back with the release
        assert sorted(j for j, what, _ in handler.events if what == "cleanup") == ids
    finally:
        await sched.stop(0)
        await store.close()


async def test_a_dead_node_s_jobs_run_again_elsewhere_exactly_once(tmp_path: Path) -> None:
    handler = ScriptedHandler()
    reg = HandlerRegistry()
    reg.register("scripted", handler)
    a, b = TestNode("a", reg, slots=3), TestNode("b", reg, slots=3)
    nodes = NodeSet({"a": a, "b": b})
    sched, store = await _scheduler(tmp_path, nodes, reg)
    try:
        sub = await sched.attach("t")
        ids = [f"j{i}" for i in range(6)]
        await sched.submit([spec(j, gate=["run"]) for j in ids], "t")
        await assert_eventually(lambda: sum(handler.started(j, "run") for j in ids) == 6)
        on_a = sorted({j for j, s in a.ran if s is Stage.RUN})
        assert len(on_a) == 3
        a.die([sched._live[j].task for j in on_a])  # type: ignore[misc]
        await assert_eventually(lambda: sched.node_losses == 3)
        for j in ids:
            handler.open(j, "run")
        seen: dict[str, int] = {}
        await _deliveries(sub, len(ids), seen)
        assert all((j, Stage.EVAL) in b.ran and (j, Stage.EVAL) not in a.ran for j in on_a)
        assert seen == dict.fromkeys(ids, 1)
        assert nodes.names() == ["b"] and nodes.lost == ["a"]
        assert sched.node_losses == 3
        for j in on_a:
            rec = await sched.get(j)
            assert rec is not None and rec.state is JobState.SUCCEEDED and rec.attempts == 2
        stored = {s.job_id: s for s in await store.live_jobs()}
        assert not stored  # nothing left behind in the store
    finally:
        await sched.stop(0)
        await store.close()


async def test_a_job_whose_node_dies_max_attempts_times_fails(tmp_path: Path) -> None:
    handler = ScriptedHandler()
    reg = HandlerRegistry()
    reg.register("scripted", handler)
    a = TestNode("a", reg, slots=1)
    sched, store = await _scheduler(tmp_path, NodeSet({"a": a}), reg, max_attempts=1)
    try:
        sub = await sched.attach("t")
        await sched.submit([spec("j", gate=["run"])], "t")
        await assert_eventually(lambda: handler.started("j", "run"))
        a.die([sched._live["j"].task])  # type: ignore[list-item]
        async with asyncio.timeout(10):
            async for ev in sub:
                if isinstance(ev, JobFinished):
                    break
        assert ev.state is JobState.FAILED and ev.error is not None
        assert ev.error.reason == "TOO_MANY_ATTEMPTS"
    finally:
        await sched.stop(0)
        await store.close()


@pytest.mark.timeout(120)
def test_plain_serve_never_imports_ray(tmp_path: Path) -> None:
    """A server without --ray / --workers runs a job and has not loaded Ray."""
    code = f"""
import asyncio, sys
from rollout.runtime.handler import HandlerRegistry
from rollout.server.app import Server
from rollout.server.config import load_config
from tests.server.handlers import ScriptedHandler, spec

async def main():
    reg = HandlerRegistry(); reg.register("scripted", ScriptedHandler())
    cfg = load_config(None, ["server.port=0", "server.state_dir={tmp_path}/s",
                             "llm.backends=[]"], environ={{}})
    srv = await Server(cfg, registry=reg, sandbox_factory=lambda **k: None).start()
    sub = await srv.scheduler.attach("t")
    await srv.scheduler.submit([spec("j")], "t")
    async for ev in sub:
        if type(ev).__name__ == "JobFinished":
            print("STATE", ev.state.name)
            break
    await srv.stop(0)
    print("RAY", "ray" in sys.modules)
asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=110, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "STATE SUCCEEDED" in out.stdout, out.stderr[-2000:]
    assert "RAY False" in out.stdout
