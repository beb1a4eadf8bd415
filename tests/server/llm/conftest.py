"""Fixtures for the LLM backend tests: a tiny real model, engines over it, fake engines."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from rollout.runtime.llm import GenerateRequest, GenerateResult
from rollout.server.llm.engine import Engine, EngineError
from rollout.server.llm.http_server import serve
from rollout.server.llm.transformers_engine import TransformersEngine
from tests.fixtures.tiny_model import tiny_model_dir
from tests.server.llm.real_vllm import RealVllm, start_real_vllm, stop_real_vllm
from tests.util import patience


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture
async def engine(tiny_dir: Path) -> AsyncIterator[Any]:
    from rollout.server.llm.transformers_engine import TransformersEngine

    eng = TransformersEngine(tiny_dir, name="tiny")
    yield eng
    await eng.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def real_vllm(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RealVllm]:
    """One real vLLM server for the module's tests (see ``tests/server/llm/real_vllm.py``;
    its tests carry ``REAL_VLLM_MARKS``), stopped by a deadline when the module ends."""
    vllm = await start_real_vllm(tmp_path_factory.mktemp("vllm-log"))
    try:
        yield vllm
    finally:
        await stop_real_vllm(vllm)


@pytest.fixture(scope="module")
def reference_model(real_vllm: RealVllm) -> Any:
    """SmolLM2 in transformers, fp32: the uncached reference forward for vLLM's logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(real_vllm.model_dir),
                                                dtype=torch.float32).eval()


class FakeEngine(Engine):
    """A controllable backend: fixed latency, can die and recover, counts what it served."""

    def __init__(self, name: str, latency_s: float = 0.0, version: int = 0) -> None:
        self.name = name
        self.latency_s = latency_s
        self.alive = True
        self._version = version
        self.served: list[GenerateRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.released: list[str] = []
        self.gate: asyncio.Event | None = None
        """When set, generations wait for it (lets a test hold requests in flight)."""

    @property
    def policy_version(self) -> int:
        return self._version

    def set_policy_version(self, version: int) -> None:
        self._version = version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if not self.alive:
            raise EngineError(f"{self.name} is down")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(self.latency_s)
            if not self.alive:
                raise EngineError(f"{self.name} died mid-request")
            self.served.append(request)
            return GenerateResult([7, 8], [-0.1, -0.2], "stop", self._version, self.name)
        finally:
            self.in_flight -= 1

    async def release_session(self, session_id: str) -> None:
        self.released.append(session_id)

    async def health(self) -> bool:
        return self.alive

    async def update_weights(self, source: Any, version: int) -> None:
        self._version = version


class Served:
    """An ``llm-serve`` HTTP server in this event loop over a tiny-model engine."""

    def __init__(self, engine: TransformersEngine, url: str, task: asyncio.Task[None]) -> None:
        self.engine, self.url, self.task = engine, url, task

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def start_server(model_dir: Path, name: str) -> Served:
    """``llm-serve`` on a free loopback port; every turn runs to max_tokens (no EOS)."""
    engine = TransformersEngine(model_dir, name=name)
    engine.eos_ids = frozenset()  # random weights: run every turn to max_tokens
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(engine, "127.0.0.1", 0, "tiny", ready))
    port = await asyncio.wait_for(ready, patience(30))
    return Served(engine, f"http://127.0.0.1:{port}", task)


@pytest.fixture
async def served(tiny_dir: Path) -> AsyncIterator[Served]:
    server = await start_server(tiny_dir, "srv")
    yield server
    await server.stop()
