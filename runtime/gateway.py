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

import enum
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from rollout.runtime.llm import LLMClient
from rollout.runtime.types import JobSpec, Turn


class SegmentReason(enum.Enum):
    """Why a trajectory segment began."""

    FIRST = "first"
    """The job's first request."""
    HISTORY_REWRITTEN = "history_rewritten"
    """The request's prompt does not extend what the job already sent and generated (the
    harness summarised, dropped or edited a message), so its tokens start a new sequence."""


@dataclass(frozen=True)
class Segment:
    """One run of turns whose prompts each extend the previous turn's prompt and output."""

    first_turn: int
    """Index into :attr:`HarnessCapture.turns` of the segment's first turn."""
    reason: SegmentReason


@dataclass
class HarnessCapture:
    """Everything the gateway recorded for one job, in request order."""

    turns: list[Turn] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    requests: int = 0
    """Model requests served (a refused or failed request is not a turn)."""


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

    async def open(self, spec: JobSpec, llm: LLMClient) -> GatewayLease:
        """Start serving ``spec``'s job; its requests generate through ``llm``."""
        ...

    async def close(self, lease: GatewayLease) -> HarnessCapture:
        """Stop serving the lease (its key is refused from now on) and return what it captured."""
        ...
