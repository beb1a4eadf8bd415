"""The in-process engine against the tiny real model: correctness of batching, KV reuse,
sampling, validation, abort and weight hot-swap."""

from __future__ import annotations

import asyncio
import warnings
from pathlib import Path

import pytest
import torch

from rollout.runtime.llm import GenerateRequest
from rollout.runtime.types import InvalidArgument, SamplingParams
from rollout.server.llm.transformers_engine import TransformersEngine, pick_threads
from tests.fixtures.tiny_model import random_state_dict
from tests.util import assert_eventually

GREEDY = SamplingParams(temperature=0.0)


def chat(engine: TransformersEngine, text: str) -> list[int]:
    out = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def reference_greedy(engine: TransformersEngine, prompt: list[int], n: int) -> list[int]:
    """Plain token-by-token greedy decoding with full prefill, no cache, no batching."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = engine.model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


def no_stop(engine: TransformersEngine) -> None:
    engine.eos_ids = frozenset()  # random weights: let every turn run to max_tokens


async def test_greedy_matches_reference_and_reports_logprobs(engine: TransformersEngine) -> None:
    no_stop(engine)
    prompt = chat(engine, "what is two plus two?")
    result = await engine.generate(GenerateRequest(prompt, GREEDY, 12, "s"))
    assert result.output_ids == reference_greedy(engine, prompt, 12)
    assert result.finish_reason == "length"
    assert len(result.logprobs) == 12 and all(lp <= 0 for lp in result.logprobs)
    assert result.policy_version == 0 and result.backend == "tiny"


async def test_concurrent_requests_are_batched_and_exact(engine: TransformersEngine) -> None:
    no_stop(engine)
    base = chat(engine, "the agent runs a command in the sandbox")
    prompts = [base[: 6 + 3 * i] for i in range(8)]  # different lengths: exercises padding
    results = await asyncio.gather(*(
        engine.generate(GenerateRequest(p, GREEDY, 10, f"b{i}")) for i, p in enumerate(prompts)))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.output_ids == reference_greedy(engine, prompt, 10)
    assert engine.max_batch_seen > 1 and engine.batched_prefills >= 1
    assert engine.decode_steps < 8 * 9  # one-at-a-time would need 72 decode steps


async def test_second_turn_reuses_kv_and_matches_full_prefill(
        engine: TransformersEngine, tiny_dir: Path) -> None:
    no_stop(engine)
    prompt = chat(engine, "ls -la /tmp")
    first = await engine.generate(GenerateRequest(prompt, GREEDY, 8, "traj"))
    turn2 = prompt + first.output_ids + chat(engine, "cat file.txt")
    second = await engine.generate(GenerateRequest(turn2, GREEDY, 8, "traj"))
    stats = engine.turn_stats[-1]
    assert stats.cached_tokens == len(prompt) + len(first.output_ids) - 1
    assert stats.prefilled_tokens == len(turn2) - stats.cached_tokens

    fresh = TransformersEngine(tiny_dir, name="fresh")
    no_stop(fresh)
    try:
        full = await fresh.generate(GenerateRequest(turn2, GREEDY, 8, "other"))
    finally:
        await fresh.close()
    assert fresh.turn_stats[-1].cached_tokens == 0
    assert second.output_ids == full.output_ids
    assert second.logprobs == pytest.approx(full.logprobs, abs=1e-4)


async def test_diverging_prompt_reuses_only_the_common_prefix(engine: TransformersEngine) -> None:
    no_stop(engine)
    prompt = chat(engine, "print the numbers")
    await engine.generate(GenerateRequest(prompt, GREEDY, 4, "t"))
    edited = prompt[:5] + chat(engine, "something else")
    result = await engine.generate(GenerateRequest(edited, GREEDY, 6, "t"))
    assert engine.turn_stats[-1].cached_tokens == 5
    assert result.output_ids == reference_greedy(engine, edited, 6)


async def test_seeded_sampling_is_reproducible(engine: TransformersEngine) -> None:
    no_stop(engine)
    prompt = chat(engine, "tell me a story")
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50)
    a = await engine.generate(GenerateRequest(prompt, params, 16, "a", seed=11))
    b = await engine.generate(GenerateRequest(prompt, params, 16, "b", seed=11))
    c = await engine.generate(GenerateRequest(prompt, params, 16, "c", seed=12))
    assert a.output_ids == b.output_ids and a.logprobs == b.logprobs
    assert a.output_ids != c.output_ids


async def test_top_k_one_is_greedy(engine: TransformersEngine) -> None:
    no_stop(engine)
    prompt = chat(engine, "hello")
    result = await engine.generate(
        GenerateRequest(prompt, SamplingParams(temperature=1.5, top_k=1), 8, "k", seed=1))
    assert result.output_ids == reference_greedy(engine, prompt, 8)


async def test_stop_token_ids_and_eos_end_the_turn(engine: TransformersEngine) -> None:
    no_stop(engine)
    prompt = chat(engine, "count to ten")
    ref = reference_greedy(engine, prompt, 10)
    stop_at = ref[3]
    cut = ref.index(stop_at) + 1
    result = await engine.generate(GenerateRequest(
        prompt, SamplingParams(temperature=0.0, stop_token_ids=(stop_at,)), 10, "st"))
    assert result.output_ids == ref[:cut] and result.finish_reason == "stop"
    engine.eos_ids = frozenset({ref[0]})
    result = await engine.generate(GenerateRequest(prompt, GREEDY, 10, "eos"))
    assert result.output_ids == ref[:1] and result.finish_reason == "stop"


@pytest.mark.parametrize("sampling,max_tokens,prompt", [
    (SamplingParams(temperature=-1.0), 4, [1, 2]),
    (SamplingParams(top_p=0.0), 4, [1, 2]),
    (SamplingParams(top_k=-3), 4, [1, 2]),
    (SamplingParams(), 0, [1, 2]),
    (SamplingParams(), 4, []),
    (SamplingParams(), 4, [1, 10**6]),
    (SamplingParams(stop_token_ids=(10**6,)), 4, [1, 2]),
])
async def test_bad_requests_are_rejected(engine: TransformersEngine, sampling: SamplingParams,
                                         max_tokens: int, prompt: list[int]) -> None:
    with pytest.raises(InvalidArgument):
        await engine.generate(GenerateRequest(prompt, sampling, max_tokens, "bad"))
    assert engine.load == 0


async def test_abort_and_cancel_free_the_slot(engine: TransformersEngine) -> None:
    no_stop(engine)
    prompt = chat(engine, "long answer please")
    task = asyncio.create_task(engine.generate(GenerateRequest(prompt, GREEDY, 1500, "ab")))
    await assert_eventually(lambda: engine.decode_steps > 2)
    await engine.abort("ab")
    result = await asyncio.wait_for(task, 30)
    assert result.finish_reason == "abort" and 0 < len(result.output_ids) < 1500
    cancelled = asyncio.create_task(engine.generate(GenerateRequest(prompt, GREEDY, 1500, "cx")))
    steps = engine.decode_steps
    await assert_eventually(lambda: engine.load == 1 and engine.decode_steps > steps + 2)
    cancelled.cancel()
    await assert_eventually(lambda: engine.load == 0)


async def test_lru_eviction_keeps_within_budget(tiny_dir: Path) -> None:
    engine = TransformersEngine(tiny_dir, name="small", kv_cache_budget_bytes=60_000)
    no_stop(engine)
    try:
        prompt = list(range(3, 40))
        for i in range(6):
            await engine.generate(GenerateRequest(prompt, GREEDY, 4, f"s{i}"))
        assert engine.kv_store.nbytes <= 60_000
        assert engine.kv_store.evictions > 0
        assert "s5" in engine.kv_store and "s0" not in engine.kv_store
        await engine.release_session("s5")
        assert "s5" not in engine.kv_store
    finally:
        await engine.close()


@pytest.mark.timeout(60)
async def test_hot_swap_mid_run(engine: TransformersEngine, tiny_dir: Path) -> None:
    """Turns in flight finish on the old weights (labelled v0); later turns use v1."""
    no_stop(engine)
    prompts = [chat(engine, f"task number {i}") for i in range(3)]
    old_refs = [reference_greedy(engine, p, 40) for p in prompts]
    in_flight = [asyncio.create_task(engine.generate(GenerateRequest(p, GREEDY, 40, f"h{i}")))
                 for i, p in enumerate(prompts)]
    await assert_eventually(lambda: engine.decode_steps >= 3)
    new_weights = random_state_dict(tiny_dir, seed=1)
    swap = asyncio.create_task(engine.update_weights(new_weights, 1))
    late = asyncio.create_task(engine.generate(GenerateRequest(prompts[0], GREEDY, 10, "late")))
    results = await asyncio.gather(*in_flight)
    await swap
    for result, ref in zip(results, old_refs, strict=True):
        assert result.policy_version == 0 and result.finish_reason == "length"
        assert result.output_ids == ref
    late_result = await late
    assert late_result.policy_version == 1 and engine.policy_version == 1
    assert late_result.output_ids == reference_greedy(engine, prompts[0], 10)
    assert late_result.output_ids != old_refs[0][:10]
    # The next turn of an old session must not reuse KV computed by the old weights.
    assert len(engine.kv_store) <= 1


async def test_update_weights_from_checkpoint_dir(engine: TransformersEngine,
                                                  tiny_dir: Path) -> None:
    prompt = [5, 6, 7, 8]
    before = engine.model.lm_head.weight.clone()
    await engine.update_weights(random_state_dict(tiny_dir, seed=2), 2)
    await engine.update_weights(tiny_dir, 3)  # back to the original checkpoint
    assert torch.equal(engine.model.lm_head.weight, before)
    result = await engine.generate(GenerateRequest(prompt, GREEDY, 2, "ck"))
    assert result.policy_version == 3
    with pytest.raises(ValueError):
        await engine.update_weights({"nonsense.weight": torch.zeros(1)}, 4)


async def test_stop_string_ends_the_turn(engine: TransformersEngine) -> None:
    no_stop(engine)
    prompt = chat(engine, "say something")
    ref = reference_greedy(engine, prompt, 12)
    text = engine.tokenizer.decode(ref[:6])
    stop = text[-3:] if text[-3:].strip() else text[-4:]
    result = await engine.generate(GenerateRequest(
        prompt, SamplingParams(temperature=0.0, stop=(stop,)), 12, "ss"))
    assert result.finish_reason == "stop"
    assert stop in engine.tokenizer.decode(result.output_ids)
    assert result.output_ids == ref[:len(result.output_ids)] and len(result.output_ids) <= 6


async def test_pause_holds_new_turns_until_resume(engine: TransformersEngine) -> None:
    no_stop(engine)
    await engine.pause()
    assert engine.paused
    held = asyncio.create_task(engine.generate(GenerateRequest([1, 2, 3], GREEDY, 3, "p")))
    await asyncio.sleep(0.05)
    assert not held.done() and engine.decode_steps == 0
    await engine.resume()
    result = await asyncio.wait_for(held, 30)
    assert len(result.output_ids) == 3


async def test_a_first_and_a_cached_turn_warn_nothing(engine: TransformersEngine) -> None:
    """The quickstart's progress bars once carried a deprecation warning per forward (the
    engine passed the KV cache under transformers' old keyword)."""
    no_stop(engine)
    prompt = chat(engine, "say something")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = await engine.generate(GenerateRequest(prompt, GREEDY, 4, "quiet"))
        follow = prompt + first.output_ids + chat(engine, "and again")
        await engine.generate(GenerateRequest(follow, GREEDY, 4, "quiet"))
    ours = [w for w in caught if issubclass(w.category, DeprecationWarning | FutureWarning)]
    assert not ours, [str(w.message) for w in ours]


@pytest.mark.parametrize("cores, load, threads", [(2, 0.0, 2), (2, 0.6, 1), (2, 1.0, 1),
                                                  (2, 12.0, 1), (16, 3.2, 13), (4, 0.4, 4)])
def test_threads_are_the_cores_not_already_busy(cores: int, load: float, threads: int) -> None:
    assert pick_threads(cores, load) == threads
