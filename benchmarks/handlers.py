"""Benchmark-only environments: they do no real work, so the pipeline's own cost shows.

Not registered as entry points and never used by a production server unless a benchmark (or a
user who wants to measure overhead) registers them explicitly:

- ``noop``: every stage returns at once (measures scheduler + store + transport overhead).
- ``sleep``: each stage sleeps ``task["init_s"|"run_s"|"eval_s"]`` seconds (measures overlap
  of stages against the bottleneck-stage bound, as if each stage waited on I/O).
- ``cpu``: each stage does a fixed amount of pure-Python work, ``task["iters"]`` steps of a
  32-bit linear congruential generator (measures whether stage work in more processes,
  ``rollout serve --workers N``, buys throughput; see :class:`CpuHandler`).
- ``long``: RUN sleeps ``task["run_s"]`` (an agent's episode takes time) and returns
  ``task["turns"]`` turns of ``task["prompt"]`` prompt and ``task["output"]`` output tokens
  (ids past the interpreter's small-int cache, as real vocabulary ids are), so a trajectory is
  as large as a long agent episode's (``rollout bench stalled``).
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import TYPE_CHECKING, Any

from rollout.runtime.handler import (
    AgentHandler,
    HandlerError,
    HandlerRegistry,
    JobContext,
    RunOutcome,
)
from rollout.runtime.types import Reward, TerminationReason, Turn

if TYPE_CHECKING:
    from rollout.server.config import Config

_TURN = Turn(prompt_ids=[1, 2, 3], output_ids=[4, 5], output_logprobs=[-0.5, -0.25])


class NoopHandler(AgentHandler):
    name = "noop"

    async def init(self, ctx: JobContext) -> None:
        return None

    async def run(self, ctx: JobContext) -> RunOutcome:
        return RunOutcome(turns=[_TURN], termination=TerminationReason.NO_TOOL_CALL)

    async def eval(self, ctx: JobContext) -> Reward:
        return Reward(1.0)


class SleepHandler(AgentHandler):
    name = "sleep"

    async def init(self, ctx: JobContext) -> None:
        await asyncio.sleep(float(ctx.spec.task.get("init_s", 0.0)))

    async def run(self, ctx: JobContext) -> RunOutcome:
        await asyncio.sleep(float(ctx.spec.task.get("run_s", 0.0)))
        return RunOutcome(turns=[_TURN], termination=TerminationReason.NO_TOOL_CALL)

    async def eval(self, ctx: JobContext) -> Reward:
        await asyncio.sleep(float(ctx.spec.task.get("eval_s", 0.0)))
        return Reward(1.0)


def long_turns(job_id: str, task: Any) -> list[Turn]:
    """The turns ``long`` returns for a job (the benchmark sizes them the same way)."""
    prompt, output = int(task.get("prompt", 100)), int(task.get("output", 20))
    base = 1000 + sum(job_id.encode())
    return [Turn(prompt_ids=list(range(base + i, base + i + prompt)),
                 output_ids=list(range(base + 7 * i, base + 7 * i + output)),
                 output_logprobs=[-0.5] * output)
            for i in range(int(task.get("turns", 2000)))]


class LongHandler(AgentHandler):
    name = "long"

    async def init(self, ctx: JobContext) -> None:
        return None

    async def run(self, ctx: JobContext) -> RunOutcome:
        await asyncio.sleep(float(ctx.spec.task.get("run_s", 0.0)))
        return RunOutcome(turns=long_turns(ctx.spec.job_id, ctx.spec.task),
                          termination=TerminationReason.MAX_TURNS)

    async def eval(self, ctx: JobContext) -> Reward:
        return Reward(1.0)


CPU_ITERS = 200_000
"""Default ``cpu`` work per stage: tens of milliseconds of one core, well above what the server
process spends per job on its own bookkeeping and, with ``--workers``, on one Ray call per
stage (``rollout bench pipeline --workers`` shows both), so the stage work dominates."""
CPU_SLICE = 2_000
"""Steps between yields to the event loop (well under a millisecond)."""


_A, _C, _MASK = 1103515245, 12345, 0xFFFFFFFF


def lcg(seed: int, steps: int) -> int:
    """``steps`` steps of a 32-bit linear congruential generator from ``seed``, one by one."""
    x = seed & _MASK
    for _ in range(steps):
        x = (x * _A + _C) & _MASK
    return x


def lcg_jump(seed: int, steps: int) -> int:
    """The same value in O(log steps): one step is the affine map x -> A x + C (mod 2^32), and
    ``steps`` steps are that map composed with itself, by repeated squaring."""
    mul, add = 1, 0  # the identity map
    a, c = _A, _C
    while steps:
        if steps & 1:
            mul, add = (mul * a) & _MASK, (add * a + c) & _MASK
        a, c = (a * a) & _MASK, (c * a + c) & _MASK
        steps >>= 1
    return (seed * mul + add) & _MASK


async def _cpu_work(seed: int, steps: int) -> int:
    # Inline, in slices that yield between them: a thread would not run beside the event loop
    # anyway (the GIL), and while it held the GIL the loop would wait up to a switch interval
    # (``sys.getswitchinterval()``) at every wake-up, slowing the gRPC front more than the work
    # itself does. Slices keep the loop (the front, other jobs, Ray's calls into an agent)
    # answering within one slice, and the total work is exactly ``steps``.
    x = seed
    while steps > 0:
        n = min(steps, CPU_SLICE)
        x = lcg(x, n)
        steps -= n
        if steps:
            await asyncio.sleep(0)
    return x


class CpuHandler(AgentHandler):
    """CPU-bound stage work in pure Python: the case where more processes can help.

    Real environments do such work between I/O waits (parsing tool output, applying a diff,
    grading with a Python checker, rendering chat templates); here it is all there is, so a
    single-process server is bound by one core running the front, the scheduler and every
    stage's work under one GIL, while ``--workers N`` moves the work into N processes.
    Each stage runs ``task["iters"]`` (default :data:`CPU_ITERS`) generator steps: INIT seeds
    from the job id and keeps its value; RUN continues from it and reports the digest and the
    process it ran in; EVAL recomputes INIT's value from the job id (its own fixed work),
    checks it against what INIT kept, and checks RUN's digest by jumping ahead in closed form
    (:func:`lcg_jump`, an independent computation). Reward 1.0 only when both hold, so a
    context mixed up between jobs or processes, or work skipped, shows as reward 0.
    """

    name = "cpu"

    @staticmethod
    def _iters(ctx: JobContext) -> int:
        return int(ctx.spec.task.get("iters", CPU_ITERS))

    @staticmethod
    def _seed(ctx: JobContext) -> int:
        return sum(ctx.spec.job_id.encode()) * 2654435761

    async def init(self, ctx: JobContext) -> None:
        ctx.state["cpu"] = await _cpu_work(self._seed(ctx), self._iters(ctx))

    async def run(self, ctx: JobContext) -> RunOutcome:
        digest = await _cpu_work(int(ctx.state["cpu"]), self._iters(ctx))
        return RunOutcome(turns=[_TURN], termination=TerminationReason.NO_TOOL_CALL,
                          metadata={"digest": str(digest), "pid": str(os.getpid())})

    async def eval(self, ctx: JobContext) -> Reward:
        assert ctx.outcome is not None
        kept = await _cpu_work(self._seed(ctx), self._iters(ctx))
        digest = str(lcg_jump(kept, self._iters(ctx)))
        ok = kept == ctx.state.get("cpu") and ctx.outcome.metadata.get("digest") == digest
        return Reward(1.0 if ok else 0.0)


BENCH_HANDLERS = {name: f"{__name__}:{cls.__name__}" for name, cls in (
    ("noop", NoopHandler), ("sleep", SleepHandler), ("cpu", CpuHandler),
    ("long", LongHandler))}
"""The bench environments as ``cluster.handlers`` entries, so node agents (``--workers``)
load the same classes."""


def register_bench_handlers(registry: object) -> None:
    """Add ``noop``, ``sleep``, ``cpu`` and ``long`` to a ``HandlerRegistry``."""
    registry.register("long", LongHandler())  # type: ignore[attr-defined]
    registry.register("noop", NoopHandler())  # type: ignore[attr-defined]
    registry.register("sleep", SleepHandler())  # type: ignore[attr-defined]
    registry.register("cpu", CpuHandler())  # type: ignore[attr-defined]


async def no_sandbox(**options: Any) -> Any:
    """The bench servers' sandbox factory: the bench environments never ask for one."""
    raise HandlerError("the bench server has no sandbox runtime", "NO_SANDBOX")


