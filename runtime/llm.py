"""The LLM interface the agent loop talks to.

``runtime`` defines it; ``server`` implements it (the backend pool over the in-process
transformers engine and vLLM servers). Everything is token IDs: the agent loop never sends
text to the model and never re-tokenizes what the model produced.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rollout.runtime.types import SamplingParams


class LLMUnavailable(RuntimeError):
    """No backend could serve the request (all ejected, or retries exhausted). Recoverable."""

    reason = "BACKEND_UNAVAILABLE"
    """UPPER_SNAKE reason of the job error this becomes."""


class TurnPreempted(LLMUnavailable):
    """Weight swaps cut every attempt of one turn (each ``finish_reason="preempted"``): the
    agent loop gave up re-issuing it, so the job fails instead of training on mixed policies."""

    reason = "TURN_PREEMPTED"


@dataclass(frozen=True)
class GenerateRequest:
    """One LLM turn."""

    prompt_ids: Sequence[int]
    """The whole prompt of this turn (turn k's prompt + output + the new message tokens)."""
    sampling: SamplingParams
    max_tokens: int
    """Tokens to generate at most in this turn (already clipped to the remaining budget)."""
    session_id: str
    """The trajectory (job) id: all turns of one session go to one backend, which keeps the
    session's KV cache so turn k+1 only prefills the new tokens."""
    group_id: str = ""
    """Samples of one group share their prompt prefix; the pool prefers to co-locate them."""
    min_policy_version: int = 0
    seed: int | None = None
    """Seed for this turn (the loop derives it from the job seed and the turn index)."""
    timeout_s: float | None = None
    """Stop generating after this many seconds and return what was generated so far with
    ``finish_reason="deadline"``: the job's RUN deadline, so a turn cut by it keeps its tokens
    (and their logprobs) instead of being thrown away."""
    top_logprobs: int = 0
    """Also return, per output token, this many most likely tokens and their logprobs
    (:attr:`GenerateResult.top_logprobs`): what an API's ``top_logprobs`` asks for. 0: none."""


@dataclass(frozen=True)
class GenerateResult:
    output_ids: list[int]
    logprobs: list[float]
    """Log-probability of each sampled token; same length as ``output_ids``."""
    finish_reason: str
    """``stop`` (end-of-turn or stop token/string), ``length`` (max_tokens), ``deadline``
    (``timeout_s`` ran out; the partial output is kept), ``preempted`` (cut by a weight swap's
    drain timeout: the turn mixes policies, so the loop re-issues it rather than scoring it) or
    ``abort`` (cancelled)."""
    policy_version: int
    backend: str
    """Name of the backend that served the turn."""
    logprobs_kind: str = "processed"
    """What ``logprobs`` are: ``processed`` (under the sampled distribution) or ``raw``
    (log-softmax of the unmodified logits); see :attr:`SamplingParams.logprobs_mode`."""
    routed_experts: list[int] = field(default_factory=list)
    """For a mixture-of-experts model whose backend reports routing: per output token, the
    experts chosen in each MoE layer at the position that produced it, flattened
    ``[token][layer][k]``; empty otherwise."""
    routed_expert_top_k: int = 0
    routed_expert_layers: int = 0
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per output token, when the request asked for ``top_logprobs=k``: the ``k`` most likely
    tokens of the distribution it was sampled from, as ``(token id, logprob)`` best first, in
    the same kind as :attr:`logprobs` (the sampled token's entry, where it ranks in the top
    ``k``, equals its logprob). Empty otherwise. Answers to an API; never in a trajectory."""


@runtime_checkable
class LLMClient(Protocol):
    """What the agent loop needs from the model side."""

    @property
    def tokenizer(self) -> Any:
        """The served model's Hugging Face tokenizer (renders new chat messages to ids)."""
        ...

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Run one turn. Raises :class:`LLMUnavailable` when no backend can serve it."""
        ...

    async def end_session(self, session_id: str) -> None:
        """The trajectory is done: free its cached KV and its sticky route."""
        ...


async def stream_generate(llm: LLMClient, request: GenerateRequest,
                          ) -> AsyncGenerator[GenerateResult, None]:
    """Run one turn as it is generated: each piece holds the tokens (and their logprobs)
    sampled since the previous piece, ``finish_reason=""`` on every piece but the last. The
    pieces' ``output_ids`` (and ``logprobs``) joined are exactly the turn :meth:`generate`
    would have returned, so a caller that streams records the same turn.

    A client with a ``generate_stream`` method (the backend pool) streams; any other
    :class:`LLMClient` gives its whole turn as one piece."""
    streaming = getattr(llm, "generate_stream", None)
    if streaming is None:
        yield await llm.generate(request)
        return
    async for piece in streaming(request):
        yield piece
