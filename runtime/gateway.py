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

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from rollout.runtime.llm import LLMClient
from rollout.runtime.types import JobSpec, Segment, SegmentReason, Turn

__all__ = ["SEGMENTS_KEY", "GatewayLease", "HarnessCapture", "ModelGateway", "Segment",
           "SegmentReason"]

SEGMENTS_KEY = "gateway.segments"
"""``ctx.state`` key of the live segment list (beside ``agent_loop.TURNS_KEY``'s turns), so a
RUN cut by its timeout or a cancel still delivers the captured turns split as captured."""


@dataclass
class HarnessCapture:
    """Everything the gateway recorded for one job, in request order."""

    turns: list[Turn] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    requests: int = 0
    """Model requests served (a refused or failed request is not a turn)."""
    seed: int | None = None
    """The seed the job's first request was sampled with (request k: seed + k)."""


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

    def capture(self, lease: GatewayLease) -> HarnessCapture:
        """The lease's live capture: its lists grow as requests are served (put ``turns`` and
        ``segments`` into ``ctx.state`` so a RUN that is cut off keeps them)."""
        ...

    async def close(self, lease: GatewayLease) -> HarnessCapture:
        """Stop serving the lease (its key is refused from now on) and return what it captured."""
        ...
