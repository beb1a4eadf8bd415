"""Benchmark-only environments: they do no real work, so the pipeline's own cost shows.

Not registered as entry points and never used by a production server unless a benchmark (or a
user who wants to measure overhead) registers them explicitly:

- ``noop``: every stage returns at once (measures scheduler + store + transport overhead).
- ``sleep``: each stage sleeps ``task["init_s"|"run_s"|"eval_s"]`` seconds (measures overlap
  of stages against the bottleneck-stage bound, as if each stage waited on I/O).
"""

from __future__ import annotations

import asyncio
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


def register_bench_handlers(registry: object) -> None:
    """Add ``noop`` and ``sleep`` to a ``HandlerRegistry``."""
    registry.register("noop", NoopHandler())  # type: ignore[attr-defined]
    registry.register("sleep", SleepHandler())  # type: ignore[attr-defined]


async def no_sandbox(**options: Any) -> Any:
    """The bench servers' sandbox factory: the bench environments never ask for one."""
    raise HandlerError("the bench server has no sandbox runtime", "NO_SANDBOX")


def serve_until_signalled(cfg: Config, grace_s: float) -> int:
    """Child process of a benchmark: a real server on ``cfg`` with the bench environments and no
    sandbox runtime. Prints ``PORT <n>`` once it listens; stops on SIGINT or SIGTERM."""
    from rollout.server.app import Server

    async def run() -> None:
        registry = HandlerRegistry()
        register_bench_handlers(registry)
        server = await Server(cfg, registry=registry, sandbox_factory=no_sandbox).start()
        print(f"PORT {server.port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop(grace_s)

    asyncio.run(run())
    return 0
