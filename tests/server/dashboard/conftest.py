"""A real server with its dashboard on loopback, real math jobs in bwrap sandboxes, a scripted
policy behind the real backend pool, and Debian's Chromium driven by Playwright.

The policy is the scripted engine (exact token scripts, the SmolLM2 tokenizer) with two test
additions: a gate per (job, turn) that holds a job mid-run until the test opens it, and
logprobs drawn from a fixed pattern instead of the scripted 0.0, so the page has shades to show
(the values are made up; what is checked is that each token's shade follows its logprob).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rollout.client.aio import RolloutClient
from rollout.runtime.envs.math.handler import MathHandler
from rollout.runtime.handler import HandlerRegistry
from rollout.runtime.llm import GenerateRequest, GenerateResult
from rollout.server.app import Server
from rollout.server.config import load_config
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.scripted import ScriptedEngine
from rollout.v1 import job_pb2
from tests.runtime.doubles import smollm2_tokenizer

CHROMIUM = "/usr/bin/chromium"
ALICE, BOB, OPS = ("alice-token-0123456789", "bob-token-0123456789", "ops-token-0123456789")
CLIENTS = [{"client_id": "alice", "token": ALICE},
           {"client_id": "bob", "token": BOB},
           {"client_id": "ops", "token": OPS, "roles": ["admin"]}]
SCREENSHOTS = os.environ.get("ROLLOUT_DASHBOARD_SCREENSHOTS", "")
"""A directory to copy the screenshots into as well (the issue's job and group pages)."""


def call(name: str, **arguments: Any) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def pattern_logprob(turn: int, k: int) -> float:
    """The made-up logprob of generated token ``k`` of a turn (see the module docstring)."""
    return -((k * 7 + turn * 3) % 11) * 0.35


class GatedEngine(ScriptedEngine):
    """TESTING TOOL: the scripted engine, held before chosen turns and with patterned logprobs."""

    def __init__(self, tokenizer: Any, scripts: dict[str, list[str]]) -> None:
        super().__init__(tokenizer, scripts, name="scripted-gated", policy_version=3)
        self.gates: dict[tuple[str, int], asyncio.Event] = {}
        self.reached: dict[tuple[str, int], asyncio.Event] = {}

    def hold(self, job_id: str, turn: int) -> asyncio.Event:
        """Turn ``turn`` (0-based) of ``job_id`` waits until the returned event is set."""
        self.reached[(job_id, turn)] = asyncio.Event()
        return self.gates.setdefault((job_id, turn), asyncio.Event())

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        turn = self._turns.get(request.session_id, 0)
        key = (request.session_id, turn)
        if key in self.reached:
            self.reached[key].set()
        gate = self.gates.get(key)
        if gate is not None:
            await gate.wait()
        result = await super().generate(request)
        lps = [pattern_logprob(turn, k) for k in range(len(result.output_ids))]
        return GenerateResult(result.output_ids, lps, result.finish_reason,
                              result.policy_version, result.backend)


@dataclass
class DashServer:
    server: Server
    engine: GatedEngine
    scripts: dict[str, list[str]]
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def url(self) -> str:
        assert self.server.dashboard is not None
        return self.server.dashboard.url.rstrip("/")

    def spec(self, job_id: str, script: Sequence[str], *, group: str = "",
             answer: str = "42") -> job_pb2.JobSpec:
        self.scripts[job_id] = list(script)
        s = job_pb2.JobSpec(job_id=job_id, environment="math")
        s.task.update({"question": "What is 6 times 7?", "answer": answer, "tools": ["bash"]})
        s.limits.max_turns = len(script)
        if group:
            s.group.group_id, s.group.size = group, 4
        return s

    async def run(self, token: str, spec: job_pb2.JobSpec) -> list[Any]:
        """Submit and wait for the end (SubmitRollout); returns the frames."""
        async with RolloutClient(self.address, token=token) as client:
            return [f async for f in client.submit_rollout(spec)]

    def start(self, token: str, spec: job_pb2.JobSpec) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(self.run(token, spec))
        self.tasks.append(task)
        return task


@pytest.fixture
async def dash(tmp_path: Path) -> AsyncIterator[DashServer]:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (scripts/setup.sh)")
    scripts: dict[str, list[str]] = {}
    engine = GatedEngine(smollm2_tokenizer(), scripts)
    pool = BackendPool([engine], health_interval_s=0)
    await pool.start()
    registry = HandlerRegistry()
    registry.register("math", MathHandler)
    cfg = load_config(None, [
        "server.port=0", f"server.state_dir={tmp_path / 'state'}", "server.grace_s=0.2",
        "server.dashboard_port=0", f"server.clients={json.dumps(CLIENTS)}", "llm.backends=[]",
        "pipeline.init_workers=4", "pipeline.run_workers=4", "pipeline.eval_workers=4",
        "pipeline.cleanup_deadline_s=10"], environ={})
    server = await Server(cfg, registry=registry, llm=pool).start()
    d = DashServer(server, engine, scripts)
    try:
        yield d
    finally:
        for gate in engine.gates.values():
            gate.set()
        for t in d.tasks:
            t.cancel()
        await asyncio.gather(*d.tasks, return_exceptions=True)
        await server.stop(0.5)
        await pool.close()


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    playwright = pytest.importorskip("playwright.async_api", reason="pip install playwright "
                                     "(the dev extra)")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: bash scripts/setup_browser.sh")
    async with playwright.async_playwright() as p:
        # Debian's Chromium; Playwright downloads nothing. --no-sandbox: tests run as root.
        b = await p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox"])
        try:
            yield b
        finally:
            await b.close()


async def login(page: Any, base: str, token: str, path: str = "/") -> Any:
    """Log in through the form, as a person would; returns the page at ``path``."""
    await page.goto(f"{base}/login?next={path}")
    await page.fill("#token", token)
    await page.click("#login-submit")
    await page.wait_for_load_state()
    return page


async def screenshot(page: Any, tmp_path: Path, name: str) -> Path:
    """Every test leaves a screenshot; with ROLLOUT_DASHBOARD_SCREENSHOTS also a copy there."""
    out = tmp_path / f"{name}.png"
    await page.screenshot(path=str(out), full_page=True)
    assert out.stat().st_size > 1000
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        shutil.copy(out, Path(SCREENSHOTS) / out.name)
    return out


@contextlib.asynccontextmanager
async def live_endpoint(hub: Any, principal: Any, render: Any, *, min_interval_s: float = 0.0,
                        refresh_s: float = 0.0) -> AsyncIterator[int]:
    """One live stream (``server/dashboard/live.py``) served alone at ``/live`` on a loopback
    port, for tests of the stream itself; yields the port."""
    from aiohttp import web

    from rollout.server.dashboard import live

    async def handler(request: web.Request) -> web.StreamResponse:
        return await live.stream(request, hub, live.Watcher(hub, principal), render,
                                 min_interval_s=min_interval_s, refresh_s=refresh_s)

    app = web.Application()
    app.router.add_get("/live", handler)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def open_live(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection that asked for ``/live`` and read the response's headers."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    await writer.drain()
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    return reader, writer
