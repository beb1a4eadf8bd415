"""Token sampling for the in-process engine: one batched step over rows with their own
temperature, top-k, top-p, seed and logprobs mode.

Which logprob a turn records (``SamplingParams.logprobs_mode``):

``processed`` (default)
    The log-probability of the sampled token under the distribution it was drawn from: logits
    divided by the temperature, top-k then top-p applied (tokens outside the kept set get
    ``-inf``), log-softmax over what is left. This is vLLM V1's ``--logprobs-mode
    processed_logprobs`` (``vllm/v1/sample/sampler.py``: logprobs taken after temperature and
    top-k/top-p), so both backends hand a trainer the behaviour policy's numbers.
``raw``
    Log-softmax of the unmodified logits (vLLM's default ``raw_logprobs``).

Greedy rows (temperature below ``GREEDY_EPS``) pick the argmax. The distribution they "sample"
from is a point mass, whose logprob (always 0) would tell a trainer nothing, so a greedy row
records what vLLM's processed mode records for it: the log-softmax of the logits at temperature 1
with no top-k / top-p (vLLM's ``SamplingParams`` resets both for temperature 0, and its sampler
takes an all-greedy batch's processed logprobs straight from the logits). That equals the raw
logprob. Greedy turns are for evaluation; an importance ratio over them is not meaningful.

Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (at least one
token), computed on the top-k-filtered distribution, as vLLM does. Tokens tied with the last
kept value are kept too (the cut is a threshold on the logit, like vLLM's top-k).

The batched step (:func:`sample`) never loops over the vocabulary per row and never syncs with
the device per row. One ``topk`` over the whole batch takes each row's best ``max(PROBE, top-k)``
logits, enough to find every top-k cut and, for a model at usual temperatures, every top-p cut;
the rare row whose nucleus lies beyond that is searched again 8x wider, then sorted whole, alone
(one host check per batch decides whether any row needs it). A comparison against each row's
cut-off logit masks the batch in vocabulary order, and one ``tolist`` brings tokens and logprobs
back. Draws are inverse-CDF in vocabulary order with one uniform per row from the row's own
generator, so a seeded row gives the same token whatever else shares its batch (the order and
the uniform do not depend on the other rows).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from rollout.runtime.types import InvalidArgument, SamplingParams

GREEDY_EPS = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``): dividing by them overflows."""


@dataclass
class Sampler:
    """How one request picks its tokens; owns the request's random stream."""

    temperature: float
    top_p: float
    top_k: int
    rng: random.Random | None
    """One uniform per sampled token comes from here; None for greedy rows."""
    raw_logprobs: bool = False
    top_logprobs: int = 0
    """How many most likely tokens (with their logprobs) to report per step; 0: none."""

    @classmethod
    def create(cls, sampling: SamplingParams, seed: int | None,
               device: torch.device | None = None, top_logprobs: int = 0) -> Sampler:
        """``device`` is accepted for symmetry with the engine; draws happen on the host."""
        rng = None
        if sampling.temperature >= GREEDY_EPS:
            rng = random.Random(seed)  # None seeds from the OS
        return cls(sampling.temperature, sampling.top_p, sampling.top_k, rng,
                   sampling.logprobs_mode == "raw", top_logprobs)

    @property
    def greedy(self) -> bool:
        return self.rng is None

    @property
    def logprobs_kind(self) -> str:
        return "raw" if self.raw_logprobs else "processed"

    def uniform(self) -> float:
        """A draw in (0, 1]: never 0, so the inverse CDF never lands on a zero-mass token."""
        assert self.rng is not None
        return 1.0 - self.rng.random()


def validate_request(sampling: SamplingParams, max_tokens: int, prompt_ids: list[int],
                     vocab_size: int, top_logprobs: int = 0) -> None:
    """Reject what would make the model misbehave, before it is queued."""
    sampling.validate()
    if not 0 <= top_logprobs <= vocab_size:
        raise InvalidArgument(f"top_logprobs must be in [0, {vocab_size}] (the vocabulary), "
                              f"got {top_logprobs}", "INVALID_SAMPLING_PARAMS", "top_logprobs")
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


PROBE = 1024
"""How many of a row's best logits the top-p search looks at first. A nucleus that needs more
(a flat distribution) sends its row to a search 8x wider, then to a full sort; with a model at
usual temperatures the nucleus is far smaller, and a full-vocabulary sort of a whole batch costs
seconds on a CPU."""


