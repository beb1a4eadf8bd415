"""A harness-style environment through a real server: JobContext.gateway is the server's
gateway, the trajectory a trainer receives carries the captured ids and segments, and a
cancelled job's lease is revoked with its generation aborted."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

from rollout.client.aio import RolloutClient
from rollout.client.trajectory import flatten_segments
from rollout.runtime.agent_loop import SEED_KEY, TURNS_KEY
from rollout.runtime.gateway import SEGMENTS_KEY, GatewayLease
from rollout.runtime.handler import AgentHandler, HandlerRegistry, JobContext, RunOutcome
from rollout.runtime.types import Reward, TerminationReason
from rollout.server.app import Server
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.scripted import ScriptedEngine
from rollout.v1 import trajectory_pb2
from tests.client.conftest import make_config
from tests.server.gateway.conftest import openai_client
from tests.server.gateway.test_chat_completions import TASK, TOOLS, assistant_echo, call
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(90)

REPLIES = ["One.\n" + call("bash", command="echo 1"), "Two.\n" + call("bash", command="echo 2"),
           "Finished."]


class InProcessHarness(AgentHandler):
    """Plays an agent harness: an OpenAI client that compacts its history before request 3.
    With ``hang``, it waits on a slow turn and never closes its lease itself."""

    name = "fake-harness"

    def __init__(self, hang: bool = False) -> None:
        self.hang = hang
        self.leases: list[GatewayLease] = []

    async def init(self, ctx: JobContext) -> None:
        assert ctx.gateway is not None and ctx.llm is not None

    async def run(self, ctx: JobContext) -> RunOutcome:
        assert ctx.gateway is not None and ctx.llm is not None
        lease = await ctx.gateway.open(ctx.spec, ctx.llm)
        self.leases.append(lease)
        live = ctx.gateway.capture(lease)
        ctx.state[TURNS_KEY], ctx.state[SEGMENTS_KEY] = live.turns, live.segments
        client = openai_client(lease)
        if self.hang:
            await client.chat.completions.create(model="m", messages=TASK)
        try:
            a1 = (await client.chat.completions.create(model="m", messages=TASK, tools=TOOLS)
                  ).choices[0].message
            h1 = [*TASK, assistant_echo(a1),
                  {"role": "tool", "tool_call_id": a1.tool_calls[0].id, "content": "1"}]
            a2 = (await client.chat.completions.create(model="m", messages=h1, tools=TOOLS)
                  ).choices[0].message
            h2 = [*TASK, assistant_echo(a2),
                  {"role": "tool", "tool_call_id": a2.tool_calls[0].id, "content": "2"}]
            await client.chat.completions.create(model="m", messages=h2, tools=TOOLS)
        finally:
            capture = await ctx.gateway.close(lease)
        ctx.state[SEED_KEY] = capture.seed
        return RunOutcome(turns=capture.turns, segments=capture.segments,
                          termination=TerminationReason.NO_TOOL_CALL)

    async def eval(self, ctx: JobContext) -> Reward:
        return Reward(0.5)


async def serve(tmp_path: Path, handler: AgentHandler, engine: ScriptedEngine
                ) -> tuple[Server, BackendPool]:
    registry = HandlerRegistry()
    registry.register("fake-harness", handler)
    pool = BackendPool([engine], health_interval_s=0)
    server = await Server(make_config(tmp_path / "state"), registry=registry, llm=pool).start()
    return server, pool


async def test_a_harness_job_delivers_exact_segments_to_the_trainer(tmp_path: Path,
                                                                    tok: Any) -> None:
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine(tok, {"h1": REPLIES}, end_of_turn_id=eot)
    server, pool = await serve(tmp_path, InProcessHarness(), engine)
    try:
        async with RolloutClient(f"127.0.0.1:{server.port}") as client, \
                client.session("trainer") as session:
            await session.submit([{"job_id": "h1", "environment": "fake-harness", "task": {},
                                   "sampling": {"seed": 11}}])
            async with asyncio.timeout(60):
                async for ready in session.trajectories():
                    traj: trajectory_pb2.Trajectory = ready.trajectory
                    await session.ack([ready.delivery_id])
                    break
    finally:
        await server.stop(0.1)
        await pool.close()
    assert [(s.first_turn, s.reason) for s in traj.segments] == [
        (0, trajectory_pb2.Segment.REASON_FIRST),
        (2, trajectory_pb2.Segment.REASON_HISTORY_REWRITTEN)]
    assert traj.seed == 11
    flats = flatten_segments(traj)
    scripted = [[*tok.encode(r, add_special_tokens=False), eot] for r in REPLIES]
    assert [[t for t, m in zip(f.token_ids, f.loss_mask, strict=True) if m] for f in flats] == [
        scripted[0] + scripted[1], scripted[2]]
    prompts = [list(r.prompt_ids) for r in engine.requests]
    assert flats[0].token_ids == prompts[1] + scripted[1]
    assert flats[1].token_ids == prompts[2] + scripted[2]
    assert [f.reward for f in flats] == [0.5, 0.5]
    assert [r.seed for r in engine.requests] == [11, 12, 13]


async def test_cancelling_a_job_revokes_its_lease_and_aborts_the_turn(tmp_path: Path,
                                                                      tok: Any) -> None:
    engine = ScriptedEngine(tok, {"h2": ["slow"]}, latency_s=120.0)
    handler = InProcessHarness(hang=True)
    server, pool = await serve(tmp_path, handler, engine)
    try:
        async with RolloutClient(f"127.0.0.1:{server.port}") as client, \
                client.session("trainer") as session:
            await session.submit([{"job_id": "h2", "environment": "fake-harness",
                                   "task": {}}])
            await assert_eventually(lambda: engine.in_flight("h2"), timeout=30)
            await session.cancel(job_ids=["h2"])
            await assert_eventually(lambda: not engine.in_flight("h2"), timeout=30)
            lease = handler.leases[0]
            await assert_eventually(lambda: not os.path.exists(lease.socket_path), timeout=30)
            import openai

            with pytest.raises((openai.AuthenticationError, openai.APIConnectionError)):
                await openai_client(lease).chat.completions.create(model="m", messages=TASK)
    finally:
        with contextlib.suppress(Exception):
            await server.stop(0.1)
        await pool.close()
