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
