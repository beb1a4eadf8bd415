"""Logprobs a trainer can trust: the in-process engine's numbers against an independent
reference (one full forward over prompt + output, no KV cache, no batching, float64 top-k/top-p
written out token by token), seeded reproducibility inside a batch, the sampler's draws against
its distribution, and the turn cuts (deadline, weight-swap preemption)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from rollout.runtime.llm import GenerateRequest
from rollout.runtime.types import SamplingParams
from rollout.server.llm.sampling import Sampler, processed_logits, sample
from rollout.server.llm.transformers_engine import TransformersEngine
from tests.fixtures.tiny_model import random_state_dict
from tests.server.llm.reference import (
    admissible_logprobs,
    assert_logprobs_match_reference,
    full_forward_logits,
    raw_logprobs,
    reference_distribution,
)
from tests.util import assert_eventually


def chat(engine: TransformersEngine, text: str) -> list[int]:
    out = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture
def no_eos(engine: TransformersEngine) -> TransformersEngine:
    engine.eos_ids = frozenset()  # random weights: let every turn run to max_tokens
    return engine


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.7, top_p=1.0),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.9),
], ids=["T0.7-p0.9", "T1.0-p0.9", "T0.7", "T1.0-k20-p0.9"])
async def test_processed_logprobs_match_reference_forward(no_eos: TransformersEngine,
                                                          params: SamplingParams) -> None:
    engine = no_eos
    prompt = chat(engine, "the agent runs a command in the sandbox")
    result = await engine.generate(GenerateRequest(prompt, params, 24, "lp", seed=3))
    assert result.logprobs_kind == "processed" and len(result.logprobs) == 24
    assert_logprobs_match_reference(engine.model, prompt, result, params)
    # The comparison has teeth: halved values and raw model logprobs are both far off.
    halved = dataclasses.replace(result, logprobs=[lp / 2 for lp in result.logprobs])
    with pytest.raises(AssertionError, match="logprobs differ"):
        assert_logprobs_match_reference(engine.model, prompt, halved, params)
    raw = dataclasses.replace(result, logprobs=raw_logprobs(engine.model, prompt,
                                                            result.output_ids))
    with pytest.raises(AssertionError, match="logprobs differ"):
        assert_logprobs_match_reference(engine.model, prompt, raw, params)


async def test_second_turn_logprobs_match_reference(no_eos: TransformersEngine) -> None:
    """Turn 2 decodes on the session's cached KV; its logprobs still equal a full forward."""
    engine = no_eos
    params = SamplingParams(temperature=0.7, top_p=0.9)
    prompt = chat(engine, "ls -la /tmp")
    first = await engine.generate(GenerateRequest(prompt, params, 10, "t2", seed=1))
    turn2 = prompt + first.output_ids + chat(engine, "cat file.txt")
    second = await engine.generate(GenerateRequest(turn2, params, 10, "t2", seed=2))
    assert engine.turn_stats[-1].cached_tokens > 0
    assert_logprobs_match_reference(engine.model, turn2, second, params)


async def test_mixed_batch_each_row_gets_its_own_processing(no_eos: TransformersEngine) -> None:
    """Rows with different T / top-k / top-p / mode in one batch each match their reference."""
    engine = no_eos
    variants = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0),
                SamplingParams(temperature=1.3, top_k=5), SamplingParams(temperature=0.0),
                SamplingParams(temperature=0.7, top_p=0.9, logprobs_mode="raw"),
                SamplingParams(temperature=0.9, top_k=40, top_p=0.8)]
    base = chat(engine, "import os, sys for i in range(10)")
    prompts = [base[:8 + 2 * i] for i in range(len(variants))]
    results = await asyncio.gather(*(
        engine.generate(GenerateRequest(p, v, 12, f"m{i}", seed=i))
        for i, (p, v) in enumerate(zip(prompts, variants, strict=True))))
    assert engine.max_batch_seen > 1
    for prompt, params, result in zip(prompts, variants, results, strict=True):
        if params.logprobs_mode == "raw":
            assert result.logprobs_kind == "raw"
            assert result.logprobs == pytest.approx(
                raw_logprobs(engine.model, prompt, result.output_ids), abs=1e-4), params
        else:
            assert result.logprobs_kind == "processed"
            assert_logprobs_match_reference(engine.model, prompt, result, params)


async def test_raw_mode_and_greedy(no_eos: TransformersEngine) -> None:
    """``raw`` returns the unmodified model logprob; greedy records the log-softmax of the logits
    whatever its top-k / top-p (vLLM's processed value for a greedy row: the raw value)."""
    engine = no_eos
    prompt = chat(engine, "print the numbers")
    raw_mode = SamplingParams(temperature=0.7, top_p=0.9, logprobs_mode="raw")
    result = await engine.generate(GenerateRequest(prompt, raw_mode, 16, "raw", seed=5))
    assert result.logprobs_kind == "raw"
    assert result.logprobs == pytest.approx(raw_logprobs(engine.model, prompt, result.output_ids),
                                            abs=1e-4)
    processed = await engine.generate(GenerateRequest(
        prompt, SamplingParams(temperature=0.7, top_p=0.9), 16, "proc", seed=5))
    assert processed.output_ids == result.output_ids  # the mode changes the record, not the draw
    assert processed.logprobs != pytest.approx(result.logprobs, abs=1e-3)
    greedy = await engine.generate(GenerateRequest(
        prompt, SamplingParams(temperature=0.0, top_p=0.5, top_k=3), 16, "greedy"))
    logits = full_forward_logits(engine.model, prompt, greedy.output_ids)
    assert greedy.output_ids == logits.argmax(-1).tolist()
    assert greedy.logprobs == pytest.approx(
        raw_logprobs(engine.model, prompt, greedy.output_ids), abs=1e-4)


