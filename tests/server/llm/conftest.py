"""Fixtures for the LLM backend tests: a tiny real model, engines over it, fake engines."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.llm import GenerateRequest, GenerateResult
from rollout.server.llm.engine import Engine, EngineError
from tests.fixtures.tiny_model import tiny_model_dir


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture
async def engine(tiny_dir: Path) -> AsyncIterator[Any]:
    from rollout.server.llm.transformers_engine import TransformersEngine

    eng = TransformersEngine(tiny_dir, name="tiny")
    yield eng
    await eng.close()




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
