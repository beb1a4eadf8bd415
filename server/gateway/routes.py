"""The gateway's HTTP app: the four routes over one lease (or, on the TCP listener, over
whichever open lease a request's key names), key checks, body bounds and SSE framing."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from rollout.server.gateway import anthropic, openai_chat, responses
from rollout.server.gateway.conversation import JobConversation, ServedTurn
from rollout.server.gateway.messages import BadRequest, Message, RequestLimits


@dataclass(eq=False)
class LeaseResources:
    key: str
    conversation: JobConversation
    socket_path: str
    runner: web.AppRunner | None = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    closed: bool = False
    last_response: tuple[str, list[Message]] | None = None
    """The Responses API's last answer: (id, the conversation it ended)."""
    opened_at: float = field(default_factory=time.monotonic)


Resolver = Callable[[str], LeaseResources | None]


API_KEY = web.AppKey("resolve", object)
LIMITS_KEY = web.AppKey("limits", RequestLimits)


def build_app(resolve: Resolver, limits: RequestLimits) -> web.Application:
    # Bodies are read and bounded by the handlers (JSON errors, not aiohttp's text 413).
    app = web.Application(client_max_size=limits.max_body_bytes + 1)
    app[API_KEY] = resolve
    app[LIMITS_KEY] = limits
    app.router.add_post("/v1/chat/completions", _route(_chat, openai_chat.error_body))
    app.router.add_post("/v1/responses", _route(_responses, openai_chat.error_body))
    app.router.add_post("/v1/messages", _route(_messages, anthropic.error_body))
    app.router.add_get("/v1/models", _route(_models, openai_chat.error_body))
    return app


Handler = Callable[[web.Request, LeaseResources, Any], Awaitable[web.StreamResponse]]
ErrorBody = Callable[[int, str, str, str], dict[str, Any]]


def _route(handler: Handler, error_body: ErrorBody) -> Callable[[web.Request],
                                                                  Awaitable[web.StreamResponse]]:
    async def serve(request: web.Request) -> web.StreamResponse:
        def fail(status: int, code: str, message: str, param: str = "") -> web.Response:
            return web.json_response(error_body(status, code, message, param), status=status)

        key = _key_of(request)
        lease = request.app[API_KEY](key) if key else None  # type: ignore[operator]
        if lease is None or lease.closed:
            return fail(401, "invalid_api_key", "unknown or revoked API key: use the key "
                        "this job's gateway lease was given")
        if len(lease.tasks) >= request.app[LIMITS_KEY].max_pending:
            return fail(429, "too_many_requests", "this job already has "
                        f"{len(lease.tasks)} requests in flight; its turns are served one at "
                        "a time, so wait for an answer before sending more")
        task = asyncio.current_task()
        if task is not None:
            lease.tasks.add(task)
        try:
            body: Any = None
            if request.method == "POST":
                body = await _read_json(request, request.app[LIMITS_KEY])
            return await handler(request, lease, body)
        except BadRequest as exc:
            return fail(exc.status, exc.code, str(exc), exc.param)
        finally:
            if task is not None:
                lease.tasks.discard(task)

    return serve


def _key_of(request: web.Request) -> str:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key", "").strip()


async def _read_json(request: web.Request, limits: RequestLimits) -> Any:
    too_big = BadRequest(f"the request body exceeds {limits.max_body_bytes} bytes",
                         status=413, code="request_too_large")
    if (request.content_length or 0) > limits.max_body_bytes:
        raise too_big
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_big from None
    if len(raw) > limits.max_body_bytes:
        raise too_big
    try:
        body = await _loads(raw)
    except ValueError as exc:
        raise BadRequest(f"the body is not JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", code="invalid_json")
    return body


async def _loads(raw: bytes) -> Any:
    """Parse a body; one past ``PARSE_OFF_LOOP`` bytes in a thread (an 8 MiB body takes the
    event loop tens of milliseconds, every other job's requests waiting meanwhile)."""
    if len(raw) <= PARSE_OFF_LOOP:
        return json.loads(raw)
    return await asyncio.to_thread(json.loads, raw)


PARSE_OFF_LOOP = 256 * 1024


async def _sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


def _data(payload: Any, event: str = "") -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


async def _models(request: web.Request, lease: LeaseResources, _: Any) -> web.StreamResponse:
    name = lease.conversation.model_name
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "rollout"}]})


async def _chat(request: web.Request, lease: LeaseResources, body: Any) -> web.StreamResponse:
    parsed = openai_chat.parse(body, request.app[LIMITS_KEY])
    options = body.get("stream_options") or {}
    answer = await lease.conversation.serve(parsed)
    model = parsed.model or lease.conversation.model_name
    if not parsed.stream:
        return web.json_response(openai_chat.respond(answer, model))
    response = await _sse(request)
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    for chunk in openai_chat.chunks(answer, model, include_usage):
        await response.write(_data(chunk))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _responses(request: web.Request, lease: LeaseResources, body: Any) -> web.StreamResponse:
    previous = None
    named = body.get("previous_response_id")
    if named is not None:
        if lease.last_response is None or lease.last_response[0] != named:
            raise BadRequest(f"previous_response_id {named!r} is not this job's last response "
                             "(only the last one is kept)", param="previous_response_id",
                             status=404, code="response_not_found")
        previous = lease.last_response[1]
    parsed = responses.parse(body, request.app[LIMITS_KEY], previous)
    answer: ServedTurn = await lease.conversation.serve(parsed)
    response_id = f"resp_{secrets.token_hex(16)}"
    lease.last_response = (response_id, [
        *parsed.messages, Message("assistant", answer.content, tuple(answer.tool_calls))])
    model = parsed.model or lease.conversation.model_name
    if not parsed.stream:
        return web.json_response(responses.response_object(
            response_id, model, parsed, "completed", responses.output_items(answer), answer))
    stream = await _sse(request)
    for event in responses.events(response_id, model, parsed, answer):
        await stream.write(_data(event, event["type"]))
    await stream.write_eof()
    return stream


async def _messages(request: web.Request, lease: LeaseResources, body: Any) -> web.StreamResponse:
    parsed = anthropic.parse(body, request.app[LIMITS_KEY])
    answer = await lease.conversation.serve(parsed)
    model = parsed.model or lease.conversation.model_name
    if not parsed.stream:
        return web.json_response(anthropic.respond(answer, model))
    stream = await _sse(request)
    for name, event in anthropic.events(answer, model):
        await stream.write(_data(event, name))
    await stream.write_eof()
    return stream
