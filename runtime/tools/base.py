"""The tool interface the agent loop drives: a JSON-schema description plus an async call."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class ToolCall:
    """A call parsed out of model text."""

    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    """A call that could not be parsed; becomes an error observation for the model."""

    message: str
    raw: str = ""


@dataclass
class ToolResult:
    """What a tool returns to the model."""

    output: str
    is_error: bool = False
    finish: bool = False
    """True for the finish/submit tool: the agent loop stops after this call."""


@runtime_checkable
class Tool(Protocol):
    name: str
    description: str
    parameters: Mapping[str, Any]
    """JSON schema of the arguments object."""

    async def __call__(self, arguments: Mapping[str, Any]) -> ToolResult: ...


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI/Hermes function schema that goes into the system prompt."""
    return {"type": "function", "function": {
        "name": tool.name, "description": tool.description, "parameters": dict(tool.parameters)}}


DEFAULT_SIGNALS = ("env", "--default-signal=INT,QUIT")
"""Prefix of every tool process's command line. A server started in a script's background
(`rollout serve &`, nohup) ignores SIGINT, and children inherit that: without the reset, Ctrl-C
(bash) and kernel interrupts (IPython) on a timed-out command would do nothing. A prefix instead of
a preexec_fn keeps Popen on vfork (no Python-level fork in the server)."""
