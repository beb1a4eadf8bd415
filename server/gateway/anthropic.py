"""Anthropic Messages (``POST /v1/messages``): the dialect's four role functions (``parse``,
``respond``, ``stream``, ``error_body``; see ``routes.DIALECTS``), plus ``count_tokens``.

A user message's ``tool_result`` blocks become tool results (in order, before its text; their
image, document or tool-reference parts said in words), an assistant message's ``tool_use``
blocks its tool calls; ``thinking`` / ``redacted_thinking``
blocks are dropped (the model's reasoning is in its exact ids already). A ``system`` message
inside ``messages`` (Claude Code puts its reminders there, anywhere in the conversation) is a
system message at that place; one with no text (a directive-only entry) carries nothing to
render. An answer whose model reasoned (``<think>``) starts with a ``thinking`` block.
Streaming sends ``message_start``, per block ``content_block_start`` / ``_delta``
(``thinking_delta``, ``text_delta`` or ``input_json_delta``) / ``_stop``, ``message_delta``
with the stop reason and usage, then ``message_stop``, each as a named server-sent event.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from rollout.server.gateway.conversation import Piece, ServedTurn, TextDelta
from rollout.server.gateway.messages import (
    BadRequest,
    CallItem,
    ChatRequest,
    Message,
    RequestLimits,
    check_counts,
    check_sampling,
    function_schema,
    opt_int,
    read_metadata,
    read_stop,
    text_of,
    tool_list,
)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def parse(body: Mapping[str, Any], limits: RequestLimits,
          previous: list[Message] | None = None, *, count_only: bool = False) -> ChatRequest:
    """``count_only``: a ``count_tokens`` body (no ``max_tokens``)."""
    raw = body.get("messages")
    if not isinstance(raw, list):
        raise BadRequest("messages must be a list", param="messages")
    tools = _tools(body.get("tools"))
    check_counts(len(raw), len(tools), limits)
    messages: list[Message] = []
    system = body.get("system")
    if system is not None:
        messages.append(Message("system", text_of(system, "system")))
    for i, m in enumerate(raw):
        _add(messages, m, f"messages[{i}]")
    check_sampling(body)
    max_tokens = opt_int(body, "max_tokens", 1, 1 << 24)
    if max_tokens is None and not count_only:
        raise BadRequest("max_tokens is required", param="max_tokens")
    thinking = body.get("thinking")
    if thinking is not None and not isinstance(thinking, Mapping):
        raise BadRequest("thinking must be an object", param="thinking")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", param="stream")
    return ChatRequest(messages=messages, tools=tools, tool_choice=_tool_choice(
        body.get("tool_choice")), max_tokens=max_tokens,
        stop=read_stop(body.get("stop_sequences"), limits, "stop_sequences"),
        model=str(body.get("model") or ""), stream=stream,
        metadata=read_metadata(body.get("metadata")))


def _add(messages: list[Message], m: Any, param: str) -> None:
    if not isinstance(m, Mapping) or m.get("role") not in ("user", "assistant", "system"):
        raise BadRequest(f"{param} must be an object with role user, assistant or system",
                         param=param)
    role, content = m["role"], m.get("content")
    if role == "system":
        messages.append(Message("system", _system_text(content, f"{param}.content")))
        return
    if isinstance(content, str):
        messages.append(Message(role, content))
        return
    if not isinstance(content, list):
        raise BadRequest(f"{param}.content must be a string or a list of blocks",
                         param=f"{param}.content")
    texts: list[str] = []
    calls: list[CallItem] = []
    for j, block in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            name, call_id = block.get("name"), block.get("id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise BadRequest(f"{where} needs id and name strings", param=where)
            arguments = block.get("input") if block.get("input") is not None else {}
            if not isinstance(arguments, Mapping):
                raise BadRequest(f"{where}.input must be an object", param=f"{where}.input")
            calls.append(CallItem(call_id, name, json.dumps(arguments, ensure_ascii=False)))
        elif kind == "tool_result" and role == "user":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise BadRequest(f"{where}.tool_use_id must be a string", param=where)
            text = text_of(_result_parts(block.get("content")), f"{where}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            messages.append(Message("tool", text, tool_call_id=call_id))
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise BadRequest(f"{where} has type {kind!r}; this gateway takes text, tool_use "
                             "and tool_result blocks", param=where, code="unsupported_content")
    if texts or calls or role == "assistant":
        messages.append(Message(role, "".join(texts), tuple(calls)))


def _result_parts(content: Any) -> Any:
    """A tool result's content with its non-text parts (an image a tool read, a tool
    reference from a tool search) said in words: a text model cannot take them, and refusing
    the request would end the harness over what a tool returned."""
    if not isinstance(content, list):
        return content
    out: list[Any] = []
    for part in content:
        kind = part.get("type", "text") if isinstance(part, Mapping) else "text"
        if kind == "tool_reference" and isinstance(part.get("tool_name"), str):
            out.append({"type": "text", "text": f"[tool {part['tool_name']}]"})
        elif kind in ("image", "document", "search_result", "tool_reference"):
            out.append({"type": "text", "text": f"[{kind} omitted]"})
        else:
            out.append(part)
    return out


def _system_text(content: Any, param: str) -> str:
    """A system message's text: a string or text blocks (others, e.g. a directive-only
    entry's, carry nothing to render)."""
    if isinstance(content, list):
        return text_of([b for b in content if isinstance(b, Mapping)
                        and b.get("type", "text") == "text"], param)
    return text_of(content, param)


