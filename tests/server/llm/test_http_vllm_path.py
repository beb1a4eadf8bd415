"""The vLLM HTTP path end to end: HttpEngine (vLLM's request shapes) against ``llm-serve``."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from rollout.runtime.llm import GenerateRequest, LLMUnavailable
from rollout.runtime.types import InvalidArgument, SamplingParams
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.engine import EngineError
from rollout.server.llm.http_engine import HttpEngine
from tests.fixtures.tiny_model import random_state_dict
from tests.server.llm.conftest import Served, start_server
from tests.util import assert_eventually

GREEDY = SamplingParams(temperature=0.0)
ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("protocol", ["generate", "completions"])
async def test_tokens_in_tokens_out_matches_in_process(served: Served, protocol: str) -> None:
    client = HttpEngine(served.url, "tiny", name="vllm-a", protocol=protocol)
    try:
        assert await client.health()
        prompt = [1, 40, 41, 42, 43, 44]
        remote = await client.generate(GenerateRequest(prompt, GREEDY, 9, "sess"))
        local = await served.engine.generate(GenerateRequest(prompt, GREEDY, 9, "local"))
        assert remote.output_ids == local.output_ids
        assert remote.logprobs == pytest.approx(local.logprobs, abs=1e-5)
        assert remote.finish_reason == "length" and remote.backend == "vllm-a"
        # The session header gives the server's sticky KV: turn 2 prefills only new tokens.
        turn2 = prompt + remote.output_ids + [50, 51]
        await client.generate(GenerateRequest(turn2, GREEDY, 3, "sess"))
        stats = [s for s in served.engine.turn_stats if s.session_id == "sess"][-1]
        assert stats.cached_tokens == len(prompt) + 8
    finally:
        await client.close()


async def test_seeded_sampling_reproducible_over_http(served: Served) -> None:
    client = HttpEngine(served.url, "tiny")
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
    try:
        a = await client.generate(GenerateRequest([1, 60, 61], params, 12, "a"))
        b = await client.generate(GenerateRequest([1, 60, 61], params, 12, "b"))
        assert a.output_ids == b.output_ids
    finally:
        await client.close()


async def test_bad_values_rejected_client_and_server_side(served: Served) -> None:
    client = HttpEngine(served.url, "tiny")
    try:
        with pytest.raises(InvalidArgument):
            await client.generate(GenerateRequest([1, 2], SamplingParams(top_p=2.0), 4, "x"))
        async with aiohttp.ClientSession() as http:
            body = {"model": "tiny", "token_ids": [1, 2],
                    "sampling_params": {"temperature": -3, "max_tokens": 4}}
            async with http.post(served.url + "/inference/v1/generate", json=body) as r:
                assert r.status == 400
            body = {"model": "tiny", "token_ids": [1, 10**7], "sampling_params": {}}
            async with http.post(served.url + "/inference/v1/generate", json=body) as r:
                assert r.status == 400
        with pytest.raises(InvalidArgument):  # the server's 400 surfaces as InvalidArgument
            await client.generate(GenerateRequest([1, 10**7], GREEDY, 4, "y"))
    finally:
        await client.close()


async def test_hot_swap_over_http_pauses_and_bumps_version(served: Served, tmp_path: Path,
                                                           tiny_dir: Path) -> None:
    from safetensors.torch import save_file

    save_file(random_state_dict(tiny_dir, seed=3), str(tmp_path / "model.safetensors"))
    client = HttpEngine(served.url, "tiny")
    try:
        prompt = [1, 70, 71, 72]
        long_turn = asyncio.create_task(client.generate(GenerateRequest(prompt, GREEDY, 60, "l")))
        await assert_eventually(lambda: served.engine.decode_steps > 2)
        await client.update_weights(tmp_path, 7)
        old = await long_turn
        assert old.policy_version == 0 and len(old.output_ids) == 60  # finished on old weights
        new = await client.generate(GenerateRequest(prompt, GREEDY, 10, "n"))
        assert new.policy_version == 7 and client.policy_version == 7
        assert new.output_ids != old.output_ids[:10]
        assert not served.engine.paused
    finally:
        await client.close()


async def test_pool_over_http_backends_survives_a_dead_server(tiny_dir: Path) -> None:
    a, b = await start_server(tiny_dir, "a"), await start_server(tiny_dir, "b")
    pool = BackendPool([HttpEngine(a.url, "tiny", name="a"), HttpEngine(b.url, "tiny", name="b")],
                       health_interval_s=0.05, wait_for_backend_s=2)
    await pool.start()
    try:
        results = await asyncio.gather(*(pool.generate(GenerateRequest([1, 80 + i], GREEDY, 4,
                                                                      f"s{i}")) for i in range(6)))
        assert {r.backend for r in results} == {"a", "b"}
        await a.stop()
        for i in range(6):  # sessions on a are retried on b
            result = await pool.generate(GenerateRequest([1, 80 + i, 5], GREEDY, 4, f"s{i}"))
            assert result.backend == "b"
        await assert_eventually(lambda: not pool.get("a").healthy)
        await b.stop()
        with pytest.raises(LLMUnavailable):
            await pool.generate(GenerateRequest([1, 2], GREEDY, 4, "z"))
    finally:
        await pool.close()
        await a.stop()
        await b.stop()


async def test_unreachable_server_is_an_engine_error() -> None:
    client = HttpEngine("http://127.0.0.1:9", "tiny", request_timeout_s=2)
    try:
        assert not await client.health()
        with pytest.raises(EngineError):
            await client.generate(GenerateRequest([1, 2], GREEDY, 4, "x"))
    finally:
        await client.close()


@pytest.mark.timeout(90)
async def test_llm_serve_main_as_subprocess(tiny_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollout.server.llm.http_server", "--port", "0",
        "--model", str(tiny_dir),
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert proc.stdout is not None
        url = ""
        while not url:
            # No deadline of its own: importing torch took over 60 s at load 15. The test's
            # timeout guard (scaled with the load by tests/conftest.py) catches a hang.
            line = (await proc.stdout.readline()).decode()
            assert line, "llm-serve exited before listening"
            match = re.search(r"listening on (http://[\d.:]+)", line)
            url = match.group(1) if match else ""
        client = HttpEngine(url, str(tiny_dir), protocol="completions")
        try:
            result = await client.generate(GenerateRequest([1, 2, 3], GREEDY, 3, "p"))
            assert 1 <= len(result.output_ids) <= 3
        finally:
            await client.close()
    finally:
        proc.terminate()
        await proc.wait()


async def test_abort_over_http_ends_the_turn_and_frees_the_server(served: Served) -> None:
    client = HttpEngine(served.url, "tiny")
    try:
        turn = asyncio.create_task(client.generate(GenerateRequest([1, 2, 3], GREEDY, 1500,
                                                                   "ab")))
        await assert_eventually(lambda: served.engine.load == 1 and
                                served.engine.decode_steps > 2)
        await client.abort("ab")
        result = await asyncio.wait_for(turn, 10)
        assert result.finish_reason == "abort" and result.output_ids == []
        await assert_eventually(lambda: served.engine.load == 0)  # the server stopped too
        after = await client.generate(GenerateRequest([1, 2, 3], GREEDY, 2, "next"))
        assert len(after.output_ids) == 2
    finally:
        await client.close()
