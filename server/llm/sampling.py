"""Token sampling for the in-process engine: temperature, top-k, top-p, per-request seeds.

Logprobs are the *raw* model log-probabilities of the sampled token (log-softmax of the
unmodified logits), which is what vLLM V1 returns by default (``logprobs_mode=raw_logprobs``),
so a trajectory's logprobs mean the same thing whichever backend produced the turn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.runtime.types import InvalidArgument, SamplingParams


@dataclass
class Sampler:
    """How one request picks its tokens; owns the request's random generator."""

    temperature: float
    top_p: float
    top_k: int
    generator: torch.Generator | None

    @classmethod
    def create(cls, sampling: SamplingParams, seed: int | None, device: torch.device) -> Sampler:
        generator = None
        if sampling.temperature > 0:
            generator = torch.Generator(device=device)
            if seed is not None:
                generator.manual_seed(seed)
            else:
                generator.seed()
        return cls(sampling.temperature, sampling.top_p, sampling.top_k, generator)


def validate_request(sampling: SamplingParams, max_tokens: int, prompt_ids: list[int],
                     vocab_size: int) -> None:
    """Reject what would make the model misbehave, before it is queued."""
    sampling.validate()
    if max_tokens <= 0:
        raise InvalidArgument(f"max_tokens must be > 0, got {max_tokens}",
                              "INVALID_SAMPLING_PARAMS", "max_tokens")
    if not prompt_ids:
        raise InvalidArgument("prompt_ids must not be empty", "EMPTY_PROMPT", "prompt_ids")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"prompt token id {bad[0]} is outside the vocabulary "
                              f"[0, {vocab_size})", "INVALID_TOKEN_ID", "prompt_ids")
    bad = [t for t in sampling.stop_token_ids if t >= vocab_size]
    if bad:
        raise InvalidArgument(f"stop token id {bad[0]} is outside the vocabulary",
                              "INVALID_SAMPLING_PARAMS", "sampling.stop_token_ids")


def sample(logits: torch.Tensor, samplers: list[Sampler]) -> tuple[list[int], list[float]]:
    """Pick one token per row of ``logits`` ``[B, vocab]``; return tokens and raw logprobs."""
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    tokens: list[int] = []
    for row, sampler in enumerate(samplers):
        tokens.append(_sample_row(logits[row], sampler))
    index = torch.tensor(tokens, device=logits.device).unsqueeze(1)
    picked = raw_logprobs.gather(1, index).squeeze(1).tolist()
    return tokens, picked


def _sample_row(logits: torch.Tensor, sampler: Sampler) -> int:
    if sampler.temperature == 0:
        return int(torch.argmax(logits).item())
    scaled = logits / sampler.temperature
    if 0 < sampler.top_k < scaled.numel():
        kth = torch.topk(scaled, sampler.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if sampler.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the first token).
        remove = cumulative - torch.softmax(sorted_logits, dim=-1) >= sampler.top_p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(0, order, sorted_logits)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=sampler.generator).item())
