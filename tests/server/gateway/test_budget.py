"""The gateway's request budget: refusing by a lower bound, counting that stops at the room,
and renders shared fairly between jobs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollout.runtime.types import JobSpec, SamplingParams
from rollout.server.gateway import budget
from rollout.server.gateway.messages import BadRequest, ChatRequest, Message

pytestmark = pytest.mark.timeout(30)


class _Tok:
    """One token per character, and a vocabulary whose longest entry is ``longest`` long."""

    def __init__(self, longest: int) -> None:
        self.longest = longest
        self.encoded = 0
        self.model_max_length = 1000

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "b" * self.longest: 1}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encoded += len(text)
        return [0] * len(text)


class _LLM:
    def __init__(self, tok: _Tok) -> None:
        self.tokenizer = tok


def _spec(budget_tokens: int = 8192) -> JobSpec:
    return JobSpec(job_id="j", environment="harness", task={},
                   sampling=SamplingParams(total_token_budget=budget_tokens))


def _request(chars: int) -> ChatRequest:
    return ChatRequest([Message("system", "s"), Message("user", "x" * chars)])


async def test_text_that_cannot_fit_is_refused_without_tokenizing() -> None:
    tok = _Tok(longest=4)
    with pytest.raises(BadRequest) as info:
        await budget.admit(_spec(), _LLM(tok), _request(4 * 1000 + 10))  # room: 1000 tokens
    assert info.value.code == "context_length_exceeded"
    assert tok.encoded == 0


async def test_text_past_the_bound_is_counted_and_the_count_stops_at_the_room() -> None:
    tok = _Tok(longest=10_000)  # a vocabulary that makes the bound useless
    with pytest.raises(BadRequest):
        await budget.admit(_spec(), _LLM(tok), _request(5_000_000))
    assert tok.encoded <= budget.CHUNK_CHARS + 1  # stopped after the first chunk
    tok.encoded = 0
    await budget.admit(_spec(), _LLM(tok), _request(900))  # fits: admitted, nothing counted
    assert tok.encoded == 0


async def test_a_job_that_used_less_rendering_goes_first() -> None:
    share = budget.FairShare(1)
    order: list[str] = []
    hold = asyncio.Event()

    async def render(job: str, seconds: float = 0.0) -> None:
        async with share.turn(job):
            order.append(job)
            if seconds:
                await hold.wait()

    share._used["hog"] = 10.0  # it has rendered giant prompts before
    first = asyncio.create_task(render("hog", 1))
    await asyncio.sleep(0)
    waiting = [asyncio.create_task(render("hog")), asyncio.create_task(render("light"))]
    await asyncio.sleep(0.01)
    hold.set()
    await asyncio.gather(first, *waiting)
    assert order == ["hog", "light", "hog"]


async def test_a_cancelled_waiter_gives_its_turn_on() -> None:
    share = budget.FairShare(1)
    hold = asyncio.Event()

    async def render(job: str, wait: bool = False) -> str:
        async with share.turn(job):
            if wait:
                await hold.wait()
        return job

    first = asyncio.create_task(render("a", True))
    await asyncio.sleep(0)
    gone = asyncio.create_task(render("b"))
    later = asyncio.create_task(render("c"))
    await asyncio.sleep(0.01)
    gone.cancel()
    hold.set()
    assert await later == "c" and await first == "a"
    assert share.busy == 0


def test_max_chars_per_token_of_the_real_tokenizer(tok: Any) -> None:
    longest = budget.max_chars_per_token(tok)
    assert 8 <= longest <= 200
    text = "#" * 1000 + " hello world" * 100
    assert len(tok.encode(text, add_special_tokens=False)) >= len(text) / longest


async def test_a_large_body_is_parsed_off_the_event_loop(rig: Any, monkeypatch: Any) -> None:
    """An ~8 MiB body would hold the event loop (every other job's requests) while it parses."""
    import json as json_module
    import threading

    import aiohttp

    from rollout.server.gateway import routes

    threads: list[str] = []
    real = json_module.loads

    def loads(raw: Any, *a: Any, **k: Any) -> Any:
        if len(raw) > routes.PARSE_OFF_LOOP:
            threads.append(threading.current_thread().name)
        return real(raw, *a, **k)

    monkeypatch.setattr(routes.json, "loads", loads)
    lease = await rig.open("big", ["fine"])
    text = "lorem ipsum " * (routes.PARSE_OFF_LOOP // 6)
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=lease.socket_path),
                                     headers={"Authorization": f"Bearer {lease.api_key}"}) as h:
        async with h.post("http://gw/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": text}]}) as r:
            assert r.status == 400  # it cannot fit the job's room
    assert threads and threading.main_thread().name not in threads