WORKERS_START_S = 180.0
"""Bound on the node agents' start (each imports the server; on a busy 2-core machine that
takes tens of seconds)."""


def serve_until_signalled(cfg: Config, grace_s: float) -> int:
    """Child process of a benchmark: a real server on ``cfg`` with the bench environments and no
    sandbox runtime. Prints ``PORT <n>`` (and the dashboard's port after it, when one is
    configured) once it listens and, with ``cluster.workers``, once
    every node agent has joined (a benchmark must not time the agents' start); stops on SIGINT
    or SIGTERM."""
    from rollout.server.app import Server

    if cfg.cluster.workers:
        cfg.cluster.handlers = {**BENCH_HANDLERS, **cfg.cluster.handlers}

    async def run() -> None:
        registry = HandlerRegistry()
        register_bench_handlers(registry)
        server = await Server(cfg, registry=registry, sandbox_factory=no_sandbox).start()
        if cfg.cluster.workers:
            assert server.scheduler is not None
            nodes = server.scheduler.nodes
            async with asyncio.timeout(WORKERS_START_S):
                while len(nodes) < cfg.cluster.workers:
                    await asyncio.sleep(0.1)
        dashboard = f" {server.dashboard.port}" if server.dashboard is not None else ""
        print(f"PORT {server.port}{dashboard}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop(grace_s)

    asyncio.run(run())
    return 0
