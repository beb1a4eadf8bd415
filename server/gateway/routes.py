"""The gateway's HTTP app: one route function over a table of dialects (OpenAI chat, Responses,
Anthropic Messages), key checks, body bounds and SSE framing, and the one object that holds
(and frees) everything a lease owns.

Every dialect module has the same four role functions: ``parse`` (body to
:class:`ChatRequest`), ``respond`` (an answer as the API's JSON), ``stream`` (the answer as
named or unnamed SSE events) and ``error_body`` (the API's own error JSON). :func:`_route`
turns any exception into that error (a bug is a 500 in the API's JSON, never aiohttp's text
page), and the app runs with handler cancellation, so a client that disconnects cancels its
handler, which cancels its generation unless another request waits for the same one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from rollout.server.gateway import anthropic, openai_chat, responses
from rollout.server.gateway.conversation import JobConversation, Piece, ServedTurn, TextDelta
from rollout.server.gateway.messages import BadRequest, ChatRequest, Message, RequestLimits

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 5.0
"""How long closing a lease waits for its handlers and its server to wind down."""


@dataclass(eq=False)
class LeaseResources:
    """Everything one lease holds; :meth:`close` is the only way any of it is freed."""

    key: str
    conversation: JobConversation
    socket_path: str
    runner: web.AppRunner | None = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    """Handlers serving this lease now."""
    closed: bool = False
    last_response: tuple[str, list[Message]] | None = None
    """The Responses API's last answer: (id, the conversation it ended)."""
    opened_at: float = field(default_factory=time.monotonic)

    async def close(self) -> None:
        """Refuse the key, cancel the handlers (their generations stop, their chains roll
        back), stop the server, remove the socket. Idempotent."""
        if self.closed and self.runner is None:
            return
        self.closed = True
        tasks = [t for t in self.tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
        await self.conversation.close()
        abort = getattr(self.conversation.llm, "abort", None)
        if tasks and abort is not None:
            with contextlib.suppress(Exception):
                await abort(self.conversation.spec.job_id)
        runner, self.runner = self.runner, None
        if runner is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(runner.cleanup(), CLOSE_WAIT_S)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)


Resolver = Callable[[str], LeaseResources | None]
ErrorBody = Callable[[int, str, str, str], dict[str, Any]]


@dataclass(frozen=True)
class Dialect:
    """One wire format: its role functions, and how its stream ends."""

    name: str
    parse: Callable[..., ChatRequest]
    """``(body, limits, previous)``: ``previous`` is the conversation a Responses request's
    ``previous_response_id`` names (None for the others)."""
    respond: Callable[[ServedTurn, ChatRequest, str, str], dict[str, Any]]
    stream: Callable[[AsyncIterator[Piece], ChatRequest, str, str],
                     AsyncIterator[tuple[str, dict[str, Any]]]]
    """Named (or unnamed) SSE events from the answer's pieces: text as it is generated,
    then the answer (its calls, its finish)."""
    error_body: ErrorBody
    new_id: Callable[[], str]
    stream_end: bytes = b""


CHAT = Dialect("openai-chat", openai_chat.parse, openai_chat.respond, openai_chat.stream,
               openai_chat.error_body, openai_chat.new_id, b"data: [DONE]\n\n")
RESPONSES = Dialect("openai-responses", responses.parse, responses.respond, responses.stream,
                    responses.error_body, responses.new_id)
MESSAGES = Dialect("anthropic-messages", anthropic.parse, anthropic.respond, anthropic.stream,
                   anthropic.error_body, anthropic.new_id)
DIALECTS = {"/v1/chat/completions": CHAT, "/v1/responses": RESPONSES,
            "/v1/messages": MESSAGES}
"""The generating routes, by path."""

API_KEY = web.AppKey("resolve", object)
LIMITS_KEY = web.AppKey("limits", RequestLimits)


def build_app(resolve: Resolver, limits: RequestLimits) -> web.Application:
    # Bodies are read and bounded by the handlers (JSON errors, not aiohttp's text 413).
    app = web.Application(client_max_size=limits.max_body_bytes + 1)
    app[API_KEY] = resolve
    app[LIMITS_KEY] = limits
    for path, dialect in DIALECTS.items():
        app.router.add_post(path, _route(_generate, dialect))
    app.router.add_post("/v1/messages/count_tokens", _route(_count_tokens, MESSAGES))
    app.router.add_get("/v1/models", _route(_models, CHAT))
    return app


Action = Callable[[web.Request, LeaseResources, Any, Dialect], Awaitable[web.StreamResponse]]


def _route(action: Action, dialect: Dialect) -> Callable[[web.Request],
                                                          Awaitable[web.StreamResponse]]:
    """The one request path: key, bounds, body, the action; every exception becomes the
    dialect's error JSON."""
    async def serve(request: web.Request) -> web.StreamResponse:
        def fail(status: int, code: str, message: str, param: str = "") -> web.Response:
            return web.json_response(dialect.error_body(status, code, message, param),
                                     status=status)

        key = _key_of(request)
        lease = request.app[API_KEY](key) if key else None  # type: ignore[operator]
        if lease is None or lease.closed:
            return fail(401, "invalid_api_key", "unknown or revoked API key: use the key "
                        "this job's gateway lease was given")
        if len(lease.tasks) >= request.app[LIMITS_KEY].max_pending:
            return fail(429, "too_many_requests", "this job already has "
                        f"{len(lease.tasks)} requests in flight; wait for an answer before "
                        "sending more")
        task = asyncio.current_task()
        if task is not None:
            lease.tasks.add(task)
        try:
            body: Any = None
            if request.method == "POST":
                body = await _read_json(request, request.app[LIMITS_KEY])
            return await action(request, lease, body, dialect)
        except BadRequest as exc:
            return fail(exc.status, exc.code, str(exc), exc.param)
        except web.HTTPException as exc:
            return fail(exc.status, "http_error", exc.reason)
        except (ConnectionResetError, asyncio.CancelledError):
            raise  # the client is gone; nothing to answer
        except Exception as exc:
            log.exception("gateway %s request failed", dialect.name)
            return fail(500, "internal_error", f"the gateway failed on this request: "
                        f"{type(exc).__name__}")
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
    except RecursionError:
        raise BadRequest("the body nests JSON too deeply", code="invalid_json") from None
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


