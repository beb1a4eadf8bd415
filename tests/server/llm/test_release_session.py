"""``end_session`` through the pool reaches ``rollout llm-serve`` and frees the session's KV;
a server without the release route (real vLLM) is tolerated and asked only once."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from rollout.runtime.llm import GenerateRequest
from rollout.runtime.types import SamplingParams
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.http_engine import RELEASE_PATH, HttpEngine
from rollout.server.llm.transformers_engine import TransformersEngine
from tests.server.llm.conftest import start_server
from tests.util import assert_eventually

GREEDY = SamplingParams(temperature=0.0)


async def test_end_session_over_http_drops_the_servers_kv(tiny_dir: Path) -> None:
    served = await start_server(tiny_dir, "srv")
    client = HttpEngine(served.url, "tiny", name="a")
    pool = BackendPool([client], health_interval_s=0)
    await pool.start()
    try:
        prompt = [1, 40, 41, 42]
        first = await pool.generate(GenerateRequest(prompt, GREEDY, 4, "traj"))
        await pool.generate(GenerateRequest(prompt + first.output_ids + [50], GREEDY, 4, "traj"))
        await pool.generate(GenerateRequest([1, 60, 61], GREEDY, 4, "other"))
        kv = served.engine.kv_store
        assert "traj" in kv and "other" in kv
        await pool.end_session("traj")
        assert "traj" not in kv and "other" in kv  # only the ended session is dropped
        assert client.release_supported is True
    finally:
        await pool.close()
        await served.stop()


async def test_release_on_a_server_without_the_route_is_silent_and_remembered() -> None:
    hits: list[str] = []

    async def generate(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"token_ids": [7], "finish_reason": "stop",
                                               "logprobs": {"content": [{"logprob": -0.5}]}}]})

    async def not_found(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(status=404)

    app = web.Application()
    app.add_routes([web.post("/inference/v1/generate", generate),  # like vLLM: no release
                    web.post("/{tail:.*}", not_found)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = HttpEngine(f"http://127.0.0.1:{port}", "m", name="vllm")
    pool = BackendPool([client], health_interval_s=0)
    await pool.start()
    try:
        for i in range(3):
            result = await pool.generate(GenerateRequest([1, 2], GREEDY, 1, f"s{i}"))
            assert result.output_ids == [7]
            await pool.end_session(f"s{i}")
        await client.release_session("direct")  # no exception from the 404 either
        assert client.release_supported is False
        assert hits.count(RELEASE_PATH) == 1  # asked once, then remembered
    finally:
        await pool.close()
        await runner.cleanup()


async def test_release_during_a_turn_keeps_its_kv_out_of_the_store(tiny_dir: Path) -> None:
    """A cancelled job aborts its turn then ends the session before the turn has retired."""
    engine = TransformersEngine(tiny_dir, name="tiny")
    engine.eos_ids = frozenset()
    try:
        turn = asyncio.create_task(engine.generate(GenerateRequest([1, 2, 3], GREEDY, 1500, "c")))
        await assert_eventually(lambda: engine.decode_steps > 2)
        await engine.release_session("c")
        await engine.abort("c")
        assert (await turn).finish_reason == "abort"
        assert "c" not in engine.kv_store
        await engine.generate(GenerateRequest([1, 2, 3], GREEDY, 2, "d"))  # others still kept
        assert "d" in engine.kv_store
    finally:
        await engine.close()
