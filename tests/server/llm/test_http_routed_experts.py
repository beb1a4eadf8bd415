"""vLLM's routed experts (its generate protocol, ``enable_return_routed_experts``) become the
trajectory's per-output-token routing: rows ``prompt - 1 .. prompt - 2 + n`` of vLLM's
``(tokens - 1, layers, k)`` array, the positions that produced the output tokens."""

from __future__ import annotations

import base64
import io

import numpy as np

from rollout.server.llm.http_engine import HttpEngine, _Turn, routed_for_output


def encoded(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode()


def test_routed_experts_of_the_producing_positions() -> None:
    # 3 prompt tokens + 2 output tokens: vLLM forwarded 4 positions; row p = 10 * p + layer.
    arr = np.array([[[10 * p + layer, 100 + p] for layer in range(2)] for p in range(4)],
                   dtype=np.int32)
    routed, layers, k = routed_for_output(encoded(arr), prompt_len=3, n_output=2)
    assert (layers, k) == (2, 2)
    assert routed == [20, 102, 21, 102, 30, 103, 31, 103]  # positions 2 and 3
    assert routed_for_output(encoded(arr), prompt_len=3, n_output=3) == ([], 0, 0)


def test_a_generate_reply_carries_them_into_the_result() -> None:
    engine = HttpEngine("http://127.0.0.1:9", "m", protocol="generate")
    turn = _Turn("processed", prompt_len=3)
    arr = np.arange(4 * 1 * 2, dtype=np.int32).reshape(4, 1, 2)
    engine._absorb({"choices": [{"token_ids": [7, 8], "finish_reason": "stop",
                                 "logprobs": {"content": [{"logprob": -0.5},
                                                          {"logprob": -1.0}]},
                                 "routed_experts": encoded(arr)}]}, turn)
    result = engine._result(turn, "stop")
    assert result.routed_experts == [4, 5, 6, 7]
    assert (result.routed_expert_layers, result.routed_expert_top_k) == (1, 2)


async def test_llm_serve_sends_a_turns_routing_as_vllm_does() -> None:
    """``rollout llm-serve`` over an MoE model: a whole reply and a stream's last chunk (only)
    carry the turn's routing in vLLM's shape, honouring ``routed_experts_prompt_start``."""
    import json

    import aiohttp

    from tests.fixtures.tiny_model import tiny_moe_model_dir
    from tests.server.llm.conftest import start_server

    served = await start_server(tiny_moe_model_dir(), "moe")
    prompt = served.engine.tokenizer.encode("The agent runs a command")
    p, n = len(prompt), 5

    def body(stream: bool, **extra: int) -> dict[str, object]:
        return {"model": "tiny", "token_ids": prompt, "stream": stream,
                "sampling_params": {"max_tokens": n, "seed": 4, "logprobs": 0, **extra}}

    try:
        async with aiohttp.ClientSession() as http:
            url = f"{served.url}/inference/v1/generate"
            async with http.post(url, json=body(False)) as reply:
                choice = (await reply.json())["choices"][0]
            whole = decode(choice["routed_experts"])
            assert whole.shape == (p - 1 + n, 2, 2)
            assert (whole[:p - 1] == -1).all() and (whole[p - 1:] >= 0).all()
            assert routed_for_output(choice["routed_experts"], p, n)[0] == \
                [int(x) for x in whole[p - 1:].reshape(-1)]
            async with http.post(url, json=body(True, routed_experts_prompt_start=p - 1)
                                 ) as reply:
                chunks = [json.loads(line[6:]) for line in (await reply.text()).splitlines()
                          if line.startswith("data: {")]
            carried = [c["choices"][0]["routed_experts"] for c in chunks]
            assert all(r is None for r in carried[:-1]) and carried[-1] is not None
            assert chunks[-1]["choices"][0]["finish_reason"]
            assert (decode(carried[-1]) == whole[p - 1:]).all()  # same seed, same turn
            async with http.post(url, json=body(False, routed_experts_prompt_start=p + 1)
                                 ) as reply:
                assert reply.status == 400
                assert "routed_experts_prompt_start" in (await reply.text())
    finally:
        await served.stop()


def decode(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)
