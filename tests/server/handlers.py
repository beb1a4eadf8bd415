"""Test-only environments with scripted behaviour, driven by the task payload.

Task keys (all optional):
- ``sleep``: {"init": s, "run": s, "eval": s} seconds to sleep in each stage;
- ``gate``: list of stages that wait until the test opens the gate for (job, stage);
- ``fail``: a stage name whose handler raises ``HandlerError(reason="SCRIPTED_FAILURE")``;
- ``crash``: a stage name whose handler raises ``ZeroDivisionError`` (an unexpected error);
- ``spawn``: start ``sleep 600`` in INIT and register killing it with ``ctx.resources``;
- ``turns``: emit this many ``turn`` progress events in RUN;
- ``reward``: the reward EVAL returns (default 1.0);
- ``bad``: makes ``validate_task`` reject the task.
Every stage start/end and every cleanup is appended to ``events`` so tests assert on ordering.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping
from typing import Any

from rollout.runtime.handler import AgentHandler, HandlerError, JobContext, RunOutcome
from rollout.runtime.types import InvalidArgument, Reward, TerminationReason, Turn


class ScriptedHandler(AgentHandler):
    name = "scripted"

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []
        """(job_id, stage, "start" | "end" | "cancelled") and (job_id, "cleanup", "")."""
        self._gates: dict[tuple[str, str], asyncio.Event] = {}
        self.pids: dict[str, int] = {}
        self.resources_closed: set[str] = set()

    def gate(self, job_id: str, stage: str) -> asyncio.Event:
        return self._gates.setdefault((job_id, stage), asyncio.Event())

    def open(self, job_id: str, stage: str) -> None:
        self.gate(job_id, stage).set()

    def started(self, job_id: str, stage: str) -> bool:
        return (job_id, stage, "start") in self.events

    def validate_task(self, task: Mapping[str, Any]) -> None:
        if task.get("bad"):
            raise InvalidArgument("task is marked bad", "INVALID_TASK", "task.bad")

    async def _stage(self, ctx: JobContext, stage: str, *, started: bool = False) -> None:
        job_id, task = ctx.spec.job_id, ctx.spec.task
        if not started:
            self.events.append((job_id, stage, "start"))
        try:
            if stage in task.get("gate", ()):
                await self.gate(job_id, stage).wait()
            delay = float(task.get("sleep", {}).get(stage, 0.0))
            if delay:
                await asyncio.sleep(delay)
            if task.get("fail") == stage:
                raise HandlerError(f"scripted failure in {stage}", "SCRIPTED_FAILURE")
            if task.get("crash") == stage:
                _ = 1 / 0
        except asyncio.CancelledError:
            self.events.append((job_id, stage, "cancelled"))
            raise
        self.events.append((job_id, stage, "end"))

    async def init(self, ctx: JobContext) -> None:
        # "start" is recorded before the first await, so a cancel that lands while the
        # subprocess is being spawned still counts as a started INIT (cleanup follows).
        self.events.append((ctx.spec.job_id, "init", "start"))
        if ctx.spec.task.get("spawn"):
            proc = await asyncio.create_subprocess_exec("sleep", "600")
            self.pids[ctx.spec.job_id] = proc.pid

            async def kill() -> None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                await proc.wait()
                self.resources_closed.add(ctx.spec.job_id)

            ctx.resources.push_async_callback(kill)
        ctx.state["init_done"] = True
        await self._stage(ctx, "init", started=True)

    async def run(self, ctx: JobContext) -> RunOutcome:
        assert ctx.state.get("init_done"), "state must carry from INIT to RUN"
        turns = int(ctx.spec.task.get("turns", 1))
        # "width": prompt tokens per turn, with ids past the interpreter's small-int cache,
        # for trajectories as large in memory and on the wire as a long real one.
        width = int(ctx.spec.task.get("width", 0))
        prompt = list(range(1000, 1000 + width)) if width else [1, 2]
        for i in range(turns):
            ctx.progress("turn", {"turn": i})
        await self._stage(ctx, "run")
        return RunOutcome(
            turns=[Turn(prompt_ids=list(prompt), output_ids=[3 + i], output_logprobs=[-0.5])
                   for i in range(turns)],
            termination=TerminationReason.NO_TOOL_CALL, metadata={"scripted": "yes"})

    async def eval(self, ctx: JobContext) -> Reward:
        assert ctx.outcome is not None, "EVAL must see RUN's outcome"
        await self._stage(ctx, "eval")
        return Reward(float(ctx.spec.task.get("reward", 1.0)), {"exact": 1.0})

    async def cleanup(self, ctx: JobContext) -> None:
        self.events.append((ctx.spec.job_id, "cleanup", ""))


# ---------------------------------------------------------------------------- test helpers


def spec(job_id: str, *, priority: int = 0, group: Any = None, env: str = "scripted",
         limits: Any = None, **task: Any) -> Any:
    from rollout.runtime.types import JobSpec, Limits

    return JobSpec(job_id=job_id, environment=env, task=task, priority=priority, group=group,
                   limits=limits or Limits())


@contextlib.asynccontextmanager
async def running_scheduler(db_path: Any, handler: ScriptedHandler | None = None,
                            **config: Any) -> Any:
    """A started scheduler over a fresh store with the scripted environment registered."""
    from rollout.runtime.handler import HandlerRegistry
    from rollout.server.scheduler import PipelineConfig, Scheduler
    from rollout.server.store import JobStore

    handler = handler or ScriptedHandler()
    registry = HandlerRegistry()
    registry.register("scripted", handler)
    store = JobStore(db_path)
    await store.open()
    config.setdefault("cleanup_deadline_s", 5.0)
    sched = Scheduler(store, registry, config=PipelineConfig(**config))
    await sched.start()
    try:
        yield sched, handler
    finally:
        await sched.stop(grace_s=0.0)
        await store.close()


async def collect_finished(sub: Any, job_ids: Any,
                           timeout: float = 20.0) -> dict[str, Any]:
    """Read ``sub`` until a JobFinished arrived for every id; returns them by job id."""
    from rollout.server.pipeline.subscription import JobFinished

    want, got = set(job_ids), {}
    async with asyncio.timeout(timeout):
        async for ev in sub:
            if isinstance(ev, JobFinished) and ev.job_id in want:
                got[ev.job_id] = ev
                if len(got) == len(want):
                    break
    return got
