"""A real gateway on Unix sockets over the scripted policy, and official clients for it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.gateway import GatewayLease
from rollout.runtime.types import JobSpec, Limits, SamplingParams
from rollout.server.gateway import Gateway
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.scripted import ScriptedEngine
from tests.runtime.doubles import smollm2_tokenizer


@pytest.fixture(scope="session")
def tok() -> Any:
    return smollm2_tokenizer()


def openai_client(lease: GatewayLease, key: str | None = None) -> Any:
    import httpx2
    import openai

    transport = httpx2.AsyncHTTPTransport(uds=lease.socket_path)
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=key or lease.api_key,
                              max_retries=0, http_client=httpx2.AsyncClient(transport=transport))


def anthropic_client(lease: GatewayLease, key: str | None = None) -> Any:
    import anthropic
    import httpx2

    transport = httpx2.AsyncHTTPTransport(uds=lease.socket_path)
    return anthropic.AsyncAnthropic(base_url="http://gateway", api_key=key or lease.api_key,
                                    max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=transport))


@dataclass
class Rig:
    """A gateway over one scripted backend; ``scripts[job_id]`` is each job's replies."""

    tok: Any
    gateway: Gateway
    pool: BackendPool
    engine: ScriptedEngine
    scripts: dict[str, list[str]]
    leases: list[GatewayLease] = field(default_factory=list)

    async def open(self, job_id: str, replies: Sequence[str], **spec: Any) -> GatewayLease:
        self.scripts[job_id] = list(replies)
        spec.setdefault("sampling", SamplingParams(seed=7))
        spec.setdefault("limits", Limits(max_turns=16))
        lease = await self.gateway.open(JobSpec(job_id=job_id, environment="harness", task={},
                                                **spec), self.pool)
        self.leases.append(lease)
        return lease

    def scripted_ids(self, text: str) -> list[int]:
        return [*self.tok.encode(text, add_special_tokens=False), self.engine.end_of_turn_id]


@pytest.fixture
async def rig(tok: Any, tmp_path: Path) -> AsyncIterator[Rig]:
    scripts: dict[str, list[str]] = {}
    engine = ScriptedEngine(tok, scripts, end_of_turn_id=tok.convert_tokens_to_ids("<|im_end|>"))
    pool = BackendPool([engine], health_interval_s=0)
    gateway = await Gateway(tmp_path / "state").start()
    yield Rig(tok, gateway, pool, engine, scripts)
    await gateway.stop()
    with contextlib.suppress(Exception):
        await pool.close()


ToolCallText = Callable[..., str]