def processed_logits(logits: torch.Tensor, temperature: list[float], top_k: list[int],
                     top_p: list[float]) -> torch.Tensor:
    """Logits of the distribution each row samples from: ``[B, vocab]``, removed tokens -inf.

    Per row: ``temperature`` (greedy rows pass 1), ``top_k`` (0: off), ``top_p`` (1: off). The
    parameters arrive as host lists so deciding what to compute never waits for the device.
    Rows keep vocabulary order; only the search for each row's cut-off logit sorts: one
    ``topk`` over the batch, and a sort of just the rows whose nucleus lies beyond it.
    """
    device = logits.device
    scaled = logits.float() / torch.tensor(temperature, dtype=torch.float32,
                                           device=device).unsqueeze(1)
    vocab = scaled.shape[1]
    k_of = [k if 0 < k < vocab else vocab for k in top_k]
    use_p = [p < 1.0 for p in top_p]
    filtering = [k < vocab or u for k, u in zip(k_of, use_p, strict=True)]
    if not any(filtering):
        return scaled
    probe = min(vocab, max([PROBE] + [k for k in k_of if k < vocab]))
    k_t = torch.tensor(k_of, device=device).unsqueeze(1)
    p_t = torch.tensor([p if u else float("inf") for p, u in zip(top_p, use_p, strict=True)],
                       dtype=torch.float32, device=device).unsqueeze(1)
    values = torch.topk(scaled, probe, dim=-1).values  # sorted, best first
    # Each row's normaliser: over its top-k when that fits in the probe, else the full row.
    log_z = torch.logsumexp(values.masked_fill(
        torch.arange(probe, device=device).unsqueeze(0) >= k_t, float("-inf")), dim=-1)
    if any(k == vocab and u for k, u in zip(k_of, use_p, strict=True)):
        log_z = torch.where(k_t.squeeze(1) >= vocab, torch.logsumexp(scaled, dim=-1), log_z)
    threshold, reached = _cut_off(values, log_z.unsqueeze(1), k_t, p_t)
    # A nucleus that did not fit in the probe: look again, 8x wider, in just those rows, and
    # sort them whole only when even that falls short (flat distributions; see PROBE).
    short = ~reached & (k_t.squeeze(1) > probe) & torch.isfinite(p_t.squeeze(1))
    while probe < vocab and bool(short.any()):
        rows = short.nonzero().squeeze(1)
        probe = min(vocab, probe * 8)
        wider = torch.topk(scaled[rows], probe, dim=-1).values if probe < vocab else \
            torch.sort(scaled[rows], dim=-1, descending=True).values
        found, got = _cut_off(wider, log_z[rows].unsqueeze(1), k_t[rows], p_t[rows])
        threshold[rows] = found
        short = torch.zeros_like(short).index_fill(0, rows[~got], True)
    threshold = torch.where(torch.tensor(filtering, device=device).unsqueeze(1), threshold,
                            float("-inf"))
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def _cut_off(values: torch.Tensor, log_z: torch.Tensor, k: torch.Tensor, p: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's last kept logit, from its best logits ``values`` (sorted, best first):
    within the top ``k``, the smallest prefix whose mass (normalised by ``log_z``) reaches
    ``p``. Also whether the prefix's mass reached ``p`` within ``values``."""
    rank = torch.arange(values.shape[1], device=values.device).unsqueeze(0)
    in_top_k = rank < k
    probs = torch.exp(values - log_z).masked_fill(~in_top_k, 0.0)
    cumulative = probs.cumsum(-1)
    # Exclusive cumulative mass: the mass of the tokens ranked strictly above each one.
    keep = (cumulative - probs < p) & in_top_k
    kept = keep.sum(-1, keepdim=True).clamp(min=1)
    return values.gather(1, kept - 1), cumulative[:, -1] >= p.squeeze(1)


TopLogprobs = list[tuple[int, float]]
"""One step's most likely tokens, ``(token id, logprob)`` best first."""


def sample(logits: torch.Tensor, samplers: list[Sampler],
           ) -> tuple[list[int], list[float], list[TopLogprobs]]:
    """Pick one token per row of ``logits`` ``[B, vocab]``; return tokens, their logprobs
    (processed or raw per row, see the module docstring) and, for each row whose sampler asks
    for ``top_logprobs=k``, the ``k`` most likely tokens under that same distribution (empty
    for the others). One host sync for the batch, two when a row wants its top tokens."""
    device = logits.device
    greedy = [s.greedy for s in samplers]
    processed = processed_logits(
        logits, [1.0 if g else s.temperature for s, g in zip(samplers, greedy, strict=True)],
        [0 if g else s.top_k for s, g in zip(samplers, greedy, strict=True)],
        [1.0 if g else s.top_p for s, g in zip(samplers, greedy, strict=True)])
    logprobs = torch.log_softmax(processed, dim=-1)
    if all(greedy):
        tokens = torch.argmax(logits, dim=-1)
    else:
        # Inverse CDF in vocabulary order: the first token whose cumulative mass reaches u * total.
        uniforms = torch.tensor([0.5 if g else s.uniform() for s, g in zip(samplers, greedy,
                                                                           strict=True)],
                                dtype=torch.float32, device=device)
        cdf = logprobs.exp().cumsum(-1)
        total = cdf[:, -1:]
        # Clamped below so a draw rounded to 0 cannot pick a leading zero-mass token.
        target = torch.minimum(uniforms.unsqueeze(1) * total, total).clamp(
            min=torch.finfo(torch.float32).tiny)
        drawn = torch.searchsorted(cdf, target).squeeze(1).clamp(max=cdf.shape[1] - 1)
        is_greedy = torch.tensor(greedy, device=device)
        tokens = torch.where(is_greedy, torch.argmax(logits, dim=-1), drawn)
    index = tokens.unsqueeze(1)
    if any(s.raw_logprobs for s in samplers):
        wants_raw = torch.tensor([s.raw_logprobs for s in samplers], device=device)
        logprobs = torch.where(wants_raw.unsqueeze(1),
                               torch.log_softmax(logits.float(), dim=-1), logprobs)
    picked = logprobs.gather(1, index).squeeze(1)
    tops: list[TopLogprobs] = [[] for _ in samplers]
    widest = max(s.top_logprobs for s in samplers)
    if widest:
        # One topk for the batch over the very values the sampled logprob is read from, so
        # the sampled token's entry (where it ranks in the top k) is its logprob exactly.
        best = torch.topk(logprobs, widest, dim=-1)
        ids, values = best.indices.tolist(), best.values.tolist()
        tops = [list(zip(ids[row][:s.top_logprobs], values[row][:s.top_logprobs], strict=True))
                for row, s in enumerate(samplers)]
    return tokens.tolist(), picked.tolist(), tops
