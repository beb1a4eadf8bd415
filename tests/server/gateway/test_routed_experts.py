"""Routing replay (R3) for harness turns: the gateway's committed turns carry the experts a tiny
random Qwen2-MoE routed each output token to, for a plain request and for a streamed one (the
engine's ``stream`` path), and both equal the routing of one plain forward over the sequence."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.runtime.types import JobSpec, Limits, SamplingParams
from rollout.server.gateway import Gateway
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.transformers_engine import TransformersEngine
from tests.fixtures.tiny_model import tiny_moe_model_dir
from tests.server.gateway.conftest import openai_client
from tests.trainer_adapters.verl.test_routed_experts import expected_routing

pytestmark = pytest.mark.timeout(300)

TASK = [{"role": "user", "content": "Run a command in the sandbox."}]
LAYERS, TOP_K = 2, 2


async def test_gateway_turns_carry_routed_experts_plain_and_streamed(tmp_path: Path) -> None:
    model_dir = tiny_moe_model_dir()
    engine = TransformersEngine(model_dir, num_threads=1, ignore_eos=True)
    pool = BackendPool([engine], health_interval_s=0)
    gateway = await Gateway(tmp_path / "state").start()
    try:
        spec = {"environment": "harness", "task": {},
                "sampling": SamplingParams(temperature=1.0, seed=11),
                "limits": Limits(max_turns=4)}
        plain = await gateway.open(JobSpec(job_id="plain", **spec), pool)
        streamed = await gateway.open(JobSpec(job_id="streamed", **spec), pool)
        await openai_client(plain).chat.completions.create(model="m", messages=TASK,
                                                           max_tokens=8)
        stream = await openai_client(streamed).chat.completions.create(
            model="m", messages=TASK, max_tokens=8, stream=True)
        async for _ in stream:
            pass
        a = (await gateway.close(plain)).turns
        b = (await gateway.close(streamed)).turns
    finally:
        await gateway.stop()
        await pool.close()

    for turns in (a, b):
        assert len(turns) == 1
        turn = turns[0]
        n = len(turn.output_ids)
        assert n == 8
        assert (turn.routed_expert_layers, turn.routed_expert_top_k) == (LAYERS, TOP_K)
        assert len(turn.routed_experts) == n * LAYERS * TOP_K
        # Output token i was sampled at position len(prompt) - 1 + i.
        want = expected_routing(model_dir, [*turn.prompt_ids, *turn.output_ids])
        p = len(turn.prompt_ids)
        for i in range(n):
            got = [sorted(turn.routed_experts[(i * LAYERS + layer) * TOP_K:
                                              (i * LAYERS + layer + 1) * TOP_K])
                   for layer in range(LAYERS)]
            assert got == [sorted(x) for x in want[p - 1 + i]]
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
        spec = {"environment": "harness", "task": {},
                "sampling": SamplingParams(temperature=1.0, seed=11),
                "limits": Limits(max_turns=4)}
        whole = await gateway.open(JobSpec(job_id="whole", **spec), pools[False])
        streamed = await gateway.open(JobSpec(job_id="streamed", **spec), pools[True])
        await openai_client(whole).chat.completions.create(model="m", messages=TASK,
                                                           max_tokens=8)
        stream = await openai_client(streamed).chat.completions.create(
            model="m", messages=TASK, max_tokens=8, stream=True)
        async for _ in stream:
            pass
        a = (await gateway.close(whole)).turns
        b = (await gateway.close(streamed)).turns
    finally:
        await gateway.stop()
        for pool in pools.values():
            await pool.close()
        await served.stop()

    for turns in (a, b):
        assert len(turns) == 1
        turn = turns[0]
        n = len(turn.output_ids)
        assert n == 8
        assert (turn.routed_expert_layers, turn.routed_expert_top_k) == (LAYERS, TOP_K)
        want = expected_routing(model_dir, [*turn.prompt_ids, *turn.output_ids])
        p = len(turn.prompt_ids)
        for i in range(n):
            got = [sorted(turn.routed_experts[(i * LAYERS + layer) * TOP_K:
                                              (i * LAYERS + layer + 1) * TOP_K])
                   for layer in range(LAYERS)]
            assert got == [sorted(x) for x in want[p - 1 + i]]
    assert (a[0].output_ids, a[0].routed_experts) == (b[0].output_ids, b[0].routed_experts)
