"""The HTTP path's logprobs and turn cuts: processed / raw logprobs over both vLLM request shapes
against the reference forward, streamed turns cut by ``timeout_s`` keeping their partial output,
clear errors for what a server lacks, and the pool's deadline accounting."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web

from rollout.runtime.llm import GenerateRequest
from rollout.runtime.types import InvalidArgument, SamplingParams
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.engine import EngineError
from rollout.server.llm.http_engine import HttpEngine
from rollout.server.llm.http_server import serve
from rollout.server.llm.transformers_engine import TransformersEngine
from tests.fixtures.tiny_model import random_state_dict
from tests.server.llm.conftest import FakeEngine, Served
from tests.server.llm.reference import (
    admissible_logprobs,
    assert_logprobs_match_reference,
    raw_logprobs,
    reference_logprobs,
)
from tests.util import assert_eventually

NUCLEUS = SamplingParams(temperature=0.7, top_p=0.9)



@pytest.mark.parametrize("protocol", ["generate", "completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_processed_logprobs_over_http_match_reference(served: Served, protocol: str,
                                                            stream: bool) -> None:
    client = HttpEngine(served.url, "tiny", protocol=protocol, stream=stream)
    prompt = [1, 40, 41, 42, 43, 44]
    try:
        result = await client.generate(GenerateRequest(prompt, NUCLEUS, 16, "s", seed=7))
    finally:
        await client.close()
    assert result.logprobs_kind == "processed" and result.finish_reason == "length"
    assert len(result.output_ids) == 16
    assert_logprobs_match_reference(served.engine.model, prompt, result, NUCLEUS)
    expected = reference_logprobs(served.engine.model, prompt, result, NUCLEUS)
    assert raw_logprobs(served.engine.model, prompt, result.output_ids) != \
        pytest.approx(expected, abs=1e-2)


async def test_raw_logprobs_per_request_from_llm_serve(served: Served) -> None:
    client = HttpEngine(served.url, "tiny")  # configured for a processed server
    prompt = [1, 50, 51, 52]
    params = SamplingParams(temperature=0.7, top_p=0.9, logprobs_mode="raw")
    try:
        first = await client.generate(GenerateRequest(prompt, params, 12, "r", seed=3))
        # llm-serve says what it returned, so the engine keeps asking per request.
        assert client.mode_announced is True
        second = await client.generate(GenerateRequest(prompt, params, 12, "r2", seed=3))
    finally:
        await client.close()
    assert first.logprobs_kind == "raw" and second.output_ids == first.output_ids
    assert first.logprobs == pytest.approx(
        raw_logprobs(served.engine.model, prompt, first.output_ids), abs=1e-4)


async def test_llm_serve_server_flag_sets_the_default_mode(tiny_dir: Path) -> None:
    """``--logprobs-mode raw_logprobs`` applies to requests that do not say (vLLM clients)."""
    engine = TransformersEngine(tiny_dir, name="raw-srv")
    engine.eos_ids = frozenset()
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(engine, "127.0.0.1", 0, "tiny", ready,
                                     logprobs_mode="raw_logprobs"))
    prompt = [1, 50, 51, 52]
    try:
        port = await asyncio.wait_for(ready, 30)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0.7,
                "top_p": 0.9, "seed": 1, "logprobs": 0, "return_token_ids": True}
        async with aiohttp.ClientSession() as http, \
                http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
            reply = await response.json()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    choice = reply["choices"][0]
    assert reply["logprobs_mode"] == "raw"
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        raw_logprobs(engine.model, prompt, choice["token_ids"]), abs=1e-4)


@pytest.mark.parametrize("protocol", ["generate", "completions"])
async def test_timeout_streams_and_keeps_partial_output(served: Served, protocol: str) -> None:
    """A turn cut by its deadline keeps the streamed tokens, each with its own logprob.

    Two checks on the logprobs. Exact: the server's model is hooked, and each streamed logprob
    must equal float64 top-p processing of the very logits that step sampled from (the turn
    decodes alone, one forward per token); a logprob shifted across a chunk or the cut, or taken
    from other logits, fails it. Independent: an uncached reference forward, whose float32
    rounding differs from the cached decode; a turn cut after hundreds of tokens meets that
    noise, see :mod:`tests.server.llm.reference` for its measured size and the allowance.
    """
    client = HttpEngine(served.url, "tiny", protocol=protocol)
    prompt = [1, 60, 61, 62]
    sampled_from: list[torch.Tensor] = []
    hook = served.engine.model.register_forward_hook(
        lambda _module, _args, out: sampled_from.append(out.logits[:, -1, :].detach().clone()))
    try:
        result = await asyncio.wait_for(client.generate(GenerateRequest(
            prompt, NUCLEUS, 1500, "dl", seed=11, timeout_s=0.8)), 30)
        assert result.finish_reason == "deadline"
        assert 0 < len(result.output_ids) < 1500
        await assert_eventually(lambda: served.engine.load == 0)  # the disconnect aborted it
        hook.remove()
        steps = torch.cat(sampled_from)  # one row per forward: the prefill, then each decode
        assert steps.shape[0] >= len(result.output_ids)
        for index, (token, logprob) in enumerate(zip(result.output_ids, result.logprobs,
                                                     strict=True)):
            # Same logits: only float32 vs float64 summation separates the two cuts.
            own = admissible_logprobs(steps[index], token, NUCLEUS.temperature, NUCLEUS.top_k,
                                      NUCLEUS.top_p, mass_slack=1e-6)
            assert any(abs(logprob - v) <= 1e-5 for v in own), (index, token, logprob, own)
        assert_logprobs_match_reference(served.engine.model, prompt, result, NUCLEUS)
        # Tokens and logprobs are those an uncut turn with the same seed produces.
        whole = await client.generate(GenerateRequest(prompt, NUCLEUS, len(result.output_ids),
                                                      "whole", seed=11))
        assert whole.output_ids == result.output_ids
        assert whole.logprobs == pytest.approx(result.logprobs, abs=1e-6)
    finally:
        hook.remove()
        await client.close()


async def test_streamed_abort_keeps_partial_output(served: Served) -> None:
    client = HttpEngine(served.url, "tiny", stream=True)
    try:
        turn = asyncio.create_task(client.generate(GenerateRequest([1, 2, 3], NUCLEUS, 1500,
                                                                   "ab", seed=1)))
        await assert_eventually(lambda: served.engine.decode_steps > 3)
        await client.abort("ab")
        result = await asyncio.wait_for(turn, 10)
        assert result.finish_reason == "abort" and len(result.output_ids) > 0
        assert len(result.logprobs) == len(result.output_ids)
        await assert_eventually(lambda: served.engine.load == 0)
    finally:
        await client.close()


@pytest.mark.timeout(60)
async def test_swap_cut_over_http_is_preempted(served: Served, tiny_dir: Path) -> None:
    """A server-side swap whose drain times out cuts the turn; the client hears "preempted"."""
    served.engine.drain_timeout_s = 0.3
    client = HttpEngine(served.url, "tiny")
    try:
        turn = asyncio.create_task(client.generate(GenerateRequest([1, 2, 3], NUCLEUS, 1500,
                                                                   "sw", seed=2)))
        await assert_eventually(lambda: served.engine.decode_steps > 3)
        await served.engine.update_weights(random_state_dict(tiny_dir, seed=4), 1)
        result = await asyncio.wait_for(turn, 30)
    finally:
        await client.close()
    assert result.finish_reason == "preempted" and result.policy_version == 0
    assert 0 < len(result.output_ids) < 1500


# ----------------------------------------------------------------- a server like real vLLM
class VllmShaped:
    """Answers like a vLLM server started *without* ``--enable-scale-out`` (403 on
    /inference/v1/generate, its message) and with processed logprobs: replies carry no
    ``logprobs_mode``. Only the reply shapes matter here; the real server has its own test."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def generate(self, request: web.Request) -> web.Response:
        return web.json_response({"error": {
            "message": "Scale-out endpoints are disabled. Restart vllm serve with "
                       "--enable-scale-out to enable them.", "type": "PermissionDeniedError",
            "code": 403}}, status=403)

    async def completions(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        return web.json_response({"choices": [{
            "index": 0, "text": "", "finish_reason": "length", "token_ids": [5, 6],
            "logprobs": {"tokens": ["token_id:5", "token_id:6"],
                         "token_logprobs": [-0.5, -0.25]}}]})


@pytest.fixture
async def vllm_shaped() -> AsyncIterator[tuple[str, VllmShaped]]:
    fake = VllmShaped()
    app = web.Application()
    app.add_routes([web.post("/inference/v1/generate", fake.generate),
                    web.post("/v1/completions", fake.completions)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", fake
    await runner.cleanup()


async def test_missing_scale_out_flag_is_named(vllm_shaped: tuple[str, VllmShaped]) -> None:
    url, _ = vllm_shaped
    client = HttpEngine(url, "m")
    try:
        with pytest.raises(EngineError, match="--enable-scale-out"):
            await client.generate(GenerateRequest([1, 2], NUCLEUS, 2, "x"))
    finally:
        await client.close()


async def test_vllm_server_mode_is_fixed_per_server(vllm_shaped: tuple[str, VllmShaped]) -> None:
    url, fake = vllm_shaped
    client = HttpEngine(url, "m", protocol="completions", logprobs_mode="processed")
    raw = SamplingParams(temperature=0.7, logprobs_mode="raw")
    try:
        with pytest.raises(InvalidArgument, match="--logprobs-mode raw_logprobs"):
            await client.generate(GenerateRequest([1, 2], raw, 2, "x"))
        assert client.mode_announced is False  # vLLM does not say; the first reply told us
        result = await client.generate(GenerateRequest([1, 2], NUCLEUS, 2, "y"))
        assert result.logprobs_kind == "processed" and result.output_ids == [5, 6]
        with pytest.raises(InvalidArgument, match="raw_logprobs"):
            await client.generate(GenerateRequest([1, 2], raw, 2, "z"))
        assert len(fake.bodies) == 2  # the last one was refused before it was sent
        # A non-streaming server answer to a deadline turn is used as is.
        cut = await client.generate(GenerateRequest([1, 2], NUCLEUS, 2, "t", timeout_s=5))
        assert cut.output_ids == [5, 6] and fake.bodies[-1]["stream"] is True
    finally:
        await client.close()


# ----------------------------------------------------------------- the pool
async def test_pool_passes_the_remaining_time_to_the_backend() -> None:
    engine = FakeEngine("a")
    pool = BackendPool([engine], health_interval_s=0)
    try:
        await pool.generate(GenerateRequest([1, 2], NUCLEUS, 4, "s", timeout_s=5.0))
        await pool.generate(GenerateRequest([1, 2], NUCLEUS, 4, "t"))
    finally:
        await pool.close()
    assert 0 < engine.served[0].timeout_s <= 5.0  # type: ignore[operator]
    assert engine.served[1].timeout_s is None


@pytest.mark.timeout(10)
async def test_pool_wait_for_a_backend_never_outlasts_the_turn() -> None:
    """With every backend down the pool would wait 60 s; the turn's 0.3 s wins."""
    engine = FakeEngine("a")
    engine.alive = False
    pool = BackendPool([engine], health_interval_s=0, wait_for_backend_s=60)
    pool.get("a").healthy = False
    try:
        result = await pool.generate(GenerateRequest([1, 2], NUCLEUS, 4, "s", timeout_s=0.3))
    finally:
        await pool.close()
    assert result.finish_reason == "deadline" and result.output_ids == []


@pytest.mark.parametrize("protocol", ["generate", "completions"])
async def test_generate_stream_gives_pieces_before_the_turn_ends(served: Served,
                                                                 protocol: str) -> None:
    """The first piece arrives while the server is still decoding the turn; joined, the
    pieces are the ids and logprobs of the same turn generated without streaming."""
    client = HttpEngine(served.url, "tiny", protocol=protocol)
    try:
        pieces = []
        busy_at_first: bool | None = None
        async with contextlib.aclosing(client.generate_stream(GenerateRequest(
                [1, 60, 61, 62], NUCLEUS, 200, "st", seed=5))) as stream:
            async for piece in stream:
                if busy_at_first is None:
                    busy_at_first = served.engine.load > 0
                pieces.append(piece)
        assert busy_at_first, "the first piece came after the server finished the turn"
        assert len(pieces) > 1
        assert all(p.finish_reason == "" for p in pieces[:-1]) and pieces[-1].finish_reason
        whole = await client.generate(GenerateRequest([1, 60, 61, 62], NUCLEUS, 200, "wh",
                                                      seed=5))
        assert [t for p in pieces for t in p.output_ids] == whole.output_ids
        assert [v for p in pieces for v in p.logprobs] == pytest.approx(whole.logprobs,
                                                                       abs=1e-6)
        assert pieces[-1].finish_reason == whole.finish_reason
    finally:
        await client.close()


async def test_a_stream_whose_consumer_is_cancelled_leaves_nothing_pending(
        served: Served) -> None:
    """A harness that goes away cancels the task reading the stream while it waits for the
    next piece: the turn's request ends at the server and no waiter of the stream is left
    pending (asyncio's "Task was destroyed but it is pending" at the loop's end)."""
    client = HttpEngine(served.url, "tiny", protocol="generate")

    async def consume() -> None:
        async with contextlib.aclosing(client.generate_stream(GenerateRequest(
                [1, 60, 61, 62], NUCLEUS, 400, "gone", seed=5))) as stream:
            async for _ in stream:
                pass

    try:
        reader = asyncio.ensure_future(consume())
        await assert_eventually(lambda: served.engine.load > 0)
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        await assert_eventually(lambda: served.engine.load == 0)
        waiting = [t for t in asyncio.all_tasks()
                   if not t.done() and "Event.wait" in repr(t.get_coro())]
        assert waiting == []
    finally:
        await client.close()