def _tools(raw: Any) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tool_list(raw)):
        if not isinstance(t, Mapping):
            raise BadRequest(f"tools[{i}] must be an object", param=f"tools[{i}]")
        if t.get("type") not in (None, "custom"):
            continue  # server tools (web search, ...) cannot run here
        out.append(function_schema(t.get("name"), t.get("description"), t.get("input_schema"),
                                   f"tools[{i}]"))
    return out


def _tool_choice(raw: Any) -> str:
    if not isinstance(raw, Mapping):
        return "auto"
    kind = raw.get("type")
    if kind == "tool" and isinstance(raw.get("name"), str):
        return str(raw["name"])
    return {"any": "required", "none": "none"}.get(str(kind), "auto")


def _blocks(answer: ServedTurn) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if answer.reasoning:
        out.append({"type": "thinking", "thinking": _unwrap(answer.reasoning),
                    "signature": ""})
    if answer.content:
        out.append({"type": "text", "text": answer.content})
    for c in answer.tool_calls:
        out.append({"type": "tool_use", "id": c.id, "name": c.name,
                    "input": c.parsed_arguments()})
    return out


def _unwrap(reasoning: str) -> str:
    """The reasoning's text without the template's think tags."""
    text = reasoning.strip()
    for tag in ("<think>", "</think>"):
        text = text.replace(tag, "")
    return text.strip()


def respond(answer: ServedTurn, request: ChatRequest, model: str, answer_id: str,
            ) -> dict[str, Any]:
    return {"id": answer_id, "type": "message", "role": "assistant",
            "model": model, "content": _blocks(answer),
            "stop_reason": STOP_REASONS[answer.finish_reason], "stop_sequence": None,
            "usage": {"input_tokens": answer.prompt_tokens,
                      "output_tokens": answer.completion_tokens}}


async def stream(pieces: AsyncIterator[Piece], request: ChatRequest, model: str,
                 answer_id: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """Messages stream events: the text block's deltas as they are generated, then the
    remaining blocks (thinking, tool uses) whole at the end."""
    opened = False
    index = 0
    async for piece in pieces:
        if isinstance(piece, TextDelta):
            if not opened:
                opened = True
                yield _message_start(request, model, answer_id, piece.prompt_tokens)
                yield "content_block_start", {"type": "content_block_start", "index": 0,
                                              "content_block": {"type": "text", "text": ""}}
            yield "content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": {"type": "text_delta", "text": piece.text}}
            continue
        answer = piece
        blocks = _blocks(answer)
        if opened:  # the text block went out as it came; no thinking block precedes it
            yield "content_block_stop", {"type": "content_block_stop", "index": 0}
            index = 1
            blocks = [b for b in blocks if b["type"] == "tool_use"]
        else:
            yield _message_start(request, model, answer_id, answer.prompt_tokens)
        for block in blocks:
            start: dict[str, Any]
            if block["type"] == "thinking":
                start = {"type": "thinking", "thinking": "", "signature": ""}
                delta = {"type": "thinking_delta", "thinking": block["thinking"]}
            elif block["type"] == "text":
                start = {"type": "text", "text": ""}
                delta = {"type": "text_delta", "text": block["text"]}
            else:
                start = {**block, "input": {}}
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            yield "content_block_start", {"type": "content_block_start", "index": index,
                                          "content_block": start}
            yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                          "delta": delta}
            yield "content_block_stop", {"type": "content_block_stop", "index": index}
            index += 1
        yield "message_delta", {"type": "message_delta", "delta": {
            "stop_reason": STOP_REASONS[answer.finish_reason], "stop_sequence": None},
            "usage": {"output_tokens": answer.completion_tokens}}
        yield "message_stop", {"type": "message_stop"}


def _message_start(request: ChatRequest, model: str, answer_id: str,
                   prompt_tokens: int) -> tuple[str, dict[str, Any]]:
    return "message_start", {"type": "message_start", "message": {
        "id": answer_id, "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}


def error_body(status: int, code: str, message: str, param: str = "") -> dict[str, Any]:
    fallback = "invalid_request_error" if status < 500 else "api_error"
    kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
            429: "rate_limit_error", 503: "overloaded_error"}.get(status, fallback)
    return {"type": "error", "error": {"type": kind, "message": message}}
