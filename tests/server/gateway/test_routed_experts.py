"""Routing replay (R3) for harness turns: the gateway's committed turns carry the experts a tiny
random Qwen2-MoE routed each output token to, for a plain request and for a streamed one (the
engine's ``stream`` path), and both equal the routing of one plain forward over the sequence."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.runtime.types import JobSpec, Limits, SamplingParams, Turn
from rollout.server.gateway import Gateway
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.transformers_engine import TransformersEngine
from tests.fixtures.tiny_model import tiny_moe_model_dir
from tests.server.gateway.conftest import openai_client
from tests.trainer_adapters.verl.test_routed_experts import expected_routing

pytestmark = pytest.mark.timeout(300)

TASK = [{"role": "user", "content": "Run a command in the sandbox."}]
LAYERS, TOP_K = 2, 2


async def _one_turn_each(gateway: Gateway, plain_pool: BackendPool,
                         streamed_pool: BackendPool) -> tuple[list[Turn], list[Turn]]:
    """One 8-token turn of the same seeded job as a whole reply on ``plain_pool`` and as a
    stream on ``streamed_pool``; the committed turns of each."""
    spec = {"environment": "harness", "task": {},
            "sampling": SamplingParams(temperature=1.0, seed=11),
            "limits": Limits(max_turns=4)}
    plain = await gateway.open(JobSpec(job_id="plain", **spec), plain_pool)
    streamed = await gateway.open(JobSpec(job_id="streamed", **spec), streamed_pool)
    await openai_client(plain).chat.completions.create(model="m", messages=TASK, max_tokens=8)
    stream = await openai_client(streamed).chat.completions.create(
        model="m", messages=TASK, max_tokens=8, stream=True)
    async for _ in stream:
        pass
    return (await gateway.close(plain)).turns, (await gateway.close(streamed)).turns


def _assert_forward_routing(model_dir: Path, turn: Turn) -> None:
    """Output token i was sampled at position len(prompt) - 1 + i: its experts are the plain
    forward's there."""
    assert len(turn.output_ids) == 8
    assert (turn.routed_expert_layers, turn.routed_expert_top_k) == (LAYERS, TOP_K)
    want = expected_routing(model_dir, [*turn.prompt_ids, *turn.output_ids])
    p = len(turn.prompt_ids)
    for i in range(len(turn.output_ids)):
        got = [sorted(turn.routed_experts[(i * LAYERS + layer) * TOP_K:
                                          (i * LAYERS + layer + 1) * TOP_K])
               for layer in range(LAYERS)]
        assert got == [sorted(x) for x in want[p - 1 + i]]


async def test_gateway_turns_carry_routed_experts_plain_and_streamed(tmp_path: Path) -> None:
    model_dir = tiny_moe_model_dir()
    engine = TransformersEngine(model_dir, num_threads=1, ignore_eos=True)
    pool = BackendPool([engine], health_interval_s=0)
    gateway = await Gateway(tmp_path / "state").start()
    try:
        a, b = await _one_turn_each(gateway, pool, pool)
    finally:
        await gateway.stop()
        await pool.close()

    for turns in (a, b):
        assert len(turns) == 1
        assert len(turns[0].routed_experts) == 8 * LAYERS * TOP_K
        _assert_forward_routing(model_dir, turns[0])
    # Same seed, same prompt: the streamed turn is the plain one, routing included.
    assert (a[0].output_ids, a[0].routed_experts) == (b[0].output_ids, b[0].routed_experts)


async def test_routed_experts_reach_the_trajectory_through_llm_serve_streamed_or_not(
        tmp_path: Path) -> None:
    """The same over HTTP: ``rollout llm-serve`` serves the tiny MoE, the gateway's backend is
    an :class:`HttpEngine`; a streamed turn (server-sent events, routing in the last chunk)
    and a whole reply both reach the committed turn with the routing of a plain forward."""
    from rollout.server.llm.http_engine import HttpEngine
    from tests.server.llm.conftest import start_server

    model_dir = tiny_moe_model_dir()
    served = await start_server(model_dir, "moe")
    tokenizer = served.engine.tokenizer
    pools = {mode: BackendPool([HttpEngine(served.url, "tiny", tokenizer=tokenizer,
                                           stream=mode)], health_interval_s=0)
             for mode in (False, True)}
    gateway = await Gateway(tmp_path / "state").start()
    try:
        a, b = await _one_turn_each(gateway, pools[False], pools[True])
    finally:
        await gateway.stop()
        for pool in pools.values():
            await pool.close()
        await served.stop()

    for turns in (a, b):
        assert len(turns) == 1
        _assert_forward_routing(model_dir, turns[0])
    assert (a[0].output_ids, a[0].routed_experts) == (b[0].output_ids, b[0].routed_experts)
