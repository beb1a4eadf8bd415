"""The model gateway: one HTTP app per job lease on its own Unix socket, plus an optional TCP
listener for harnesses outside sandboxes.

A lease's key is a capability: 32 random bytes, compared in constant time, valid on that
lease's socket only (another job's key is refused there) and on the TCP listener (where the
key alone selects the job), and refused everywhere once the lease is closed. Closing a lease
cancels its in-flight requests (which aborts their generation in the backend pool), removes its
socket, and returns what it captured.

Socket files live in ``<state dir>/gateway/`` (mode 0700, sockets 0600); a state directory
whose path is too long for a Unix socket address falls back to a private directory under the
system's temporary directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from rollout.runtime.gateway import GatewayLease, HarnessCapture
from rollout.runtime.llm import LLMClient
from rollout.runtime.types import JobSpec
from rollout.server.gateway import anthropic, openai_chat, responses
from rollout.server.gateway.conversation import Answer, JobConversation
from rollout.server.gateway.messages import BadRequest, Message, RequestLimits

log = logging.getLogger(__name__)

MAX_SOCKET_PATH = 100
"""``sun_path`` holds 108 bytes on Linux (104 on macOS); leave room for the terminator."""
KEY_PREFIX = "rk-"


@dataclass(eq=False)
class Lease:
    key: str
    conversation: JobConversation
    socket_path: str
    runner: web.AppRunner | None = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    closed: bool = False
    last_response: tuple[str, list[Message]] | None = None
    """The Responses API's last answer: (id, the conversation it ended)."""
    opened_at: float = field(default_factory=time.monotonic)


Resolver = Callable[[str], Lease | None]


class Gateway:
    """Implements :class:`rollout.runtime.gateway.ModelGateway` over aiohttp."""

    def __init__(self, state_dir: str | Path, *, limits: RequestLimits | None = None,
                 tcp_host: str = "127.0.0.1", tcp_port: int | None = None) -> None:
        self.limits = limits or RequestLimits()
        self._state_dir = Path(state_dir)
        self._root: Path | None = None
        self._own_root = False
        self._leases: dict[str, Lease] = {}
        self.tcp_host = tcp_host
        self.tcp_port = tcp_port
        """``None``: no TCP listener; 0 picks a free port (read it back after :meth:`start`)."""
        self._tcp: web.AppRunner | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> Gateway:
        if self.tcp_port is not None and self._tcp is None:
            runner = web.AppRunner(build_app(self._leases.get, self.limits), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, self.tcp_host, self.tcp_port)
            await site.start()
            self._tcp = runner
            server = getattr(site, "_server", None)
            sockets = getattr(server, "sockets", None) or []
            if sockets:
                self.tcp_port = int(sockets[0].getsockname()[1])
        return self

    async def stop(self) -> None:
        for lease in list(self._leases.values()):
            await self._close(lease)
        if self._tcp is not None:
            await self._tcp.cleanup()
            self._tcp = None
        if self._own_root and self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)

    @property
    def base_url(self) -> str:
        """``http://host:port/v1`` of the TCP listener ("" when there is none)."""
        return f"http://{self.tcp_host}:{self.tcp_port}/v1" if self._tcp is not None else ""

    # ------------------------------------------------------------------ ModelGateway
    async def open(self, spec: JobSpec, llm: LLMClient, *,
                   deadline: float | None = None) -> GatewayLease:
        """``deadline`` (``time.monotonic()`` time): when the job's RUN ends; by default its
        ``limits.run_timeout_s`` from now."""
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        root = await asyncio.to_thread(self._socket_root)
        path = str(root / f"{secrets.token_hex(8)}.sock")
        conversation = JobConversation(spec, llm, deadline=deadline if deadline is not None
                                       else time.monotonic() + spec.limits.run_timeout_s)
        lease = Lease(key, conversation, path)
        runner = web.AppRunner(build_app(lambda k: lease if _same(k, lease.key) else None,
                                         self.limits), access_log=None)
        await runner.setup()
        try:
            await web.UnixSite(runner, path).start()
            os.chmod(path, 0o600)
        except BaseException:
            await runner.cleanup()
            raise
        lease.runner = runner
        self._leases[key] = lease
        return GatewayLease(api_key=key, socket_path=path)

    async def release_job(self, job_id: str) -> None:
        """Close every lease of ``job_id`` still open (the job ended; its handler did not)."""
        for lease in [x for x in self._leases.values()
                      if x.conversation.spec.job_id == job_id]:
            await self._close(lease)

    def capture(self, lease: GatewayLease) -> HarnessCapture:
        found = self._leases.get(lease.api_key)
        if found is None:
            raise KeyError("the lease is closed or was never opened here")
        return found.conversation.capture

    async def close(self, lease: GatewayLease) -> HarnessCapture:
        found = self._leases.get(lease.api_key)
        if found is None:
            raise KeyError("the lease is closed or was never opened here")
        await self._close(found)
        return found.conversation.capture

    async def _close(self, lease: Lease) -> None:
        lease.closed = True
        self._leases.pop(lease.key, None)
        tasks = [t for t in lease.tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        abort = getattr(lease.conversation.llm, "abort", None)
        if tasks and abort is not None:
            with contextlib.suppress(Exception):
                await abort(lease.conversation.spec.job_id)
        lease.conversation.finish()
        if lease.runner is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(lease.runner.cleanup(), 5.0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lease.socket_path)

    def _socket_root(self) -> Path:
        if self._root is None:
            root = self._state_dir / "gateway"
            if len(str(root)) + 22 > MAX_SOCKET_PATH:
                root, self._own_root = Path(tempfile.mkdtemp(prefix="rollout-gw-")), True
            root.mkdir(parents=True, exist_ok=True)
            os.chmod(root, 0o700)
            self._root = root
        return self._root


def _same(given: str, key: str) -> bool:
    return secrets.compare_digest(given.encode(), key.encode())


# ---------------------------------------------------------------------------- the HTTP app

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


Handler = Callable[[web.Request, Lease, Any], Awaitable[web.StreamResponse]]
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
        body = json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"the body is not JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", code="invalid_json")
    return body


async def _sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


def _data(payload: Any, event: str = "") -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


async def _models(request: web.Request, lease: Lease, _: Any) -> web.StreamResponse:
    name = lease.conversation.model_name
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "rollout"}]})


async def _chat(request: web.Request, lease: Lease, body: Any) -> web.StreamResponse:
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


async def _responses(request: web.Request, lease: Lease, body: Any) -> web.StreamResponse:
    previous = None
    named = body.get("previous_response_id")
    if named is not None:
        if lease.last_response is None or lease.last_response[0] != named:
            raise BadRequest(f"previous_response_id {named!r} is not this job's last response "
                             "(only the last one is kept)", param="previous_response_id",
                             status=404, code="response_not_found")
        previous = lease.last_response[1]
    parsed = responses.parse(body, request.app[LIMITS_KEY], previous)
    answer: Answer = await lease.conversation.serve(parsed)
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


async def _messages(request: web.Request, lease: Lease, body: Any) -> web.StreamResponse:
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
