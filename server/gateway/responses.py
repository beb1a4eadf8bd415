"""OpenAI Responses (``POST /v1/responses``), the API Codex CLI speaks: the dialect's four role
functions (``parse``, ``respond``, ``stream``, ``error_body``; see ``routes.DIALECTS``).

Input items become messages: ``message`` items by role, ``function_call`` items join the
assistant message before them (as its tool calls), ``function_call_output`` items become tool
results; ``reasoning`` items are dropped (the model's reasoning is in its exact ids already).
Tools other than ``function`` (a hosted ``web_search``, say) cannot run here and are ignored.
``previous_response_id`` names the job's last answer: its conversation is prepended, so a
client that keeps state on the server extends the trajectory as one that resends everything.
Streaming sends the event sequence of the API: ``response.created``, ``response.in_progress``,
per output item ``output_item.added``, its content or argument deltas and ``.done`` events,
``output_item.done``, then ``response.completed``, each with a ``sequence_number``.
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
    text_of,
    tool_list,
)
from rollout.server.gateway.openai_chat import error_body as openai_error_body
from rollout.server.gateway.openai_chat import logprob_entries

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The ``include`` item that asks for the answer's logprobs."""


def parse(body: Mapping[str, Any], limits: RequestLimits,
          previous: list[Message] | None) -> ChatRequest:
    """``previous``: the conversation of the job's last response when the request names it."""
    raw = body.get("input")
    items: Any = [{"type": "message", "role": "user", "content": raw}] \
        if isinstance(raw, str) else raw
    if not isinstance(items, list):
        raise BadRequest("input must be a string or a list of items", param="input")
    tools = _tools(body.get("tools"))
    check_counts(len(items) + len(previous or []), len(tools), limits)
    messages: list[Message] = list(previous or [])
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("instructions must be a string", param="instructions")
        if not (messages and messages[0].role == "system"
                and messages[0].content == instructions):
            messages = [m for m in messages if m.role != "system"]
            messages.insert(0, Message("system", instructions))
    for i, item in enumerate(items):
        _add_item(messages, item, f"input[{i}]")
    check_sampling(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", param="stream")
    return ChatRequest(messages=messages, tools=tools, tool_choice=_tool_choice(
        body.get("tool_choice")), max_tokens=opt_int(body, "max_output_tokens", 1, 1 << 24),
        model=str(body.get("model") or ""), stream=stream, logprobs=_logprobs(body))


def _logprobs(body: Mapping[str, Any]) -> int | None:
    """``include: ["message.output_text.logprobs"]`` or ``top_logprobs`` (0 to 20) asks for
    the output text's logprobs, each token with that many alternatives."""
    include = body.get("include") or []
    if not isinstance(include, list):
        raise BadRequest("include must be a list of strings", param="include")
    top = opt_int(body, "top_logprobs", 0, 20)
    if top is None and LOGPROBS_INCLUDE not in include:
        return None
    return top or 0


def _add_item(messages: list[Message], item: Any, param: str) -> None:
    if not isinstance(item, Mapping):
        raise BadRequest(f"{param} must be an object", param=param)
    kind = item.get("type") or ("message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        role = "system" if role == "developer" else role
        if role not in ("system", "user", "assistant"):
            raise BadRequest(f"{param}.role must be system, developer, user or assistant",
                             param=f"{param}.role")
        messages.append(Message(role, text_of(item.get("content"), f"{param}.content")))
    elif kind == "function_call":
        name, call_id = item.get("name"), item.get("call_id")
        if not isinstance(name, str) or not isinstance(call_id, str):
            raise BadRequest(f"{param} needs name and call_id strings", param=param)
        call = CallItem(call_id, name, arguments_text(item.get("arguments"),
                                                      f"{param}.arguments"))
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant":
            messages[-1] = Message("assistant", last.content, (*last.tool_calls, call))
        else:
            messages.append(Message("assistant", "", (call,)))
    elif kind == "function_call_output":
        output = item.get("output")
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise BadRequest(f"{param}.call_id must be a string", param=f"{param}.call_id")
        messages.append(Message("tool", text_of(output, f"{param}.output"),
                                tool_call_id=call_id))
    elif kind == "reasoning":
        return
    else:
        raise BadRequest(f"{param} has type {kind!r}; this gateway takes message, "
                         "function_call, function_call_output and reasoning items",
                         param=f"{param}.type", code="unsupported_item")


def _tools(raw: Any) -> list[dict[str, Any]]:
    return [function_schema(t.get("name"), t.get("description"), t.get("parameters"),
                            f"tools[{i}]")
            for i, t in enumerate(tool_list(raw))
            if isinstance(t, Mapping) and t.get("type") == "function"]


def _tool_choice(raw: Any) -> str:
    if raw is None:
        return "auto"
    if raw in ("auto", "none", "required"):
        return str(raw)
    if isinstance(raw, Mapping) and isinstance(raw.get("name"), str):
        return str(raw["name"])
    return "auto"


def new_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def respond(answer: ServedTurn, request: ChatRequest, model: str, answer_id: str,
            ) -> dict[str, Any]:
    return response_object(answer_id, model, request, "completed", output_items(answer),
                           answer)


def output_items(answer: ServedTurn, message_id: str = "") -> list[dict[str, Any]]:
    """``message_id``: the id a streamed message item was opened with. The text's logprobs
    are there when the request asked for them (``answer.sampled`` is filled only then)."""
    items: list[dict[str, Any]] = []
    if answer.content:
        items.append({"id": message_id or f"msg_{uuid.uuid4().hex}", "type": "message",
                      "role": "assistant",
                      "status": "completed", "content": [
                          {"type": "output_text", "text": answer.content, "annotations": [],
                           "logprobs": logprob_entries(answer)}]})
    for c in answer.tool_calls:
        items.append({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call",
                      "status": "completed", "call_id": c.id, "name": c.name,
                      "arguments": c.arguments})
    return items


def response_object(response_id: str, model: str, request: ChatRequest, status: str,
                    output: list[dict[str, Any]], answer: ServedTurn | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": response_id, "object": "response", "created_at": int(time.time()),
        "model": model, "status": status, "output": output, "error": None,
        "incomplete_details": None, "instructions": None, "parallel_tool_calls": True,
        "tool_choice": request.tool_choice if request.tool_choice in (
            "auto", "none", "required") else {"type": "function", "name": request.tool_choice},
        "tools": [{"type": "function", **t["function"], "strict": False}
                  for t in request.tools],
        "usage": None, "metadata": {}}
    if answer is not None:
        if answer.finish_reason == "length":
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        body["usage"] = {
            "input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens,
            "total_tokens": answer.prompt_tokens + answer.completion_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}
    return body


async def stream(pieces: AsyncIterator[Piece], request: ChatRequest, model: str,
                 answer_id: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The API's event sequence, each event named by its type: the message's text deltas as
    they are generated, the function calls whole at the end."""
    seq = iter(range(1 << 30))
    message_id = ""
    ids: dict[str, Any] = {}
    sent = ""

    def event(kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        return kind, {"type": kind, "sequence_number": next(seq), **fields}

    yield event("response.created", response=response_object(
        answer_id, model, request, "in_progress", [], None))
    yield event("response.in_progress", response=response_object(
        answer_id, model, request, "in_progress", [], None))
    async for piece in pieces:
        if isinstance(piece, TextDelta):
            if not message_id:
                message_id = f"msg_{uuid.uuid4().hex}"
                ids = {"item_id": message_id, "output_index": 0, "content_index": 0}
                yield event("response.output_item.added", output_index=0, item={
                    "id": message_id, "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []})
                yield event("response.content_part.added", **ids, part=_part(""))
            sent += piece.text
            yield event("response.output_text.delta", **ids, delta=piece.text, logprobs=[])
            continue
        answer = piece
        items = output_items(answer, message_id)
        for index, item in enumerate(items):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                logprobs = item["content"][0]["logprobs"]
                if not message_id:
                    ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
                    yield event("response.output_item.added", output_index=index,
                                item={**item, "status": "in_progress", "content": []})
                    yield event("response.content_part.added", **ids, part=_part(""))
                    yield event("response.output_text.delta", **ids, delta=text,
                                logprobs=logprobs)
                yield event("response.output_text.done", **ids, text=text, logprobs=logprobs)
                yield event("response.content_part.done", **ids, part=item["content"][0])
            else:
                yield event("response.output_item.added", output_index=index,
                            item={**item, "status": "in_progress", "arguments": ""})
                call = {"item_id": item["id"], "output_index": index}
                yield event("response.function_call_arguments.delta", **call,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", **call,
                            arguments=item["arguments"], name=item["name"])
            yield event("response.output_item.done", output_index=index, item=item)
        final = response_object(answer_id, model, request, "completed", items, answer)
        kind = "response.incomplete" if final["status"] == "incomplete" \
            else "response.completed"
        yield event(kind, response=final)


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def error_body(status: int, code: str, message: str, param: str = "") -> dict[str, Any]:
    """The Responses API's errors are OpenAI's."""
    return openai_error_body(status, code, message, param)
