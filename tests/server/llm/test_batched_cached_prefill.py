"""Turns that reuse their session's cached KV prefill together in one padded forward, and the
result is what each session computes alone: cached prefixes and new tokens of different lengths
must not leak into each other through the padding, positions or mask."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rollout.runtime.llm import GenerateRequest, GenerateResult
from rollout.runtime.types import SamplingParams
from rollout.server.llm.decode_batch import PrefillBatch, plan_prefill
from rollout.server.llm.transformers_engine import TransformersEngine

GREEDY = SamplingParams(temperature=0.0)
SESSIONS, TURNS = 6, 3


def first_prompt(i: int) -> list[int]:
    return [1] + [20 + (7 * i + j) % 90 for j in range(3 + 4 * i)]  # 4..24 tokens


def observation(i: int, turn: int) -> list[int]:
    return [2] + [30 + (5 * i + 3 * turn + j) % 80 for j in range(1 + (i * 3 + turn) % 7)]


async def run_sessions(engine: TransformersEngine, prefix: str, concurrent: bool
                       ) -> list[list[GenerateResult]]:
    """Every session's turns; turn t+1's prompt = turn t's prompt + output + an observation."""
    prompts = [first_prompt(i) for i in range(SESSIONS)]
    results: list[list[GenerateResult]] = [[] for _ in range(SESSIONS)]
    for turn in range(TURNS):
        requests = [GenerateRequest(p, GREEDY, 4 + (i + turn) % 5, f"{prefix}{i}")
                    for i, p in enumerate(prompts)]
        if concurrent:
            outs = list(await asyncio.gather(*(engine.generate(r) for r in requests)))
        else:
            outs = [await engine.generate(r) for r in requests]
        for i, out in enumerate(outs):
            results[i].append(out)
            prompts[i] = prompts[i] + out.output_ids + observation(i, turn)
    return results


@pytest.mark.timeout(120)
async def test_concurrent_multi_turn_sessions_equal_one_at_a_time(tiny_dir: Path) -> None:
    # A huge per-forward cost makes the planner put every joining turn in one forward, so the
    # rows really differ in cached and new length within a batch.
    engine = TransformersEngine(tiny_dir, name="tiny", dtype=torch.float32,
                                prefill_overhead_tokens=10**6)
    engine.eos_ids = frozenset()  # random weights: run every turn to max_tokens
    try:
        alone = await run_sessions(engine, "alone-", concurrent=False)
        assert engine.batched_prefills == 0
        together = await run_sessions(engine, "together-", concurrent=True)
        # Turns 2.. of the concurrent run reused their cache in a batched forward.
        assert engine.batched_cached_prefills >= TURNS - 1
        reused = [s for s in engine.turn_stats if s.session_id.startswith("together-")
                  and s.cached_tokens > 0]
        assert len(reused) == SESSIONS * (TURNS - 1)
        assert len({s.cached_tokens for s in reused}) > 1  # prefixes of different lengths
        assert len({s.prefilled_tokens for s in reused}) > 1  # new tokens of different lengths
        for a_turns, b_turns in zip(alone, together, strict=True):
            for a, b in zip(a_turns, b_turns, strict=True):
                assert b.output_ids == a.output_ids
                assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    finally:
        await engine.close()


async def test_serial_switch_keeps_cached_turns_out_of_the_batch(tiny_dir: Path) -> None:
    engine = TransformersEngine(tiny_dir, name="tiny", dtype=torch.float32)
    engine.eos_ids = frozenset()
    engine.batch_cached_prefill = False
    try:
        serial = await run_sessions(engine, "s-", concurrent=True)
        assert engine.batched_cached_prefills == 0 and engine.batched_prefills == 1  # turn 1 only
        engine.batch_cached_prefill = True
        engine.prefill_overhead_tokens = 10**6
        batched = await run_sessions(engine, "b-", concurrent=True)
        assert engine.batched_cached_prefills >= TURNS - 1
        assert [[r.output_ids for r in s] for s in batched] == \
            [[r.output_ids for r in s] for s in serial]
    finally:
        await engine.close()


def test_prefill_batch_layout() -> None:
    """Row layout ``[pad | cached | pad | new]``; positions continue each row's prefix."""
    past = [(torch.ones(1, 2, 3, 4), torch.full((1, 2, 3, 4), 2.0))]
    batch = PrefillBatch([[5, 6, 7, 8, 9], [5, 6, 7]], [past, None], torch.device("cpu"))
    assert batch.cached == [3, 0] and batch.new == [2, 3]
    assert batch.ids.tolist() == [[0, 8, 9], [5, 6, 7]]
    assert batch.positions.tolist() == [[0, 3, 4], [0, 1, 2]]
    assert batch.mask.tolist() == [[1, 1, 1, 0, 1, 1], [0, 0, 0, 1, 1, 1]]
    keys = batch.cache.layers[0].keys
    assert keys.shape == (2, 2, 3, 4) and keys[0].eq(1).all() and keys[1].eq(0).all()


def test_plan_prefill_trades_padding_against_forwards() -> None:
    assert plan_prefill([5, 5, 5], overhead_tokens=32) == [[0, 1, 2]]  # no padding: one forward
    assert plan_prefill([10, 500], overhead_tokens=32) == [[0], [1]]  # padding 490 > 32
    # Similar lengths group together, whatever the arrival order.
    groups = plan_prefill([200, 10, 198, 12, 11], overhead_tokens=32)
    assert sorted(map(sorted, groups)) == [[0, 2], [1, 3, 4]]
    assert plan_prefill([10, 500], overhead_tokens=10**6) == [[0, 1]]
    assert plan_prefill([], overhead_tokens=32) == []
