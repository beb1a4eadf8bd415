"""Top log-probabilities (what an API's ``top_logprobs`` asks for) from the in-process engine and
over HTTP (``rollout llm-serve`` in vLLM's two request shapes): per output token the ``k`` most
likely tokens, best first, equal to the log-softmax of the model's own logits computed here in
one uncached forward, and holding the sampled token's logprob wherever it ranks in the top ``k``.
"""

from __future__ import annotations

import pytest
import torch

from rollout.runtime.llm import GenerateRequest, GenerateResult
from rollout.runtime.types import InvalidArgument, SamplingParams
from rollout.server.llm.http_engine import HttpEngine
from rollout.server.llm.transformers_engine import TransformersEngine
from tests.server.llm.conftest import Served
from tests.server.llm.reference import full_forward_logits

PLAIN = SamplingParams(temperature=1.0)
"""No temperature, top-k or top-p: the sampled distribution is the model's own softmax."""
PROMPT = [1, 40, 41, 42, 43, 44]


@pytest.fixture
def no_eos(engine: TransformersEngine) -> TransformersEngine:
    engine.eos_ids = frozenset()  # random weights: let every turn run to max_tokens
    return engine


def assert_top_is_the_models(model: torch.nn.Module, prompt: list[int], result: GenerateResult,
                             k: int, scale: float = 1.0) -> None:
    """Each step's entries are the ``k`` best of log_softmax(logits / scale) from a forward done
    here, sorted, and carry the sampled token's own logprob where it is among them."""
    logits = full_forward_logits(model, prompt, result.output_ids)
    expected = torch.log_softmax(logits / scale, dim=-1)
    assert len(result.top_logprobs) == len(result.output_ids)
    seen_sampled = 0
    for step, (token, logprob, top) in enumerate(zip(
            result.output_ids, result.logprobs, result.top_logprobs, strict=True)):
        assert len(top) == k
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True), f"step {step} not best first"
        best = torch.topk(expected[step], k)
        assert [t for t, _ in top] == best.indices.tolist(), f"step {step}: other tokens"
        assert values == pytest.approx(best.values.tolist(), abs=1e-4), f"step {step}: values"
        ranked = dict(top)
        if token in ranked:
            seen_sampled += 1
            assert ranked[token] == pytest.approx(logprob, abs=1e-6)
    assert seen_sampled, "no sampled token ranked in the top k: the check above never ran"


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_top_logprobs_are_the_models_best(no_eos: TransformersEngine,
                                                       stream: bool) -> None:
    request = GenerateRequest(PROMPT, PLAIN, 12, "top", seed=5, top_logprobs=5)
    if stream:
        pieces = [p async for p in no_eos.stream(request)]
        result = GenerateResult(
            [t for p in pieces for t in p.output_ids], [v for p in pieces for v in p.logprobs],
            pieces[-1].finish_reason, 0, "tiny",
            top_logprobs=[s for p in pieces for s in p.top_logprobs])
    else:
        result = await no_eos.generate(request)
    assert_top_is_the_models(no_eos.model, PROMPT, result, 5)


async def test_greedy_and_tempered_rows_in_one_batch(no_eos: TransformersEngine) -> None:
    """Greedy turns report the temperature-1 distribution (as their sampled logprob does), a
    tempered turn the tempered one; a turn that asks for none gets none, beside them."""
    import asyncio

    greedy, warm, none = await asyncio.gather(
        no_eos.generate(GenerateRequest(PROMPT, SamplingParams(temperature=0.0), 8, "g",
                                        top_logprobs=3)),
        no_eos.generate(GenerateRequest(PROMPT, SamplingParams(temperature=0.5), 8, "w",
                                        seed=2, top_logprobs=4)),
        no_eos.generate(GenerateRequest(PROMPT, PLAIN, 8, "n", seed=2)))
    assert_top_is_the_models(no_eos.model, PROMPT, greedy, 3)
    assert all(t[0][0] == tok for t, tok in zip(greedy.top_logprobs, greedy.output_ids,
                                                 strict=True))
    assert_top_is_the_models(no_eos.model, PROMPT, warm, 4, scale=0.5)
    assert none.top_logprobs == []


async def test_engine_refuses_more_than_the_vocabulary(no_eos: TransformersEngine) -> None:
    with pytest.raises(InvalidArgument, match="top_logprobs"):
        await no_eos.generate(GenerateRequest(PROMPT, PLAIN, 4, "x",
                                              top_logprobs=no_eos.vocab_size + 1))



@pytest.mark.parametrize("protocol", ["generate", "completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_top_logprobs_over_http(served: Served, protocol: str, stream: bool) -> None:
    """The HTTP engine asks the server for them (vLLM's ``logprobs: k``) and reads vLLM's
    shapes back: the same ``k`` best as the model's own."""
    client = HttpEngine(served.url, "tiny", protocol=protocol, stream=stream)
    served.engine.eos_ids = frozenset()
    try:
        result = await client.generate(GenerateRequest(PROMPT, PLAIN, 10, "s", seed=7,
                                                       top_logprobs=4))
        plain = await client.generate(GenerateRequest(PROMPT, PLAIN, 3, "p", seed=7))
    finally:
        await client.close()
    assert_top_is_the_models(served.engine.model, PROMPT, result, 4)
    assert plain.top_logprobs == []


@pytest.mark.parametrize("protocol", ["generate", "completions"])
async def test_streamed_pieces_carry_their_top_logprobs(served: Served, protocol: str) -> None:
    """``generate_stream`` over HTTP: each piece holds its own tokens' alternatives, and joined
    they are the non-streamed turn's."""
    client = HttpEngine(served.url, "tiny", protocol=protocol)
    served.engine.eos_ids = frozenset()
    try:
        pieces = [piece async for piece in client.generate_stream(
            GenerateRequest(PROMPT, PLAIN, 10, "st", seed=7, top_logprobs=4))]
        whole = await client.generate(GenerateRequest(PROMPT, PLAIN, 10, "wh", seed=7,
                                                      top_logprobs=4))
    finally:
        await client.close()
    assert all(len(p.top_logprobs) == len(p.output_ids) for p in pieces)
    joined = [entry for p in pieces for entry in p.top_logprobs]
    assert [t for p in pieces for t in p.output_ids] == whole.output_ids
    assert [[t for t, _ in e] for e in joined] == [[t for t, _ in e] for e in whole.top_logprobs]
    assert_top_is_the_models(served.engine.model, PROMPT, whole, 4)
