"""An independent reference for logprobs: one full forward over prompt + output (no KV cache,
no batching, no engine code), then temperature, top-k and top-p written out in float64."""

from __future__ import annotations

import math

import torch

from rollout.runtime.llm import GenerateResult
from rollout.runtime.types import SamplingParams


def full_forward_logits(model: torch.nn.Module, prompt: list[int], output: list[int]
                        ) -> torch.Tensor:
    """Logits that predicted each output token, from one uncached forward: ``[len(output), V]``."""
    ids = torch.tensor([prompt + output])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].double()
    return logits[len(prompt) - 1:len(prompt) + len(output) - 1]


def reference_distribution(logits: torch.Tensor, temperature: float, top_k: int,
                           top_p: float) -> dict[int, float]:
    """The kept tokens and their probabilities under softmax(logits / T), top-k, then top-p.

    Written independently of the engine: float64, a Python walk down the sorted tokens that
    stops once the mass of the tokens taken reaches ``top_p``, then renormalised.
    """
    scaled = logits.double() / (temperature if temperature > 0 else 1.0)
    order = torch.argsort(scaled, descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    probs = torch.softmax(scaled[order], dim=0).tolist()
    kept, mass = [], 0.0
    for tok, p in zip(order, probs, strict=True):
        kept.append(tok)
        mass += p
        if mass >= top_p:
            break
    log_z = float(torch.logsumexp(scaled[kept], dim=0))
    return {tok: math.exp(float(scaled[tok]) - log_z) for tok in kept}


def reference_logprob(logits: torch.Tensor, token: int, temperature: float, top_k: int,
                      top_p: float) -> float:
    kept = reference_distribution(logits, temperature, top_k, top_p)
    assert token in kept, f"token {token} was sampled outside the kept set"
    return math.log(kept[token])


def reference_logprobs(model: torch.nn.Module, prompt: list[int], result: GenerateResult,
                       params: SamplingParams) -> list[float]:
    """What each output token's processed logprob must be (see :func:`reference_distribution`)."""
    logits = full_forward_logits(model, prompt, result.output_ids)
    return [reference_logprob(row, tok, params.temperature, params.top_k, params.top_p)
            for row, tok in zip(logits, result.output_ids, strict=True)]


def raw_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> list[float]:
    """Log-softmax of the unmodified logits at each output token."""
    logits = full_forward_logits(model, prompt, output)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output).unsqueeze(1)
                                                ).squeeze(1).tolist()
