"""One conversation model under the three wire formats (OpenAI chat, Responses, Anthropic).

Each API's request is read into a :class:`ChatRequest` of :class:`Message` values; the token
accounting (``conversation.py``) sees only these. A message's :meth:`Message.key` is what
"the harness sent the same message again" means: role, text, and tool calls by name and
parsed arguments (not by id, and not by the JSON spelling a client re-serialised), so a
harness that echoes the assistant message it got back in its own wire format still extends
the conversation.

Everything a client sends is bounded here (:class:`RequestLimits`); a value out of range is a
:class:`BadRequest` that names the field, which each API turns into its own error JSON.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class BadRequest(ValueError):
    """The request is malformed or out of bounds; the message says what to fix."""

    def __init__(self, message: str, *, param: str = "", code: str = "invalid_request",
                 status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status


@dataclass(frozen=True)
class RequestLimits:
    """What one request may carry (the job's own limits clip ``max_tokens`` further)."""

    max_body_bytes: int = 8 * 1024 * 1024
    max_messages: int = 2048
    max_tools: int = 256
    max_stop: int = 16
    max_pending: int = 8
    """Requests of one job in flight at once (waiting for a generation slot or generating);
    more get 429 so a runaway harness cannot pile up work and memory in the server."""


@dataclass(frozen=True)
class CallItem:
    """One tool call inside an assistant message."""

    id: str
    name: str
    arguments: str
    """The arguments as JSON text (what every wire format carries)."""

    def parsed_arguments(self) -> dict[str, Any]:
        try:
            value = json.loads(self.arguments) if self.arguments.strip() else {}
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's limit
            return {"arguments": self.arguments}
        return value if isinstance(value, dict) else {"arguments": value}

    def key(self) -> tuple[str, str]:
        if len(self.arguments) <= MEMO_ARGUMENTS_CHARS:
            return self.name, _canonical_memo(self.arguments)
        return self.name, _canonical(self.arguments)


def _canonical(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments or "{}"), sort_keys=True)
    except (ValueError, RecursionError):  # kept as the text it is
        return arguments


MEMO_ARGUMENTS_CHARS = 4096
"""Arguments this short have their canonical form memoized: a harness resends every earlier
call with each request, so the same texts are read again and again."""
_canonical_memo = functools.lru_cache(maxsize=2048)(_canonical)


@dataclass(frozen=True)
class Message:
    role: str
    content: str = ""
    tool_calls: tuple[CallItem, ...] = ()
    tool_call_id: str = ""
    """For ``tool`` messages: the call this result answers."""
    name: str = ""

    def key(self) -> tuple[Any, ...]:
        # Clients drop or add surrounding whitespace of assistant text when they echo it.
        text = self.content.strip() if self.role == "assistant" else self.content
        return (self.role, text, tuple(c.key() for c in self.tool_calls), self.tool_call_id,
                self.name if self.role != "assistant" else "")


@dataclass
class ChatRequest:
    """A model request in API-neutral form."""

    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)
    """Function schemas as ``{"type": "function", "function": {name, description,
    parameters}}`` (what chat templates and the tool-call formats take)."""
    tool_choice: str = "auto"
    """``auto``, ``none``, ``required`` or a function name."""
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    model: str = ""
    stream: bool = False
    metadata: dict[str, str] = field(default_factory=dict)
    """The request's ``metadata`` object, string values only (what side-call rules read)."""
    include_usage: bool = False
    """A stream ends with the usage (chat's ``stream_options.include_usage``)."""
    logprobs: int | None = None
    """``None``: no logprobs in the answer; ``k``: the sampled tokens' logprobs, each with the
    ``k`` most likely tokens of its step (the backend is asked for them)."""

    def tools_key(self) -> str:
        return json.dumps(self.tools, sort_keys=True)

    def system_text(self) -> str:
        """The request's system prompt: its system messages, joined by a blank line."""
        return "\n\n".join(m.content for m in self.messages if m.role == "system")

    def last_user_text(self) -> str:
        """The final user message's text (what a side-call rule's ``last_user`` pattern is
        searched in): the last message that is not a system message, when it is the user's,
        else ``""`` (a tool result or an assistant message ends the request). System messages
        after it are passed over: Claude Code sends context of its own (the list of agent
        types) as a system message after a fork's instruction."""
        for message in reversed(self.messages):
            if message.role != "system":
                return message.content if message.role == "user" else ""
        return ""