async def _models(request: web.Request, lease: LeaseResources, _: Any,
                  dialect: Dialect) -> web.StreamResponse:
    name = lease.conversation.model_name
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "rollout"}]})


async def _generate(request: web.Request, lease: LeaseResources, body: Any,
                    dialect: Dialect) -> web.StreamResponse:
    parsed = dialect.parse(body, request.app[LIMITS_KEY], _previous(lease, body, dialect))
    answer_id = dialect.new_id()
    model = parsed.model or lease.conversation.model_name
    if not parsed.stream:
        answer = await lease.conversation.serve(parsed)
        _remember(lease, dialect, parsed, answer, answer_id)
        return web.json_response(dialect.respond(answer, parsed, model, answer_id))
    live = _Live()
    serving = asyncio.ensure_future(lease.conversation.serve_streaming(parsed, live.put))
    serving.add_done_callback(live.wake)
    try:
        pieces = live.pieces(serving)
        first = await anext(pieces)  # an error before any text is the API's JSON
        stream = await _sse(request)
        live.out = stream
        try:
            async for name, event in dialect.stream(_chain(first, pieces), parsed, model,
                                                    answer_id):
                live.buffer.append(_data(event, name))
        except (BadRequest, web.HTTPException) as exc:  # after text went out: an error event
            status = getattr(exc, "status", 500)
            live.buffer.append(_data(dialect.error_body(
                status, getattr(exc, "code", "http_error"), str(exc), ""),
                "error" if dialect is MESSAGES else ""))
            await live.flush()
            await stream.write_eof()
            return stream
        _remember(lease, dialect, parsed, serving.result()[0], answer_id)
        live.buffer.append(dialect.stream_end)
        await live.flush()
        await stream.write_eof()
        return stream
    finally:
        if not serving.done():  # the client left: the generation stops, its chain rolls back
            serving.cancel()
            with contextlib.suppress(BaseException):
                await serving


class _Live:
    """A streamed request's text pieces, from the generation to the writer, and the writer's
    buffer. Pieces that arrive while the writer is busy go out joined, as one delta."""

    def __init__(self) -> None:
        self._waiting: list[TextDelta] = []
        self._ready = asyncio.Event()
        self.out: web.StreamResponse | None = None
        self.buffer: list[bytes] = []
        """Encoded events not written yet: written together whenever the stream would
        wait for the generation, and at its end (one write for what is ready at once)."""

    async def flush(self) -> None:
        if self.out is not None and self.buffer:
            data = b"".join(self.buffer)
            self.buffer.clear()
            await self.out.write(data)

    def put(self, delta: TextDelta) -> None:
        self._waiting.append(delta)
        self._ready.set()

    def wake(self, _: Any = None) -> None:
        self._ready.set()

    async def pieces(self, serving: asyncio.Future[tuple[ServedTurn, str]],
                     ) -> AsyncIterator[Piece]:
        sent = False
        while True:
            if not self._ready.is_set():
                await self.flush()
                await self._ready.wait()
            self._ready.clear()
            if self._waiting:
                waiting, self._waiting = self._waiting, []
                sent = True
                yield TextDelta("".join(d.text for d in waiting), waiting[0].prompt_tokens)
            if serving.done():
                break
        answer, rest = serving.result()
        if sent and rest:
            yield TextDelta(rest, answer.prompt_tokens)
        yield answer


async def _chain(first: Piece, rest: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
    yield first
    async for piece in rest:
        yield piece


def _remember(lease: LeaseResources, dialect: Dialect, parsed: ChatRequest,
              answer: ServedTurn, answer_id: str) -> None:
    if dialect is RESPONSES:
        lease.last_response = (answer_id, [
            *parsed.messages, Message("assistant", answer.content, tuple(answer.tool_calls))])


def _previous(lease: LeaseResources, body: Mapping[str, Any],
              dialect: Dialect) -> list[Message] | None:
    """The conversation a Responses request's ``previous_response_id`` names."""
    named = body.get("previous_response_id") if dialect is RESPONSES else None
    if named is None:
        return None
    if lease.last_response is None or lease.last_response[0] != named:
        raise BadRequest(f"previous_response_id {named!r} is not this job's last response "
                         "(only the last one is kept)", param="previous_response_id",
                         status=404, code="response_not_found")
    return lease.last_response[1]


async def _count_tokens(request: web.Request, lease: LeaseResources, body: Any,
                        dialect: Dialect) -> web.StreamResponse:
    """Anthropic's ``count_tokens``: the prompt's length rendered on its own (no turn)."""
    parsed = anthropic.parse(body, request.app[LIMITS_KEY], None, count_only=True)
    return web.json_response({"input_tokens": await lease.conversation.count_tokens(parsed)})
