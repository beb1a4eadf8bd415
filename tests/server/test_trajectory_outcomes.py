"""Through a real gRPC server: every trajectory says how its job ended (state, error), returns
the client's labels untouched, and reports the seed; a RUN whose LLM turn was aborted or cut by
weight swaps is never scored by EVAL. The environment runs the real agent loop against the
scripted policy."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest

from rollout.client.aio import RolloutClient
from rollout.client.errors import RolloutError
from rollout.client.trajectory import flatten
from rollout.runtime.agent_loop import run_agent_loop
from rollout.runtime.handler import (
    AgentHandler,
    HandlerError,
    HandlerRegistry,
    JobContext,
    RunOutcome,
)
from rollout.runtime.tools.base import ToolResult
from rollout.runtime.tools.submit import SubmitTool
from rollout.runtime.types import Reward
from rollout.server.app import Server
from rollout.server.llm.scripted import ScriptedEngine
from rollout.v1 import job_pb2, trajectory_pb2
from tests.client.conftest import make_config
from tests.runtime.chat_families import chatml_tokenizer
from tests.runtime.doubles import EngineClient

pytestmark = pytest.mark.timeout(60)
S = job_pb2.Job


class EchoTool:
    name = "echo"
    description = "Echo the text back."
    parameters: Mapping[str, Any] = {"type": "object", "properties": {"text": {"type": "string"}}}

    async def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        return ToolResult(f"echo: {arguments.get('text')}")


class LoopHandler(AgentHandler):
    name = "loop"

    def __init__(self) -> None:
        self.evaluated: list[str] = []

    async def init(self, ctx: JobContext) -> None:
        return None

    async def run(self, ctx: JobContext) -> RunOutcome:
        task = [{"role": "user", "content": "Echo, then submit."}]
        return await run_agent_loop(ctx, [EchoTool(), SubmitTool(ctx.state)], task)

    async def eval(self, ctx: JobContext) -> Reward:
        self.evaluated.append(ctx.spec.job_id)
        if ctx.spec.task.get("fail_eval"):
            raise HandlerError("the grader broke", "GRADER_BROKE")
        return Reward(1.0)


def call(name: str, **arguments: Any) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def script(session_id: str, turn: int) -> str:
    if session_id in ("ok", "evalfail") and turn >= 1:
        return call("submit", answer="42")
    return call("echo", text=f"turn {turn}")  # the others echo until stopped


async def test_every_trajectory_says_how_its_job_ended(tmp_path: Path) -> None:
    engine = ScriptedEngine(chatml_tokenizer(), script, latency_s=0.2)
    handler = LoopHandler()
    registry = HandlerRegistry()
    registry.register("loop", handler)
    server = await Server(make_config(tmp_path / "state"), registry=registry,
                          llm=EngineClient(engine)).start()
    labels = {"step": "17", "final_text": "the client's own value"}
    jobs = [{"job_id": j, "environment": "loop", "task": {"fail_eval": j == "evalfail"},
             "metadata": labels, "limits": {"max_turns": 50}}
            for j in ("ok", "evalfail", "cancel", "swap", "abort")]
    jobs[0]["sampling"] = {"seed": 7}
    trajs: dict[str, trajectory_pb2.Trajectory] = {}

    async def disrupt() -> None:
        """Once each job's turn 1 is in flight (turn 0 finished): cancel one job, abort one's
        turn under it, and keep cutting the other's turn 1 as weight swaps would."""
        await asyncio.sleep(0)
        while len(trajs) < len(jobs):
            await asyncio.sleep(0.02)
            for sid in ("cancel", "abort", "swap"):
                started = sum(r.session_id == sid for r in engine.requests)
                if started >= 2 and engine.in_flight(sid):
                    if sid == "cancel" and not cancelled.done():
                        cancelled.set_result(None)
                    elif sid == "abort":
                        await engine.abort(sid)
                    elif sid == "swap":
                        await engine.preempt(sid)

    try:
        async with RolloutClient(f"127.0.0.1:{server.port}") as client, \
                client.session("trainer") as session:
            cancelled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            await session.submit(jobs)
            disruptor = asyncio.create_task(disrupt())
            await cancelled
            await session.cancel(job_ids=["cancel"])
            async with asyncio.timeout(40):
                async for ready in session.trajectories():
                    trajs[ready.trajectory.job_id] = ready.trajectory
                    await session.ack([ready.delivery_id])
                    if len(trajs) == len(jobs):
                        break
            if disruptor.done():
                disruptor.result()  # surface a crash of the disruptor itself
            disruptor.cancel()
            status = await client.status()
    finally:
        await server.stop(0.1)

    ok = trajs["ok"]
    assert ok.state == S.STATE_SUCCEEDED and not ok.HasField("error") and ok.reward == 1.0
    assert dict(ok.labels) == labels  # returned unchanged, in a field of their own
    assert ok.metadata["final_text"] != labels["final_text"]  # server information intact
    assert ok.HasField("seed") and ok.seed == 7
    assert [r.seed for r in engine.requests if r.session_id == "ok"] == [7, 8]
    assert ok.logprobs_kind == job_pb2.LOGPROBS_KIND_PROCESSED
    assert [t.finish_reason for t in ok.turns] == [trajectory_pb2.FINISH_REASON_STOP] * 2

    failed = trajs["evalfail"]
    assert failed.state == S.STATE_FAILED and failed.error.reason == "GRADER_BROKE"
    assert failed.error.stage == job_pb2.STAGE_EVAL and failed.reward == 0.0
    assert len(failed.turns) == 2 and dict(failed.labels) == labels

    cancel = trajs["cancel"]
    assert cancel.state == S.STATE_CANCELLED
    assert cancel.error.code == job_pb2.JobError.CODE_CANCELLED
    assert cancel.termination_reason == trajectory_pb2.TERMINATION_REASON_CANCELLED
    assert len(cancel.turns) >= 1  # the finished turns are salvaged
    # A drawn seed is reported and is what the turns were sampled with.
    assert cancel.HasField("seed")
    assert [r.seed for r in engine.requests if r.session_id == "cancel"][:2] == [
        cancel.seed, cancel.seed + 1]

    aborted = trajs["abort"]
    assert aborted.state == S.STATE_FAILED and aborted.error.reason == "RUN_CANCELLED"
    assert aborted.termination_reason == trajectory_pb2.TERMINATION_REASON_CANCELLED
    assert len(aborted.turns) == 1

    swapped = trajs["swap"]
    assert swapped.state == S.STATE_FAILED and swapped.error.reason == "TURN_PREEMPTED"
    assert swapped.error.code == job_pb2.JobError.CODE_BACKEND_UNAVAILABLE
    assert len(swapped.turns) == 1  # turn 0; none of turn 1's cut attempts
    assert sum(r.session_id == "swap" for r in engine.requests) == 1 + 4  # 3 re-issues

    # Neither cut RUN reached EVAL; only the two jobs whose loops finished were graded.
    assert sorted(handler.evaluated) == ["evalfail", "ok"]
    # GetServerStatus counts outcomes by how the trajectories ended, not only by job state.
    assert dict(status.jobs_by_termination) == {"SUBMITTED": 1, "ERROR": 2, "CANCELLED": 2}
    # A trainer's default view holds only the success.
    assert [f.job_id for f in map(flatten, trajs.values()) if f is not None] == ["ok"]


async def test_bad_chat_options_are_rejected_with_what_to_fix(tmp_path: Path) -> None:
    registry = HandlerRegistry()
    registry.register("loop", LoopHandler())
    engine = ScriptedEngine(chatml_tokenizer(), script)
    server = await Server(make_config(tmp_path / "state"), registry=registry,
                          llm=EngineClient(engine)).start()
    try:
        async with RolloutClient(f"127.0.0.1:{server.port}") as client:
            for chat, reason, field in (
                    ({"tool_call_format": "llama2"}, "UNKNOWN_TOOL_CALL_FORMAT",
                     "chat.tool_call_format"),
                    ({"chat_template_kwargs": {"tools": []}}, "INVALID_CHAT_OPTIONS",
                     "chat.chat_template_kwargs")):
                spec = {"job_id": f"bad-{reason}", "environment": "loop", "task": {"q": 1},
                        "chat": chat}
                with pytest.raises(RolloutError) as e:
                    async for _ in client.submit_rollout(spec):
                        pass
                assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
                assert (e.value.reason, e.value.field) == (reason, field)
        assert engine.requests == []  # nothing ran
    finally:
        await server.stop(0.1)
