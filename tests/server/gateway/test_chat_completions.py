"""The OpenAI client against a real gateway on a Unix socket, over the scripted policy."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollout.runtime.types import SegmentReason, Trajectory
from tests.server.gateway.conftest import Rig, openai_client

pytestmark = pytest.mark.timeout(60)

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}]


def call(name: str, **arguments: Any) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


FIRST = "I will list the files.\n" + call("bash", command="ls -la")
SECOND = "Done: there are two files."
TASK = [{"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "What files are here?"}]


def assistant_echo(message: Any) -> dict[str, Any]:
    """What an OpenAI-style harness appends after an answer (its own wire form)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls]
    return out


def flat(traj: Trajectory) -> tuple[list[int], list[int]]:
    return traj.token_ids, traj.loss_mask


async def test_plain_chat_with_tool_calls_captures_the_scripted_ids_exactly(rig: Rig) -> None:
    lease = await rig.open("job-a", [FIRST, SECOND])
    client = openai_client(lease)
    first = await client.chat.completions.create(model="m", messages=TASK, tools=TOOLS)
    msg = first.choices[0].message
    assert msg.content == "I will list the files."
    assert first.choices[0].finish_reason == "tool_calls"
    assert len(msg.tool_calls) == 1
    assert msg.tool_calls[0].function.name == "bash"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"command": "ls -la"}
    history = [*TASK, assistant_echo(msg), {"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                                            "content": "a.txt\nb.txt"}]
    second = await client.chat.completions.create(model="m", messages=history, tools=TOOLS)
    assert second.choices[0].message.content == SECOND
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].finish_reason == "stop"
    capture = await rig.gateway.close(lease)

    assert [s.reason for s in capture.segments] == [SegmentReason.FIRST]
    t0, t1 = capture.turns
    assert t0.output_ids == rig.scripted_ids(FIRST)
    assert t1.output_ids == rig.scripted_ids(SECOND)
    assert t0.tool_calls == ["bash"] and t1.tool_calls == []
    # The prompt the backend saw for turn 1 is exactly turn 0's prompt + output + delta:
    prompt0, prompt1 = (r.prompt_ids for r in rig.engine.requests)
    assert list(prompt0) == t0.prompt_ids
    assert list(prompt1) == [*t0.prompt_ids, *t0.output_ids, *t0.observation_ids,
                             *t1.prompt_ids]
    ids, mask = flat(Trajectory(job_id="job-a", turns=capture.turns,
                                segments=capture.segments))
    assert ids == list(prompt1) + t1.output_ids
    generated = [i for i, m in enumerate(mask) if m]
    assert [ids[i] for i in generated] == [*rig.scripted_ids(FIRST), *rig.scripted_ids(SECOND)]
    # The observation went in as rendered text of the tool message, after the model's own ids.
    assert "a.txt\nb.txt" in rig.tok.decode(t0.observation_ids)
    assert first.usage.completion_tokens == len(t0.output_ids)
    assert first.usage.prompt_tokens == len(t0.prompt_ids)


async def test_streaming_chat_sends_text_and_tool_call_deltas(rig: Rig) -> None:
    lease = await rig.open("job-s", [FIRST, SECOND])
    client = openai_client(lease)
    stream = await client.chat.completions.create(
        model="m", messages=TASK, tools=TOOLS, stream=True,
        stream_options={"include_usage": True})
    text, calls, finish, usage = "", {}, None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                if d.function is not None:
                    entry["name"] += d.function.name or ""
                    entry["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    assert text == "I will list the files."
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("bash", {"command": "ls -la"})]
    assert usage is not None and usage.completion_tokens == len(rig.scripted_ids(FIRST))
    history = [*TASK, {"role": "assistant", "content": text, "tool_calls": [
        {"id": calls[0]["id"], "type": "function",
         "function": {"name": "bash", "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "a.txt"}]
    async with await client.chat.completions.create(model="m", messages=history, tools=TOOLS,
                                                    stream=True) as second:
        pieces = [c.choices[0].delta.content or "" async for c in second if c.choices]
    assert "".join(pieces) == SECOND
    capture = await rig.gateway.close(lease)
    assert len(capture.segments) == 1
    assert [t.output_ids for t in capture.turns] == [rig.scripted_ids(FIRST),
                                                     rig.scripted_ids(SECOND)]
    mask = Trajectory(job_id="s", turns=capture.turns).loss_mask
    ids = Trajectory(job_id="s", turns=capture.turns).token_ids
    assert [t for t, m in zip(ids, mask, strict=True) if m] == [
        *rig.scripted_ids(FIRST), *rig.scripted_ids(SECOND)]


async def test_keys_are_per_job_and_revoked_when_the_lease_closes(rig: Rig) -> None:
    import openai

    a = await rig.open("job-1", ["hello from one", "again"])
    b = await rig.open("job-2", ["hello from two"])
    for key in ("rk-wrong", b.api_key):  # unknown, and another job's, on job 1's socket
        with pytest.raises(openai.AuthenticationError) as info:
            await openai_client(a, key).chat.completions.create(model="m", messages=TASK)
        assert info.value.status_code == 401
        assert info.value.body["code"] == "invalid_api_key"
    ok = await openai_client(a).chat.completions.create(model="m", messages=TASK)
    assert ok.choices[0].message.content == "hello from one"
    models = await openai_client(a).models.list()
    assert len(models.data) == 1 and "/" not in models.data[0].id  # no host path leaks
    await rig.gateway.close(a)
    # Job 2 is unaffected; job 1's key, now ended, is refused on the TCP-less gateway's
    # remaining socket and its own socket is gone.
    ok2 = await openai_client(b).chat.completions.create(model="m", messages=TASK)
    assert ok2.choices[0].message.content == "hello from two"
    with pytest.raises(openai.AuthenticationError):
        await openai_client(b, a.api_key).chat.completions.create(model="m", messages=TASK)
    import os

    assert not os.path.exists(a.socket_path)
    assert len(rig.engine.requests) == 2  # refused requests never reached the model
