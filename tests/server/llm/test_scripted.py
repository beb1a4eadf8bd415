"""The scripted policy (a testing tool): replays messages per session as real token ids."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.llm import GenerateRequest
from rollout.runtime.types import SamplingParams
from rollout.server.llm.engine import EngineError
from rollout.server.llm.scripted import ScriptedEngine
from tests.runtime.doubles import smollm2_tokenizer
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tok() -> Any:
    return smollm2_tokenizer()


def req(session: str, max_tokens: int = 64, **sampling: Any) -> GenerateRequest:
    return GenerateRequest(prompt_ids=[1, 2, 3], sampling=SamplingParams(**sampling),
                           max_tokens=max_tokens, session_id=session)


async def test_replays_each_session_turn_by_turn_with_end_of_turn(tok: Any) -> None:
    eng = ScriptedEngine(tok, {"a": ["first answer", "second"], "b": ["other job"]},
                         policy_version=3)
    r1 = await eng.generate(req("a"))
    rb = await eng.generate(req("b"))
    r2 = await eng.generate(req("a"))
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    assert r1.output_ids == [*tok.encode("first answer", add_special_tokens=False), eot]
    assert tok.decode(r2.output_ids) == "second<|im_end|>"
    assert tok.decode(rb.output_ids) == "other job<|im_end|>"
    assert r1.finish_reason == "stop" and r1.policy_version == 3 and r1.backend == "scripted"
    assert r1.logprobs == [0.0] * len(r1.output_ids)  # probability 1 under a scripted policy
    assert [r.session_id for r in eng.requests] == ["a", "b", "a"]


async def test_max_tokens_cuts_the_reply_and_drops_end_of_turn(tok: Any) -> None:
    eng = ScriptedEngine(tok, {"s": ["one two three four five six"]})
    full = tok.encode("one two three four five six", add_special_tokens=False)
    res = await eng.generate(req("s", max_tokens=3))
    assert res.output_ids == full[:3] and res.finish_reason == "length"
    assert len(res.logprobs) == 3
    # Exactly enough room for the text and the end-of-turn token: a normal stop.
    await eng.release_session("s")
    res = await eng.generate(req("s", max_tokens=len(full) + 1))
    assert res.finish_reason == "stop" and res.output_ids[-1] == tok.eos_token_id


async def test_stop_token_ids_end_the_reply(tok: Any) -> None:
    text = "alpha beta gamma"
    ids = tok.encode(text, add_special_tokens=False)
    eng = ScriptedEngine(tok, {"s": [text]})
    res = await eng.generate(req("s", stop_token_ids=(ids[1],)))
    assert res.output_ids == ids[:2] and res.finish_reason == "stop"


async def test_callable_script_sees_session_and_turn(tok: Any) -> None:
    eng = ScriptedEngine(tok, lambda sid, turn: f"{sid} turn {turn}")
    await eng.generate(req("x"))
    res = await eng.generate(req("x"))
    assert tok.decode(res.output_ids) == "x turn 1<|im_end|>"
    await eng.release_session("x")  # a released session starts over
    res = await eng.generate(req("x"))
    assert tok.decode(res.output_ids) == "x turn 0<|im_end|>"
    assert eng.released == ["x"]


async def test_unknown_session_or_exhausted_script_is_an_engine_error(tok: Any) -> None:
    eng = ScriptedEngine(tok, {"s": ["only"]})
    with pytest.raises(EngineError, match="no script"):
        await eng.generate(req("nope"))
    await eng.generate(req("s"))
    with pytest.raises(EngineError, match="only 1 turns"):
        await eng.generate(req("s"))


async def test_from_jsonl_file(tok: Any, tmp_path: Path) -> None:
    path = tmp_path / "scripts.jsonl"
    path.write_text(json.dumps({"job_id": "j1", "messages": ["hi", "bye"]}) + "\n\n"
                    + json.dumps({"job_id": "j2", "messages": ["yo"]}) + "\n")
    eng = ScriptedEngine.from_file(path, tok, name="replay", policy_version=5)
    assert eng.name == "replay" and eng.policy_version == 5 and eng.tokenizer is tok
    assert tok.decode((await eng.generate(req("j2"))).output_ids) == "yo<|im_end|>"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"job_id": "j1", "messages": ["ok"]}\n{"job_id": 3, "messages": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        ScriptedEngine.from_file(bad, tok)


async def test_abort_ends_an_in_flight_turn_and_weights_update_version(tok: Any) -> None:
    eng = ScriptedEngine(tok, {"s": ["slow", "next"]}, latency_s=30.0)
    task = asyncio.create_task(eng.generate(req("s")))
    await assert_eventually(lambda: eng.requests)
    await eng.abort("s")
    res = await asyncio.wait_for(task, 5)
    assert res.finish_reason == "abort" and res.output_ids == []
    await eng.abort("s")  # nothing in flight: must not poison the next turn
    eng.latency_s = 0.0
    await eng.update_weights(None, 9)
    res = await eng.generate(req("s"))
    assert res.finish_reason == "stop" and res.policy_version == 9
    assert await eng.health()


async def test_engines_sharing_turns_continue_a_failed_over_session(tok: Any) -> None:
    turns: dict[str, int] = {}
    scripts = {"s": ["one", "two"]}
    a = ScriptedEngine(tok, scripts, name="a", turns=turns)
    b = ScriptedEngine(tok, scripts, name="b", turns=turns)
    assert tok.decode((await a.generate(req("s"))).output_ids) == "one<|im_end|>"
    assert tok.decode((await b.generate(req("s"))).output_ids) == "two<|im_end|>"
