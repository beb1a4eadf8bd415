"""``top_logprobs`` through the gateway with a real (tiny) model, in process or behind the vLLM
HTTP backend (``rollout llm-serve`` answering in vLLM's shapes): OpenAI chat and Responses answer
each sampled token's ``k`` most likely tokens in their own shape, texts from the tokenizer and
values equal to the log-softmax of the model's logits computed here; the trajectory keeps only
the sampled tokens' logprobs; an out-of-range ``top_logprobs`` is a 400 in the API's shape."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout.runtime.gateway import GatewayLease
from rollout.runtime.types import JobSpec, Limits, SamplingParams
from rollout.server.gateway import Gateway
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.http_engine import HttpEngine
from rollout.server.llm.transformers_engine import TransformersEngine
from tests.fixtures.tiny_model import tiny_model_dir
from tests.server.gateway.conftest import openai_client
from tests.server.llm.conftest import Served, start_server
from tests.server.llm.reference import full_forward_logits

pytestmark = pytest.mark.timeout(120)


@dataclass
class TinyRig:
    gateway: Gateway
    engine: TransformersEngine
    lease: GatewayLease


@pytest.fixture(params=["in-process", "vllm-http-generate", "vllm-http-completions"])
async def rig(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[TinyRig]:
    """The gateway over the in-process engine, or over the vLLM HTTP backend (``HttpEngine``)
    talking to ``rollout llm-serve`` in vLLM's two request shapes; ``engine`` is the model that
    generated either way (the reference forward runs on it)."""
    served: Served | None = None
    backend: Any
    if request.param == "in-process":
        engine = backend = TransformersEngine(tiny_model_dir(), name="tiny")
        engine.eos_ids = frozenset()  # random weights: every answer runs to max tokens
    else:
        served = await start_server(tiny_model_dir(), "tiny")  # its turns ignore EOS too
        engine = served.engine
        backend = HttpEngine(served.url, "tiny", protocol=request.param.rsplit("-", 1)[1],
                             tokenizer=engine.tokenizer)
    pool = BackendPool([backend], health_interval_s=0)
    gateway = await Gateway(tmp_path / "state").start()
    lease = await gateway.open(JobSpec(
        job_id="job", environment="harness", task={},
        sampling=SamplingParams(temperature=1.0, seed=3, max_tokens_per_turn=10),
        limits=Limits(max_turns=8)), pool)
    yield TinyRig(gateway, engine, lease)
    await gateway.stop()
    with contextlib.suppress(Exception):
        await pool.close()
    if served is not None:
        await served.stop()


async def post(lease: GatewayLease, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    import httpx2

    transport = httpx2.AsyncHTTPTransport(uds=lease.socket_path)
    async with httpx2.AsyncClient(transport=transport, timeout=60) as http:
        reply = await http.post(f"http://gateway{path}", content=json.dumps(body), headers={
            "Authorization": f"Bearer {lease.api_key}", "Content-Type": "application/json"})
    return reply.status_code, reply.json()


def assert_top_is_the_models(rig: TinyRig, entries: list[dict[str, Any]], k: int,
                             turn_index: int = 0) -> None:
    """The entries of one answer against the trajectory's turn and the model's own ``k`` best
    at each step (log_softmax of logits from an uncached forward done here)."""
    turn = rig.gateway.capture(rig.lease).turns[turn_index]
    logits = full_forward_logits(rig.engine.model, turn.prompt_ids, turn.output_ids)
    best = torch.topk(torch.log_softmax(logits, dim=-1), k)
    tok = rig.engine.tokenizer
    assert len(entries) == len(turn.output_ids)  # no end-of-turn token: eos is off
    sampled_in_top = 0
    for entry, token, logprob, ids, values in zip(
            entries, turn.output_ids, turn.output_logprobs, best.indices.tolist(),
            best.values.tolist(), strict=True):
        assert entry["token"] == tok.decode([token])
        assert entry["logprob"] == pytest.approx(logprob)  # the trajectory's own value
        top = entry["top_logprobs"]
        assert len(top) == k
        assert [t["token"] for t in top] == [tok.decode([i]) for i in ids]
        assert [t["logprob"] for t in top] == pytest.approx(values, abs=1e-4)
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert all(t["bytes"] == list(t["token"].encode()) for t in top)
        if token in ids:
            sampled_in_top += 1
            assert top[ids.index(token)]["logprob"] == pytest.approx(logprob, abs=1e-6)
    assert sampled_in_top, "no sampled token ranked in the top k: that check never ran"


async def test_chat_answers_the_models_top_logprobs(rig: TinyRig) -> None:
    client = openai_client(rig.lease)
    answer = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "list the files"}], logprobs=True,
        top_logprobs=3)
    content = [c.model_dump() for c in answer.choices[0].logprobs.content]
    assert_top_is_the_models(rig, content, 3)
    turn = rig.gateway.capture(rig.lease).turns[0]
    # The trajectory records the sampled tokens' logprobs only, as before.
    assert len(turn.output_logprobs) == len(turn.output_ids)
    assert "top_logprobs" not in vars(turn)


async def test_the_cap_itself_is_served(rig: TinyRig) -> None:
    """``top_logprobs: 20`` (the bound; a vLLM backend is asked for 21) is the model's 20 best."""
    client = openai_client(rig.lease)
    answer = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True,
        top_logprobs=20)
    assert_top_is_the_models(rig, [c.model_dump() for c in answer.choices[0].logprobs.content],
                             20)


async def test_streamed_chat_carries_them_too(rig: TinyRig) -> None:
    client = openai_client(rig.lease)
    chunks = [c async for c in await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "cat file.txt"}], logprobs=True,
        top_logprobs=2, stream=True)]
    content = [e.model_dump() for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content or []]
    assert_top_is_the_models(rig, content, 2)


async def test_responses_answers_them_in_its_shape(rig: TinyRig) -> None:
    status, body = await post(rig.lease, "/v1/responses", {
        "model": "m", "input": "what is two plus two?", "top_logprobs": 4,
        "include": ["message.output_text.logprobs"]})
    assert status == 200, body
    part = next(item for item in body["output"] if item["type"] == "message")["content"][0]
    assert_top_is_the_models(rig, part["logprobs"], 4)
    status, plain = await post(rig.lease, "/v1/responses", {"model": "m", "input": "hello"})
    assert status == 200
    assert all(not c["logprobs"] for item in plain["output"] if item["type"] == "message"
               for c in item["content"])


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": 21}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": -1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": "3"}),
    ("/v1/responses", {"input": "hi", "top_logprobs": 21}),
    ("/v1/responses", {"input": "hi", "top_logprobs": 2.5}),
])
async def test_out_of_range_top_logprobs_is_a_400(rig: TinyRig, path: str,
                                                  body: dict[str, Any]) -> None:
    status, reply = await post(rig.lease, path, {"model": "m", **body})
    assert status == 400
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "top_logprobs"
    assert "[0, 20]" in error["message"]
    assert rig.gateway.capture(rig.lease).turns == []