async def test_seeded_row_is_the_same_alone_and_in_a_batch_of_16(
        no_eos: TransformersEngine) -> None:
    engine = no_eos
    params = SamplingParams(temperature=1.0, top_p=0.9)
    prompt = chat(engine, "tell me a story about the fox")
    alone = await engine.generate(GenerateRequest(prompt, params, 20, "alone", seed=42))
    others = [SamplingParams(temperature=0.5 + 0.1 * i, top_k=(i % 4) * 10,
                             top_p=1.0 if i % 3 else 0.8) for i in range(15)]
    other_prompts = [chat(engine, f"question number {i}")[: 6 + i] for i in range(15)]
    tasks = [engine.generate(GenerateRequest(p, o, 20, f"o{i}", seed=100 + i))
             for i, (p, o) in enumerate(zip(other_prompts, others, strict=True))]
    tasks.insert(7, engine.generate(GenerateRequest(prompt, params, 20, "inside", seed=42)))
    results = await asyncio.gather(*tasks)
    inside = results[7]
    assert engine.max_batch_seen == 16
    assert inside.output_ids == alone.output_ids
    # The batched forward (left padding, a 16-row matmul) may round differently from the lone
    # one in the last bits; the sampler adds nothing of its own (see the sampler test below).
    # Where a top-p cut sits within that noise the two may keep different sets, so those
    # positions are held to the reference instead.
    near_cut = set(assert_logprobs_match_reference(engine.model, prompt, alone, params))
    near_cut |= set(assert_logprobs_match_reference(engine.model, prompt, inside, params))
    for index, (lone, batched) in enumerate(zip(alone.logprobs, inside.logprobs, strict=True)):
        if index not in near_cut:
            # 1e-4, as the raw comparisons above: a 16-row left-padded matmul has been seen
            # 2e-5 away from the lone one in float32 (the thread count changes the blocking)
            assert batched == pytest.approx(lone, abs=1e-4), index
    other = await engine.generate(GenerateRequest(prompt, params, 20, "other-seed", seed=43))
    assert other.output_ids != alone.output_ids


def test_sampler_row_ignores_its_batch() -> None:
    """Same logits row and seed: identical token and logprob alone and among 15 other rows."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1000, generator=gen) * 3
    params = SamplingParams(temperature=0.8, top_p=0.9)
    others = [Sampler.create(SamplingParams(temperature=0.3 + 0.1 * i, top_k=i * 7,
                                            top_p=1.0 if i % 2 else 0.7), seed=i)
              for i in range(15)]
    for _ in range(5):
        target_alone, target_inside = Sampler.create(params, 9), Sampler.create(params, 9)
        tok_alone, lp_alone, _ = sample(logits[3:4], [target_alone])
        tok_in, lp_in, _ = sample(logits, [*others[:3], target_inside, *others[3:]])
        assert tok_in[3] == tok_alone[0]
        assert lp_in[3] == pytest.approx(lp_alone[0], abs=1e-6)


@pytest.mark.parametrize("top_k", [0, 3000])
def test_processed_logits_on_a_large_vocabulary(top_k: int) -> None:
    """Vocabulary 20,000 > the probe of the top-p search: peaked rows find their nucleus in the
    probe, flat rows (nucleus of thousands of tokens) go to the full sort; every row's kept
    set and logprobs equal the reference's."""
    gen = torch.Generator().manual_seed(2)
    vocab = 20_000
    scales = [8.0, 3.0, 0.05, 0.5, 8.0, 0.05]
    logits = torch.stack([torch.randn(vocab, generator=gen) * sc for sc in scales])
    temps, top_ps = [0.7, 1.0, 1.0, 0.9, 1.3, 0.7], [0.9, 0.95, 0.9, 0.8, 1.0, 0.5]
    top_ks = [top_k] * len(scales)
    processed = processed_logits(logits, temps, top_ks, top_ps)
    logprobs = torch.log_softmax(processed.double(), dim=-1)
    for row in range(len(scales)):
        kept = reference_distribution(logits[row], temps[row], top_ks[row], top_ps[row])
        finite = torch.isfinite(processed[row]).nonzero().squeeze(1).tolist()
        assert sorted(finite) == sorted(kept), f"row {row}: kept sets differ"
        tokens = torch.tensor(sorted(kept))
        expected = torch.tensor([math.log(kept[t]) for t in sorted(kept)], dtype=torch.float64)
        assert torch.allclose(logprobs[row, tokens], expected, atol=1e-4), f"row {row}"
    assert len(reference_distribution(logits[2], 1.0, top_k, 0.9)) > 1024  # beyond the probe


