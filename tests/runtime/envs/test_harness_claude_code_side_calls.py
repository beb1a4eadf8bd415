"""Claude Code's side calls on its real request bodies, replayed through the real gateway with the
shipped preset's rules (no Claude Code install needed).

``data/claude_code_interactive_requests.jsonl`` holds, as sent, the three requests Claude Code
2.1.332 made in an interactive session (a pty, the preset's model variables, a loopback stub
answering): the session-title request it sends to its small fast model after the first prompt,
then two main-thread requests (the second carries the first's answer and a new prompt). The
title request must be a chain of its own and never trained, the main thread one trained chain.
``claude -p`` itself makes no title request (the live test in test_harness_claude_code.py covers
the side call it does make, a tool-use summary); the rule is the same model-name rule."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.harness import presets as harness_presets
from rollout.runtime.gateway import GatewayOptions
from rollout.runtime.types import JobSpec, Limits, SamplingParams
from rollout.server.gateway import Gateway
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.scripted import ScriptedEngine
from tests.runtime.doubles import smollm2_tokenizer

pytestmark = pytest.mark.timeout(120)

RECORDED = Path(__file__).parent / "data" / "claude_code_interactive_requests.jsonl"
TITLE = '{"title": "List files"}'
FIRST_ANSWER = '{"isNewTopic": true, "title": "List files"}'
"""What the loopback stub answered the first main-thread request: the second request repeats it
as the assistant turn, so the scripted policy answers the same to let it extend the chain."""


def recorded() -> list[dict[str, Any]]:
    return [json.loads(line) for line in RECORDED.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[Gateway, BackendPool, Any]]:
    tok = smollm2_tokenizer()
    scripts = {"job": [TITLE, FIRST_ANSWER, "Hello!"]}
    engine = ScriptedEngine(tok, scripts, end_of_turn_id=tok.convert_tokens_to_ids("<|im_end|>"))
    pool = BackendPool([engine], health_interval_s=0)
    gw = await Gateway(tmp_path / "state").start()
    yield gw, pool, tok
    await gw.stop()
    with contextlib.suppress(Exception):
        await pool.close()


def test_the_recording_is_what_the_preset_makes_claude_code_send() -> None:
    """The recorded names are the preset's: the title request under its Haiku name, the main
    thread under the job's model (recorded as ``policy``)."""
    env = harness_presets.load_preset("claude-code")["env"]
    models = [r["body"]["model"] for r in recorded()]
    assert models == [env["ANTHROPIC_DEFAULT_HAIKU_MODEL"], "policy", "policy"]
    assert env["ANTHROPIC_SMALL_FAST_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"]
    title = recorded()[0]["body"]
    assert "naming a coding session" in json.dumps(title["system"])
    assert not title.get("tools") and len(title["messages"]) == 1


async def test_claude_codes_title_request_is_an_untrained_chain_of_its_own(
        gateway: tuple[Gateway, BackendPool, Any]) -> None:
    import httpx2

    gw, pool, tok = gateway
    rules = harness_presets.resolve_side_calls("claude-code")
    lease = await gw.open(JobSpec(job_id="job", environment="harness", task={},
                                  sampling=SamplingParams(seed=7, total_token_budget=65536),
                                  limits=Limits(max_turns=8)),
                          pool, options=GatewayOptions(side_calls=rules))
    transport = httpx2.AsyncHTTPTransport(uds=lease.socket_path)
    async with httpx2.AsyncClient(transport=transport, timeout=60) as http:
        for request in recorded():
            reply = await http.post(f"http://gateway{request['path']}",
                                    content=json.dumps(request["body"]), headers={
                                        "x-api-key": lease.api_key,
                                        "anthropic-version": "2023-06-01",
                                        "content-type": "application/json"})
            assert reply.status_code == 200, reply.text[:2000]
    capture = gw.capture(lease)
    assert capture.requests == 3
    segments, turns = capture.segments, capture.turns
    assert [s.side_call for s in segments] == [True, False], segments
    ends = [s.first_turn for s in segments[1:]] + [len(turns)]
    owned = [turns[s.first_turn:end] for s, end in zip(segments, ends, strict=True)]
    side, main = owned
    assert [tok.decode(t.output_ids, skip_special_tokens=True) for t in side] == [TITLE]
    assert [t.trained for t in side] == [False]
    # One main thread: the second request extends the first (its system message, which
    # Claude Code sends as blocks first and as a string after, is the same text).
    assert [t.trained for t in main] == [True, True]
    assert [tok.decode(t.output_ids, skip_special_tokens=True) for t in main] == [
        FIRST_ANSWER, "Hello!"]
