"""OpenAI Chat Completions (``POST /v1/chat/completions``): the dialect's four role functions
(``parse``, ``respond``, ``stream``, ``error_body``; see ``routes.DIALECTS``).

``logprobs`` gives each sampled token's own logprob (what the trajectory records);
``top_logprobs: k`` (0 to 20, OpenAI's bound) adds the ``k`` most likely tokens of each step as
the backend computed them (same distribution as the sampled logprob), token texts from the
tokenizer. ``-inf`` (a token the sampling settings exclude) is written ``-9999.0``, as OpenAI and
vLLM do: JSON has no infinity.
"""

from __future__ import annotations

import time
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
    arguments_text,
    check_counts,
    check_sampling,
    function_schema,
    opt_int,
    read_metadata,
    read_stop,
    text_of,
    tool_list,
)

MAX_TOKENS_FIELD = 1 << 24


def parse(body: Mapping[str, Any], limits: RequestLimits,
          previous: list[Message] | None = None) -> ChatRequest:
    """``previous`` is the Responses API's; a chat request carries its whole history."""
    raw = body.get("messages")
    if not isinstance(raw, list):
        raise BadRequest("messages must be a list of message objects", param="messages")
    tools = _tools(body.get("tools"))
    check_counts(len(raw), len(tools), limits)
    messages = [_message(m, i) for i, m in enumerate(raw)]
    check_sampling(body)
    max_tokens = opt_int(body, "max_completion_tokens", 1, MAX_TOKENS_FIELD)
    if max_tokens is None:
        max_tokens = opt_int(body, "max_tokens", 1, MAX_TOKENS_FIELD)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise BadRequest("stream_options must be an object", param="stream_options")
    return ChatRequest(messages=messages, tools=tools, tool_choice=_tool_choice(
        body.get("tool_choice")), max_tokens=max_tokens, stop=read_stop(body.get("stop"), limits),
        seed=opt_int(body, "seed", -(2**63), 2**63 - 1), model=str(body.get("model") or ""),
        stream=stream, metadata=read_metadata(body.get("metadata")),
        include_usage=bool(options.get("include_usage")), logprobs=_logprobs(body))


def _logprobs(body: Mapping[str, Any]) -> int | None:
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise BadRequest("logprobs must be a boolean", param="logprobs")
    top = opt_int(body, "top_logprobs", 0, 20)
    if top is not None and not wanted:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


LOGPROB_FLOOR = -9999.0


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": max(logprob, LOGPROB_FLOOR),
            "bytes": list(text.encode())}


def logprob_entries(answer: ServedTurn) -> list[dict[str, Any]]:
    """Each sampled token with its logprob and its step's most likely tokens, in the shape
    both OpenAI APIs use (chat's ``logprobs.content``, Responses' ``output_text.logprobs``)."""
    return [{**_entry(t.text, t.logprob), "top_logprobs": [_entry(o, v) for o, v in t.top]}
            for t in answer.sampled]


def _logprob_content(answer: ServedTurn, request: ChatRequest) -> dict[str, Any] | None:
    if request.logprobs is None:
        return None
    return {"content": logprob_entries(answer), "refusal": None}


def _message(m: Any, i: int) -> Message:
    param = f"messages[{i}]"
    if not isinstance(m, Mapping):
        raise BadRequest(f"{param} must be an object", param=param)
    role = m.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise BadRequest(f"{param}.role must be system, developer, user, assistant or tool, "
                         f"got {role!r}", param=f"{param}.role")
    content = text_of(m.get("content"), f"{param}.content")
    calls: list[CallItem] = []
    raw_calls = m.get("tool_calls") or []
    if role == "assistant" and raw_calls:
        if not isinstance(raw_calls, list):
            raise BadRequest(f"{param}.tool_calls must be a list", param=f"{param}.tool_calls")
        for j, c in enumerate(raw_calls):
            fn = c.get("function") if isinstance(c, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise BadRequest(f"{param}.tool_calls[{j}] needs function.name",
                                 param=f"{param}.tool_calls[{j}]")
            calls.append(CallItem(str(c.get("id") or ""), fn["name"], arguments_text(
                fn.get("arguments"), f"{param}.tool_calls[{j}].function.arguments")))
    tool_call_id = m.get("tool_call_id") or ""
    name = m.get("name") or ""
    if not isinstance(tool_call_id, str) or not isinstance(name, str):
        raise BadRequest(f"{param}.tool_call_id and .name must be strings", param=param)
    return Message(role, content, tuple(calls), tool_call_id, name)


def _tools(raw: Any) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tool_list(raw)):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type", "function") != "function" or not isinstance(
                fn, Mapping):
            raise BadRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                             "{...}}", param=f"tools[{i}]")
        out.append(function_schema(fn.get("name"), fn.get("description"),
                                   fn.get("parameters"), f"tools[{i}].function"))
    return out


def _tool_choice(raw: Any) -> str:
    if raw is None:
        return "auto"
    if raw in ("auto", "none", "required"):
        return str(raw)
    if isinstance(raw, Mapping) and isinstance(raw.get("function"), Mapping):
        return str(raw["function"].get("name") or "auto")
    raise BadRequest("tool_choice must be auto, none, required or {\"type\": \"function\", "
                     "\"function\": {\"name\": ...}}", param="tool_choice")


def _calls(answer: ServedTurn) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in answer.tool_calls]


def _usage(answer: ServedTurn) -> dict[str, int]:
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
            "total_tokens": answer.prompt_tokens + answer.completion_tokens}


def new_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def respond(answer: ServedTurn, request: ChatRequest, model: str, answer_id: str,
            ) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": answer.content or (
        None if answer.tool_calls else "")}
    if answer.tool_calls:
        message["tool_calls"] = _calls(answer)
    return {"id": answer_id, "object": "chat.completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": answer.finish_reason,
                         "logprobs": _logprob_content(answer, request)}],
            "usage": _usage(answer)}


async def stream(pieces: AsyncIterator[Piece], request: ChatRequest, model: str,
                 answer_id: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The answer as ``chat.completion.chunk`` objects (unnamed events), in the order OpenAI
    sends them: the role, the text (as it is generated), each call (id and name first, then
    its arguments), the finish reason, and the usage in a chunk of its own with no choices
    when ``stream_options.include_usage`` asks for it. The route ends the stream with
    ``[DONE]``."""
    base = {"id": answer_id, "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None,
              logprobs: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        return "", {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                         "logprobs": logprobs}]}

    live = False
    async for piece in pieces:
        if isinstance(piece, TextDelta):
            if not live:
                live = True
                yield chunk({"role": "assistant", "content": ""})
            yield chunk({"content": piece.text})
            continue
        answer = piece
        if not live:
            yield chunk({"role": "assistant", "content": ""})
            if answer.content:
                yield chunk({"content": answer.content},
                            logprobs=_logprob_content(answer, request))
        for i, c in enumerate(answer.tool_calls):
            yield chunk({"tool_calls": [{"index": i, "id": c.id, "type": "function",
                                         "function": {"name": c.name, "arguments": ""}}]})
            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": c.arguments}}]})
        yield chunk({}, answer.finish_reason)
        if request.include_usage:
            yield "", {**base, "choices": [], "usage": _usage(answer)}


def error_body(status: int, code: str, message: str, param: str = "") -> dict[str, Any]:
    fallback = "invalid_request_error" if status < 500 else "server_error"
    kind = {401: "authentication_error", 404: "not_found_error",
            429: "rate_limit_error"}.get(status, fallback)
    return {"error": {"message": message, "type": kind, "param": param or None, "code": code}}
