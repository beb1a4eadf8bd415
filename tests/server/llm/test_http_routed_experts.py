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
