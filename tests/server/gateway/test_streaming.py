"""Real token streaming: a streamed answer's text leaves the gateway while its turn is still
being generated, in all three dialects, and the committed turn is the one a non-streamed
request gets.

The backend here holds every turn after its first tokens until the test opens a gate, so
"first token before the last" is an ordering the test observes (a delta arrived while the
backend still held the turn), never a timing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import pytest

from rollout.runtime.gateway import GatewayLease
from rollout.runtime.llm import GenerateRequest, GenerateResult
from rollout.runtime.types import JobSpec, Limits, SamplingParams
from rollout.server.gateway import Gateway
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.engine import Engine
from rollout.server.llm.scripted import ScriptedEngine
from tests.server.gateway.conftest import anthropic_client, openai_client
from tests.util import assert_eventually, scaled

pytestmark = pytest.mark.timeout(60)

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}]
REPLY = "Streaming works: here is the whole answer, token by token, to the very end."
CALL = ("I will list the files.\n<tool_call>\n"
        + json.dumps({"name": "bash", "arguments": {"command": "ls -la"}}) + "\n</tool_call>")
TASK = [{"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "What files are here?"}]


class HeldEngine(Engine):
    """TEST DOUBLE: streams the first ``split`` tokens of the session's reply one by one,
    then holds the turn until ``gate`` opens, then sends the rest."""

    name = "held"

    def __init__(self, tok: Any, eot: int, split: int = 6) -> None:
        self.tok, self.eot, self.split = tok, eot, split
        self.replies: dict[str, str] = {}
        self.gate = asyncio.Event()
        self.held = False
        self.closed_early = 0
        self.finished = 0

    @property
    def policy_version(self) -> int:
        return 0

    @property
    def tokenizer(self) -> Any:
        return self.tok

    def ids(self, session_id: str) -> list[int]:
        return [*self.tok.encode(self.replies[session_id], add_special_tokens=False), self.eot]

    def logprobs(self, ids: list[int]) -> list[float]:
        return [-0.01 * (k + 1) for k in range(len(ids))]

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        await self.gate.wait()
        ids = self.ids(request.session_id)
        self.finished += 1
        return GenerateResult(ids, self.logprobs(ids), "stop", 0, self.name)

    async def generate_stream(self, request: GenerateRequest,
                              ) -> AsyncGenerator[GenerateResult, None]:
        ids = self.ids(request.session_id)
        lps = self.logprobs(ids)
        done = False
        try:
            for k in range(self.split):
                yield GenerateResult([ids[k]], [lps[k]], "", 0, self.name)
            self.held = True
            await self.gate.wait()
            self.held = False
            done = True
            self.finished += 1
            yield GenerateResult(ids[self.split:], lps[self.split:], "stop", 0, self.name)
        finally:
            if not done:
                self.closed_early += 1
            self.held = False

    async def health(self) -> bool:
        return True


@dataclass
class Held:
    gateway: Gateway
    engine: HeldEngine
    pool: BackendPool

    async def open(self, job_id: str, reply: str) -> GatewayLease:
        self.engine.replies[job_id] = reply
        return await self.gateway.open(JobSpec(job_id=job_id, environment="harness", task={},
                                               sampling=SamplingParams(seed=7),
                                               limits=Limits(max_turns=8)), self.pool)


@pytest.fixture
async def held(tok: Any, tmp_path: Any) -> AsyncGenerator[Held, None]:
    engine = HeldEngine(tok, tok.convert_tokens_to_ids("<|im_end|>"))
    pool = BackendPool([engine], health_interval_s=0)
    gateway = await Gateway(tmp_path / "state").start()
    yield Held(gateway, engine, pool)
    await gateway.stop()
    await pool.close()


async def stream_chat(lease: GatewayLease, engine: HeldEngine, tools: bool) -> dict[str, Any]:
    client = openai_client(lease)
    extra: dict[str, Any] = {"tools": TOOLS} if tools else {}
    stream = await client.chat.completions.create(model="m", messages=TASK, stream=True,
                                                  **extra)
    out: dict[str, Any] = {"text": "", "held_at_first": None, "calls": []}
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                if out["held_at_first"] is None:
                    out["held_at_first"] = engine.held
                    engine.gate.set()
                out["text"] += choice.delta.content
            for d in choice.delta.tool_calls or []:
                if d.function is not None and d.function.name:
                    out["calls"].append(d.function.name)
    return out


async def stream_responses(lease: GatewayLease, engine: HeldEngine,
                           tools: bool) -> dict[str, Any]:
    client = openai_client(lease)
    extra: dict[str, Any] = {"tools": [{"type": "function", **TOOLS[0]["function"]}]} \
        if tools else {}
    stream = await client.responses.create(model="m", input=TASK[1]["content"],
                                           instructions=TASK[0]["content"], stream=True, **extra)
    out: dict[str, Any] = {"text": "", "held_at_first": None, "calls": []}
    async for event in stream:
        if event.type == "response.output_text.delta":
            if out["held_at_first"] is None:
                out["held_at_first"] = engine.held
                engine.gate.set()
            out["text"] += event.delta
        elif event.type == "response.output_item.done" and event.item.type == "function_call":
            out["calls"].append(event.item.name)
        elif event.type == "response.completed":
            message = [i for i in event.response.output if i.type == "message"]
            out["final"] = message[0].content[0].text if message else ""
    return out


async def stream_messages(lease: GatewayLease, engine: HeldEngine,
                          tools: bool) -> dict[str, Any]:
    client = anthropic_client(lease)
    extra: dict[str, Any] = {"tools": [{"name": "bash", "description": "Run a shell command.",
                                        "input_schema": TOOLS[0]["function"]["parameters"]}]} \
        if tools else {}
    stream = await client.messages.create(model="m", max_tokens=256, system=TASK[0]["content"],
                                          messages=[TASK[1]], stream=True, **extra)
    out: dict[str, Any] = {"text": "", "held_at_first": None, "calls": []}
    async for event in stream:
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            if out["held_at_first"] is None:
                out["held_at_first"] = engine.held
                engine.gate.set()
            out["text"] += event.delta.text
        elif event.type == "content_block_start" and event.content_block.type == "tool_use":
            out["calls"].append(event.content_block.name)
    return out


DIALECTS = {"chat": stream_chat, "responses": stream_responses, "messages": stream_messages}


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool-call"])
@pytest.mark.parametrize("dialect", list(DIALECTS))
async def test_first_text_leaves_while_the_backend_still_holds_the_turn(
        held: Held, dialect: str, tools: bool) -> None:
    gateway, engine = held.gateway, held.engine
    reply = CALL if tools else REPLY
    job_id = f"job-{dialect}-{tools}"
    lease = await held.open(job_id, reply)
    # Only so a gateway that sends nothing before the end fails instead of hanging.
    watchdog = asyncio.get_running_loop().call_later(scaled(30.0), engine.gate.set)
    got = await DIALECTS[dialect](lease, engine, tools)
    watchdog.cancel()
    assert got["held_at_first"] is True, "the first text delta came after the turn ended"
    expected = "I will list the files." if tools else REPLY
    assert got["text"] == expected  # no call markup streamed, nothing lost or repeated
    assert got.get("final", expected) == expected
    assert got["calls"] == (["bash"] if tools else [])
    capture = await gateway.close(lease)
    assert [t.output_ids for t in capture.turns] == [engine.ids(job_id)]


async def test_a_streamed_turn_is_the_turn_a_plain_request_commits(
        held: Held) -> None:
    gateway, engine = held.gateway, held.engine
    engine.gate.set()
    streamed = await held.open("job-streamed", REPLY)
    plain = await held.open("job-plain", REPLY)
    await stream_chat(streamed, engine, tools=False)
    answer = await openai_client(plain).chat.completions.create(model="m", messages=TASK)
    assert answer.choices[0].message.content == REPLY
    a = (await gateway.close(streamed)).turns
    b = (await gateway.close(plain)).turns
    assert [(t.prompt_ids, t.output_ids, t.output_logprobs, t.finish_reason) for t in a] == [
        (t.prompt_ids, t.output_ids, t.output_logprobs, t.finish_reason) for t in b]


async def test_a_client_that_leaves_mid_stream_leaves_no_turn(
        held: Held) -> None:
    gateway, engine = held.gateway, held.engine
    lease = await held.open("job-leaves", REPLY)
    client = openai_client(lease)
    stream = await client.chat.completions.create(model="m", messages=TASK, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    assert engine.held
    await stream.close()
    await assert_eventually(lambda: engine.closed_early == 1,
                            message="the backend's stream was not stopped")
    capture = await gateway.close(lease)
    assert capture.turns == [] and engine.finished == 0


async def test_the_scripted_engine_streams_token_by_token(tok: Any) -> None:
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine(tok, {"s": [REPLY], "t": [REPLY]}, end_of_turn_id=eot,
                            token_latency_s=0.001)
    pool = BackendPool([engine], health_interval_s=0)
    request = GenerateRequest(prompt_ids=[1, 2], sampling=SamplingParams(), max_tokens=512,
                              session_id="s")
    pieces = [p async for p in pool.generate_stream(request)]
    whole = await pool.generate(GenerateRequest(prompt_ids=[1, 2], sampling=SamplingParams(),
                                                max_tokens=512, session_id="t"))
    assert all(len(p.output_ids) == 1 for p in pieces) and len(pieces) > 1
    assert [p.finish_reason for p in pieces] == [""] * (len(pieces) - 1) + ["stop"]
    assert [i for p in pieces for i in p.output_ids] == whole.output_ids
    await pool.close()


async def test_a_backend_that_fails_before_its_first_piece_is_retried_elsewhere(
        tok: Any) -> None:
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    bad = ScriptedEngine(tok, {}, name="bad", end_of_turn_id=eot, token_latency_s=0.001)
    good = ScriptedEngine(tok, {"s": [REPLY]}, name="good", end_of_turn_id=eot,
                          token_latency_s=0.001)
    pool = BackendPool([bad, good], health_interval_s=0)  # equal load: "bad" is tried first
    request = GenerateRequest(prompt_ids=[1, 2], sampling=SamplingParams(), max_tokens=512,
                              session_id="s")
    pieces = [p async for p in pool.generate_stream(request)]
    assert [i for p in pieces for i in p.output_ids] == [
        *tok.encode(REPLY, add_special_tokens=False), eot]
    assert not pool.get("bad").healthy and pool.get("good").in_flight == 0
    await pool.close()
