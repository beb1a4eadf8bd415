"""The Responses API (Codex CLI's) and Anthropic Messages, with the official clients."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollout.runtime.types import SegmentReason, Trajectory
from tests.server.gateway.conftest import Rig, anthropic_client, openai_client
from tests.server.gateway.test_chat_completions import call

pytestmark = pytest.mark.timeout(60)

FIRST = "Reading the file.\n" + call("shell", command=["cat", "a.py"])
SECOND = "The file defines add()."
RESPONSES_TOOLS = [{"type": "function", "name": "shell", "description": "Run a command.",
                    "parameters": {"type": "object", "properties": {
                        "command": {"type": "array", "items": {"type": "string"}}}},
                    "strict": False}]
ANTHROPIC_TOOLS = [{"name": "shell", "description": "Run a command.", "input_schema": {
    "type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}}}]


def model_ids(rig: Rig, turns: Any) -> list[int]:
    traj = Trajectory(job_id="x", turns=list(turns))
    return [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]


def check_capture(rig: Rig, capture: Any) -> None:
    assert [s.reason for s in capture.segments] == [SegmentReason.FIRST]
    assert [t.output_ids for t in capture.turns] == [rig.scripted_ids(FIRST),
                                                     rig.scripted_ids(SECOND)]
    assert model_ids(rig, capture.turns) == rig.scripted_ids(FIRST) + rig.scripted_ids(SECOND)
    last = rig.engine.requests[-1].prompt_ids
    t0, t1 = capture.turns
    assert list(last) == [*t0.prompt_ids, *t0.output_ids, *t0.observation_ids, *t1.prompt_ids]


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_round_trip_with_function_calls(rig: Rig, stream: bool) -> None:
    lease = await rig.open(f"job-resp-{stream}", [FIRST, SECOND])
    client = openai_client(lease)
    task: list[dict[str, Any]] = [{"role": "user", "content": "What is in a.py?"}]
    kwargs: dict[str, Any] = {"model": "m", "instructions": "You are Codex.",
                              "tools": RESPONSES_TOOLS, "store": False}
    if stream:
        types: list[str] = []
        seqs: list[int] = []
        async with client.responses.stream(input=task, **kwargs) as events:
            async for event in events:
                types.append(event.type)
                seqs.append(event.sequence_number)
            first = await events.get_final_response()
        assert types[:2] == ["response.created", "response.in_progress"]
        assert types[-1] == "response.completed"
        assert "response.output_text.delta" in types
        assert "response.function_call_arguments.delta" in types
        assert seqs == list(range(len(seqs)))  # counted up from 0 without gaps
    else:
        first = await client.responses.create(input=task, **kwargs)
    assert first.output_text == "Reading the file."
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("shell", {"command": ["cat", "a.py"]})]
    assert first.usage.output_tokens == len(rig.scripted_ids(FIRST))
    # Codex resends everything: its input, our output items, and the call's output.
    echo = [item.model_dump(exclude_none=True) for item in first.output]
    history = [*task, *echo, {"type": "function_call_output", "call_id": calls[0].call_id,
                              "output": "def add(a, b): return a + b"}]
    second = await client.responses.create(input=history, **kwargs)
    assert second.output_text == SECOND
    assert not [i for i in second.output if i.type == "function_call"]
    check_capture(rig, await rig.gateway.close(lease))


async def test_responses_previous_response_id_extends_the_same_segment(rig: Rig) -> None:
    lease = await rig.open("job-prev", [FIRST, SECOND])
    client = openai_client(lease)
    kwargs: dict[str, Any] = {"model": "m", "instructions": "You are Codex.",
                              "tools": RESPONSES_TOOLS}
    first = await client.responses.create(input="What is in a.py?", **kwargs)
    call_id = next(i.call_id for i in first.output if i.type == "function_call")
    second = await client.responses.create(
        previous_response_id=first.id, input=[{"type": "function_call_output",
                                               "call_id": call_id, "output": "def add"}],
        **kwargs)
    assert second.output_text == SECOND
    check_capture(rig, await rig.gateway.close(lease))


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_messages_round_trip_with_tool_use(rig: Rig, stream: bool) -> None:
    lease = await rig.open(f"job-claude-{stream}", [FIRST, SECOND])
    client = anthropic_client(lease)
    task: list[dict[str, Any]] = [{"role": "user", "content": "What is in a.py?"}]
    kwargs: dict[str, Any] = {"model": "m", "max_tokens": 256, "system": "You are Claude.",
                              "tools": ANTHROPIC_TOOLS}
    if stream:
        async with client.messages.stream(messages=task, **kwargs) as events:
            kinds = [event.type async for event in events]
            first = await events.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    else:
        first = await client.messages.create(messages=task, **kwargs)
    assert first.stop_reason == "tool_use"
    text = [b.text for b in first.content if b.type == "text"]
    uses = [b for b in first.content if b.type == "tool_use"]
    assert text == ["Reading the file."]
    assert [(u.name, u.input) for u in uses] == [("shell", {"command": ["cat", "a.py"]})]
    assert first.usage.output_tokens == len(rig.scripted_ids(FIRST))
    history = [*task, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                             "content": "def add(a, b): return a + b"}]}]
    second = await client.messages.create(messages=history, **kwargs)
    assert [b.text for b in second.content if b.type == "text"] == [SECOND]
    assert second.stop_reason == "end_turn"
    check_capture(rig, await rig.gateway.close(lease))


async def test_anthropic_wrong_key_and_oversize_get_anthropic_errors(rig: Rig) -> None:
    import anthropic

    lease = await rig.open("job-claude-auth", ["x"])
    with pytest.raises(anthropic.AuthenticationError) as info:
        await anthropic_client(lease, "rk-wrong").messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.APIStatusError) as big:
        await anthropic_client(lease).messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "x" * (9 << 20)}])
    assert big.value.status_code == 413
    assert big.value.body["error"]["type"] == "request_too_large"