def read_metadata(value: Any) -> dict[str, str]:
    """A request's ``metadata`` object; entries whose value is not a string are left out
    (nothing here acts on them)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise BadRequest("metadata must be an object", param="metadata")
    return {str(k): v for k, v in list(value.items())[:64] if isinstance(v, str)}


# ----------------------------------------------------------------------------- field readers


def text_of(value: Any, param: str) -> str:
    """Message content as text: a string, null, or a list of text parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if isinstance(part, str):
                parts.append(part)
                continue
            if not isinstance(part, Mapping):
                raise BadRequest(f"{param}[{i}] must be an object", param=f"{param}[{i}]")
            kind = part.get("type", "text")
            if kind in ("text", "input_text", "output_text") and isinstance(
                    part.get("text"), str):
                parts.append(part["text"])
            elif kind == "refusal" and isinstance(part.get("refusal"), str):
                parts.append(part["refusal"])
            else:
                raise BadRequest(f"{param}[{i}] has type {kind!r}; this gateway takes text "
                                 "parts only", param=f"{param}[{i}]", code="unsupported_content")
        return "".join(parts)
    raise BadRequest(f"{param} must be a string or a list of text parts", param=param)


def opt_number(body: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            low <= value <= high):
        raise BadRequest(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}",
                         param=name)
    return float(value)


def opt_int(body: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not (low <= value <= high):
        raise BadRequest(f"{name} must be an integer in [{low}, {high}], got {value!r}",
                         param=name)
    return value


def read_stop(value: Any, limits: RequestLimits, param: str = "stop") -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise BadRequest(f"{param} must be a non-empty string or a list of them", param=param)
    if len(items) > limits.max_stop:
        raise BadRequest(f"{param} has {len(items)} entries; at most {limits.max_stop}",
                         param=param)
    return tuple(items)


def check_sampling(body: Mapping[str, Any]) -> None:
    """Validate the sampling fields a client may send; the job's own sampling is used.

    A trainer computes importance ratios against the distribution it asked the rollout to
    sample from (its spec's temperature, top-p, top-k); a harness that asks for temperature 0
    must not silently change that policy, so these values are checked and then ignored.
    """
    opt_number(body, "temperature", 0.0, 2.0)
    opt_number(body, "top_p", 0.0, 1.0)
    n = body.get("n")
    if n is not None and n != 1:
        raise BadRequest("n must be 1: each request is one turn of the job's trajectory",
                         param="n")


def function_schema(name: Any, description: Any, parameters: Any, param: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{param}.name must be a non-empty string", param=f"{param}.name")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping):
        raise BadRequest(f"{param}.parameters must be a JSON schema object",
                         param=f"{param}.parameters")
    return {"type": "function", "function": {
        "name": name, "description": description if isinstance(description, str) else "",
        "parameters": dict(parameters)}}


def tool_list(raw: Any) -> list[Any]:
    """A request's ``tools`` as a list (empty when absent); each API reads its own entries."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BadRequest("tools must be a list", param="tools")
    return raw


def check_counts(messages: int, tools: int, limits: RequestLimits) -> None:
    """Refuse a request with no messages, or more messages or tools than ``limits`` allow."""
    if not messages:
        raise BadRequest("the request has no messages", param="messages")
    if messages > limits.max_messages:
        raise BadRequest(f"the request has {messages} messages; this gateway takes at "
                         f"most {limits.max_messages}", param="messages", status=413,
                         code="too_many_messages")
    if tools > limits.max_tools:
        raise BadRequest(f"the request has {tools} tools; at most {limits.max_tools}",
                         param="tools", status=413, code="too_many_tools")


def arguments_text(value: Any, param: str) -> str:
    if value is None:
        return "{}"
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return json.dumps(value, ensure_ascii=False)
    raise BadRequest(f"{param} must be a JSON string or object", param=param)
