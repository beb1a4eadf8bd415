"""The model-gateway interface a harness environment talks to.

"Harness as environment": an unmodified agent (mini-swe-agent, Codex CLI, ...) runs inside the
job's sandbox and calls an OpenAI- or Anthropic-compatible HTTP endpoint. ``runtime`` defines
what a handler needs from that endpoint; ``server`` implements it over the backend pool, so the
token ids the harness's requests produce are captured exactly (never re-tokenized) and become
the job's trajectory.

A handler opens one gateway lease per job in RUN, hands the harness the lease's socket and key,
and closes the lease when the harness has exited. Closing revokes the key: a request that
arrives later (a harness process that outlived RUN) is refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from rollout.runtime.llm import LLMClient
from rollout.runtime.types import JobSpec, Segment, SegmentReason, Turn

__all__ = ["SEGMENTS_KEY", "GatewayLease", "GatewayOptions", "HarnessCapture", "ModelGateway",
           "Segment", "SegmentReason", "SideCallRule"]

SEGMENTS_KEY = "gateway.segments"
"""``ctx.state`` key of the live segment list (beside ``agent_loop.TURNS_KEY``'s turns), so a
RUN cut by its timeout or a cancel still delivers the captured turns split as captured."""


@dataclass
class HarnessCapture:
    """Everything the gateway recorded for one job: its turns grouped by chain (one segment
    each, chains in the order they began), so ``turns`` is not in request order."""

    turns: list[Turn] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    requests: int = 0
    """Model requests served with a generation (a refused, failed or cancelled request is not
    a turn; a retry answered with an earlier generation is not counted again)."""
    seed: int | None = None
    """The seed the job's first request was sampled with (request k: seed + k)."""
    refused: str = ""
    """Why the gateway last refused a request for the job's limits: ``max_turns``,
    ``token_budget`` or ``context_length`` ("" if it never did), so the environment can say
    why a harness stopped."""


@dataclass(frozen=True)
class SideCallRule:
    """Which requests of a harness are side calls: not the agent's work (a title for the
    session, a summary for display, a quota probe), so never trained with the task's reward.

    A matching request gets a chain of its own whose turns carry loss mask 0 on their output
    (``Segment.side_call``). Every field given must match; a rule with no field is refused
    (it would match everything). Patterns are Python regular expressions.
    """

    model: str = ""
    """Matched in full against the request's ``model`` field (``claude-3-5-haiku.*``)."""
    system: str = ""
    """Searched for in the request's system prompt (its system messages, joined by a blank
    line), e.g. ``"(?i)generate a (short )?title"``."""
    metadata: tuple[tuple[str, str], ...] = ()
    """``(key, pattern)`` pairs: the request's ``metadata`` object (OpenAI chat, Anthropic
    Messages) must hold each key with a string value matching its pattern in full."""
    last_user: str = ""
    """Searched for in the request's final message when that is a user message: a harness
    helper that reuses the agent's own system prompt and history is told apart only by the
    instruction it appends (anchor it, ``(?m)^...``, so a task that merely quotes it does not
    match)."""

    def __post_init__(self) -> None:
        if not (self.model or self.system or self.metadata or self.last_user):
            raise ValueError("a side-call rule needs model, system, metadata or last_user: an "
                             "empty rule would mark every request untrained")
        for pattern in (self.model, self.system, self.last_user,
                        *(p for _, p in self.metadata)):
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"side-call pattern {pattern!r} is not a regular "
                                 f"expression: {exc}") from None

    def matches(self, model: str, system: str, metadata: Mapping[str, str],
                last_user: str = "") -> bool:
        if self.model and not re.fullmatch(self.model, model):
            return False
        if self.system and not re.search(self.system, system):
            return False
        if self.last_user and not re.search(self.last_user, last_user):
            return False
        for key, pattern in self.metadata:
            value = metadata.get(key)
            if not isinstance(value, str) or not re.fullmatch(pattern, value):
                return False
        return True


MAX_CONCURRENT_DEFAULT = 4


@dataclass(frozen=True)
class GatewayOptions:
    """What a harness environment (its preset) tells the gateway about one job."""

    side_calls: tuple[SideCallRule, ...] = ()
    """A request matching any of these is a side call (see :class:`SideCallRule`)."""
    max_concurrent: int = MAX_CONCURRENT_DEFAULT
    """Generations of this job that may run at once; more wait (a harness's parallel
    sub-agents overlap up to this many)."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_concurrent <= 64:
            raise ValueError(f"max_concurrent must be in [1, 64], got {self.max_concurrent}")

    def is_side_call(self, model: str, system: str, metadata: Mapping[str, str],
                     last_user: str = "") -> bool:
        return any(rule.matches(model, system, metadata, last_user)
                   for rule in self.side_calls)


@dataclass(frozen=True)
class GatewayLease:
    """One job's way to the gateway."""

    api_key: str
    """The job's capability: the gateway maps it to this job alone and refuses it once the
    lease is closed."""
    socket_path: str
    """Host path of a Unix-domain socket that serves the gateway's HTTP API (``/v1/...``).
    Bind it into the sandbox; nothing else of the host's network is reachable there."""


@runtime_checkable
class ModelGateway(Protocol):
    """What a harness handler needs from the server's model gateway."""

    async def open(self, spec: JobSpec, llm: LLMClient, *,
                   options: GatewayOptions | None = None) -> GatewayLease:
        """Start serving ``spec``'s job; its requests generate through ``llm``; ``options``
        (default: none) say which requests are side calls and how many may generate at
        once."""
        ...

    def capture(self, lease: GatewayLease) -> HarnessCapture:
        """The lease's live capture: its lists grow as requests are served (put ``turns`` and
        ``segments`` into ``ctx.state`` so a RUN that is cut off keeps them)."""
        ...

    async def close(self, lease: GatewayLease) -> HarnessCapture:
        """Stop serving the lease (its key is refused from now on) and return what it captured."""
        ...
