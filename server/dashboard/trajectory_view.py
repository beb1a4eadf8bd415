"""A trajectory laid out for the job page: turns of token runs with their text and marks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rollout.runtime.types import Trajectory
from rollout.server.api.token_text import TurnPieces

SHADE_BOUNDS = (0.9, 0.7, 0.5, 0.3, 0.1)
"""Probability bounds of the logprob shades: a token sampled with p >= 0.9 is unshaded (class
``lp0``), below 0.1 it is darkest (``lp5``)."""


def shade(logprob: float) -> int:
    p = math.exp(logprob) if logprob < 0 else 1.0
    for i, bound in enumerate(SHADE_BOUNDS):
        if p >= bound:
            return i
    return len(SHADE_BOUNDS)


@dataclass(frozen=True)
class Tok:
    id: int
    text: str
    mask: int
    logprob: float | None = None
    """Only for generated tokens."""

    @property
    def shade(self) -> int:
        return shade(self.logprob) if self.logprob is not None else 0

    @property
    def title(self) -> str:
        if self.logprob is None:
            return f"id {self.id} · loss mask 0"
        return (f"id {self.id} · logprob {self.logprob:.3f} (p {math.exp(self.logprob):.2f})"
                " · loss mask 1")


@dataclass(frozen=True)
class Segment:
    kind: str
    """``prompt``, ``output`` or ``observation``."""
    tokens: list[Tok]

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)


@dataclass(frozen=True)
class TurnView:
    index: int
    segments: list[Segment]
    policy_version: int
    finish_reason: str
    backend: str
    latency_s: float
    tool_calls: list[str]
    preempted_retries: int
    mean_logprob: float | None
    counts: dict[str, int] = field(default_factory=dict)


def build(traj: Trajectory, pieces: list[TurnPieces] | None) -> list[TurnView]:
    """Turns for the template; without ``pieces`` (no tokenizer) each token shows its id."""
    out = []
    for i, t in enumerate(traj.turns):
        p = pieces[i] if pieces is not None else None

        def toks(ids: list[int], texts: list[str] | None, mask: int,
                 logprobs: list[float] | None = None) -> list[Tok]:
            return [Tok(tid, texts[k] if texts is not None else f"[{tid}]", mask,
                        logprobs[k] if logprobs is not None and k < len(logprobs) else None)
                    for k, tid in enumerate(ids)]

        segments = [Segment("prompt", toks(t.prompt_ids, p.prompt if p else None, 0)),
                    Segment("output", toks(t.output_ids, p.output if p else None, 1,
                                           t.output_logprobs)),
                    Segment("observation", toks(t.observation_ids,
                                                p.observation if p else None, 0))]
        lps = t.output_logprobs
        out.append(TurnView(
            index=i, segments=[s for s in segments if s.tokens], policy_version=t.policy_version,
            finish_reason=t.finish_reason, backend=t.backend, latency_s=t.latency_s,
            tool_calls=list(t.tool_calls), preempted_retries=t.preempted_retries,
            mean_logprob=sum(lps) / len(lps) if lps else None,
            counts={"prompt": len(t.prompt_ids), "output": len(t.output_ids),
                    "observation": len(t.observation_ids)}))
    return out


def summary(traj: Trajectory) -> dict[str, Any]:
    """Length figures for the group page and job header."""
    generated = sum(len(t.output_ids) for t in traj.turns)
    total = sum(len(t.prompt_ids) + len(t.output_ids) + len(t.observation_ids)
                for t in traj.turns)
    return {"turns": len(traj.turns), "generated": generated, "tokens": total,
            "termination": traj.termination.name, "reward": traj.reward,
            "components": dict(traj.reward_components)}