def test_sampler_draws_follow_the_processed_distribution() -> None:
    """4000 independently seeded rows over one logits row: empirical frequencies match the
    reference nucleus probabilities (a wrong CDF or mask would shift mass measurably)."""
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(50, generator=gen) * 2
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=30)
    n = 4000
    samplers = [Sampler.create(params, seed) for seed in range(n)]
    tokens, logprobs, _ = sample(row.expand(n, -1).clone(), samplers)
    counts = torch.bincount(torch.tensor(tokens), minlength=50).double() / n
    kept = reference_distribution(row, 0.7, 30, 0.9)
    expected = torch.tensor([kept.get(tok, 0.0) for tok in range(50)], dtype=torch.float64)
    assert counts[expected == 0].sum() == 0  # nothing drawn outside the kept set
    # Binomial standard error at n=4000 is at most 0.008; allow 5 of them.
    assert torch.allclose(counts, expected, atol=0.04)
    for tok, lp in zip(tokens, logprobs, strict=True):
        assert lp == pytest.approx(math.log(kept[tok]), abs=1e-5)


async def test_timeout_returns_partial_output_with_deadline(no_eos: TransformersEngine) -> None:
    engine = no_eos
    params = SamplingParams(temperature=0.7, top_p=0.9)
    prompt = chat(engine, "long answer please")
    result = await asyncio.wait_for(engine.generate(GenerateRequest(
        prompt, params, 1500, "dl", seed=4, timeout_s=0.5)), 60)
    assert result.finish_reason == "deadline"
    assert 0 < len(result.output_ids) < 1500 and len(result.logprobs) == len(result.output_ids)
    assert_logprobs_match_reference(engine.model, prompt, result, params)
    assert engine.load == 0


async def test_timeout_while_queued_returns_deadline_without_tokens(
        no_eos: TransformersEngine) -> None:
    engine = no_eos
    await engine.pause()
    result = await asyncio.wait_for(engine.generate(GenerateRequest(
        [5, 6, 7], SamplingParams(), 8, "q", timeout_s=0.2)), 30)
    assert result.finish_reason == "deadline" and result.output_ids == [] and engine.load == 0
    await engine.resume()


@pytest.mark.timeout(120)
async def test_swap_drain_timeout_returns_preempted(tiny_dir: Path) -> None:
    engine = TransformersEngine(tiny_dir, name="swap", drain_timeout_s=0.3)
    engine.eos_ids = frozenset()
    try:
        prompt = chat(engine, "task number 1")
        params = SamplingParams(temperature=0.0)
        running = asyncio.create_task(engine.generate(GenerateRequest(prompt, params, 1500, "p")))
        await assert_eventually(lambda: engine.decode_steps >= 3)
        await engine.update_weights(random_state_dict(tiny_dir, seed=1), 1)
        result = await asyncio.wait_for(running, 30)
        assert result.finish_reason == "preempted" and result.policy_version == 0
        assert 0 < len(result.output_ids) < 1500
        # Its tokens are the old policy's: a fresh greedy run under v0 weights would give them.
        await engine.update_weights(tiny_dir, 2)
        fresh = await engine.generate(GenerateRequest(prompt, params, len(result.output_ids),
                                                      "again"))
        assert fresh.output_ids == result.output_ids and fresh.finish_reason == "length"
    finally:
        await engine.close()


def test_reference_admits_both_sides_of_a_top_p_cut_only_within_the_noise() -> None:
    """The allowance of :func:`assert_logprobs_match_reference` stays narrow: a cut whose mass
    above lies within ``MASS_SLACK`` of top-p admits both kept sets, a clear one exactly one,
    and a token outside every admissible set has no value (so it fails)."""
    # Probabilities 0.5, 0.3, 0.1 + d, 0.05, rest spread thin: the mass above the fourth
    # token is 0.9 + d, so with top-p 0.9 it is kept only when d < 0.
    def row(d: float) -> torch.Tensor:
        probs = torch.tensor([0.5, 0.3, 0.1 + d, 0.05] + [(0.05 - d) / 96] * 96,
                             dtype=torch.float64)
        return probs.log()

    near, clear = admissible_logprobs(row(1e-6), 2, 1.0, 0, 0.9), \
        admissible_logprobs(row(0.02), 2, 1.0, 0, 0.9)
    assert len(near) == 2 and len(clear) == 1
    assert clear[0] == pytest.approx(math.log(0.12 / 0.92))
    assert sorted(near) == pytest.approx(sorted([math.log(0.100001 / 0.900001),
                                                 math.log(0.100001 / 0.950001)]))
    assert admissible_logprobs(row(0.02), 3, 1.0, 0, 0.9) == []  # cut off, clearly
    assert len(admissible_logprobs(row(1e-6), 3, 1.0, 0, 0.9)) == 1  # kept on one side only
    assert len(admissible_logprobs(row(1e-6), 2, 1.0, 0, 1.0)) == 1  # no top-p, no cut
