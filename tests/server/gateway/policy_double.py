"""TEST DOUBLE: a policy whose reply is a function of the prompt, recording every generation.

The gateway's chain rules are about which prompt each generation saw and which turn owns its
tokens; a reply that depends only on the prompt makes the trajectory of a set of requests
independent of the order they were sent in, so two interleavings can be compared token for
token. ``gate`` holds every generation until released, so a test can see how many run at once.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rollout.runtime.llm import GenerateRequest, GenerateResult


@dataclass
class PromptPolicy:
    tok: Any
    end_of_turn_id: int
    replies: deque[str] = field(default_factory=deque)
    """Scripted replies, used first (in order); then the prompt's digest."""
    calls: list[tuple[list[int], list[int]]] = field(default_factory=list)
    """(prompt ids, output ids) of every generation that completed."""
    asked: list[int] = field(default_factory=list)
    """``max_tokens`` of every generation started, in the order they started."""
    prompts: list[list[int]] = field(default_factory=list)
    """Prompt ids of every generation started, in the order they started."""
    gate: asyncio.Event | None = None
    started: int = 0
    in_flight: int = 0
    peak: int = 0
    cancelled: int = 0
    model_name: str = "policy-double"

    @property
    def tokenizer(self) -> Any:
        return self.tok

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.started += 1
        self.asked.append(request.max_tokens)
        self.prompts.append(list(request.prompt_ids))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            else:
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1
        prompt = list(request.prompt_ids)
        if self.replies:
            text = self.replies.popleft()
        else:
            text = "reply " + hashlib.sha256(repr(prompt).encode()).hexdigest()[:8]
        ids = [*self.tok.encode(text, add_special_tokens=False), self.end_of_turn_id]
        ids = ids[:request.max_tokens]
        # Distinct values per position, so a test can see logprobs are the sampled tokens' own.
        logprobs = [-0.01 * (k + 1) for k in range(len(ids))]
        self.calls.append((prompt, ids))
        return GenerateResult(ids, logprobs, "stop", 0, "double")
