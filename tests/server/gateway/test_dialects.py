"""One shape for the three dialects: errors in each API's own JSON, Claude Code's requests,
logprobs and usage that match the trajectory, count_tokens, and a gateway that, stopped,
holds nothing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.gateway import GatewayLease
from rollout.runtime.types import JobSpec, Limits, SamplingParams
from rollout.server.gateway import Gateway, anthropic, openai_chat, responses
from rollout.server.gateway.routes import DIALECTS
from tests.server.gateway.conftest import anthropic_client, openai_client
from tests.server.gateway.policy_double import PromptPolicy
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def llm(tok: Any) -> PromptPolicy:
    return PromptPolicy(tok, tok.convert_tokens_to_ids("<|im_end|>"))


@pytest.fixture
async def gateway(tmp_path: Path) -> Any:
    gw = await Gateway(tmp_path / "state").start()
    yield gw
    await gw.stop()


def spec(job_id: str = "job") -> JobSpec:
    return JobSpec(job_id=job_id, environment="harness", task={},
                   sampling=SamplingParams(seed=1, max_tokens_per_turn=32),
                   limits=Limits(max_turns=16))


async def post(lease: GatewayLease, path: str, body: bytes) -> tuple[int, Any]:
    import httpx2

    transport = httpx2.AsyncHTTPTransport(uds=lease.socket_path)
    async with httpx2.AsyncClient(transport=transport) as http:
        reply = await http.post(f"http://gateway{path}", content=body, headers={
            "Authorization": f"Bearer {lease.api_key}", "Content-Type": "application/json"})
    return reply.status_code, reply.json()


def test_every_dialect_has_the_same_role_functions() -> None:
    for module in (openai_chat, responses, anthropic):
        for role in ("parse", "respond", "stream", "error_body", "new_id"):
            assert callable(getattr(module, role)), (module.__name__, role)
    assert set(DIALECTS) == {"/v1/chat/completions", "/v1/responses", "/v1/messages"}


@pytest.mark.parametrize(("path", "shape"), [("/v1/chat/completions", "openai"),
                                              ("/v1/responses", "openai"),
                                              ("/v1/messages", "anthropic")])
async def test_deep_json_gets_the_apis_own_error(gateway: Gateway, llm: PromptPolicy,
                                                 path: str, shape: str) -> None:
    lease = await gateway.open(spec(), llm)
    status, body = await post(lease, path, b"[" * 100_000 + b"]" * 100_000)
    assert status == 400
    if shape == "openai":
        assert body["error"]["code"] == "invalid_json"
    else:
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


async def test_deep_json_in_a_tool_calls_arguments_is_kept_as_text(gateway: Gateway,
                                                                   llm: PromptPolicy) -> None:
    """A harness's earlier tool call whose ``arguments`` string nests JSON past the parser's
    recursion limit is text the gateway keeps as it is (as any arguments that are not JSON),
    not a gateway failure."""
    lease = await gateway.open(spec(), llm)
    deep = "[" * 3_000 + "]" * 3_000  # past the parser's recursion limit, within the budget
    status, body = await post(lease, "/v1/chat/completions", json.dumps({
        "model": "m", "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "bash", "arguments": deep}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]}).encode())
    assert status == 200, body
    assert body["choices"][0]["message"]["role"] == "assistant"


async def test_a_gateway_bug_is_a_500_in_the_apis_json(gateway: Gateway, llm: PromptPolicy,
                                                       monkeypatch: Any) -> None:
    lease = await gateway.open(spec(), llm)

    async def broken(self: Any, request: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr("rollout.server.gateway.conversation.JobConversation.serve", broken)
    status, body = await post(lease, "/v1/messages", json.dumps(
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    ).encode())
    assert status == 500 and body["type"] == "error" and body["error"]["type"] == "api_error"
    status, body = await post(lease, "/v1/chat/completions", json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode())
    assert status == 500 and body["error"]["code"] == "internal_error"


CLAUDE_CODE_SYSTEM = [
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
     "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": "You are an interactive CLI tool that helps users with software "
     "engineering tasks."}]
CLAUDE_CODE_TOOLS = [{"name": "Bash", "description": "Run a command.", "input_schema": {
    "type": "object", "properties": {"command": {"type": "string"}},
    "required": ["command"]}}, {"type": "web_search_20250305", "name": "web_search"}]


async def test_claude_codes_first_request_with_a_system_message_inside(
        gateway: Gateway, llm: PromptPolicy) -> None:
    """Claude Code (2.x, current model names) puts a ``system`` message among its messages,
    sends thinking settings and metadata, and streams; then echoes thinking blocks back."""
    lease = await gateway.open(spec(), llm)
    client = anthropic_client(lease)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>Be brief."
                                      "</system-reminder>"},
                                     {"type": "text", "text": "Fix the failing test.",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": "The deferred tools are listed below."},
        {"role": "system", "content": []},
    ]
    async with client.messages.stream(
            model="claude-opus-4-8", max_tokens=32000, system=CLAUDE_CODE_SYSTEM,
            messages=messages, tools=CLAUDE_CODE_TOOLS,
            metadata={"user_id": "user_abc_account__session_123"},
            thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        first = await stream.get_final_message()
    assert first.model == "claude-opus-4-8"
    text = "".join(b.text for b in first.content if b.type == "text")
    assert text.startswith("reply ")
    # The echo (with a thinking block of the client's own) extends the chain.
    messages += [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": "sig"},
        {"type": "text", "text": text}]},
        {"role": "user", "content": "Go on."}]
    second = await client.messages.create(model="claude-opus-4-8", max_tokens=100,
                                          system=CLAUDE_CODE_SYSTEM, messages=messages,
                                          tools=CLAUDE_CODE_TOOLS)
    assert second.stop_reason == "end_turn"
    capture = await gateway.close(lease)
    assert len(capture.segments) == 1 and len(capture.turns) == 2
    # The mid-conversation system text reached the model (said as a user turn).
    prompt = llm.tok.decode(llm.calls[0][0])
    assert "The deferred tools are listed below." in prompt


async def test_a_reasoning_model_answers_with_a_thinking_block(gateway: Gateway,
                                                               llm: PromptPolicy) -> None:
    llm.replies.append("<think>\nThe test fails on empty input.\n</think>\n\nFixed it.")
    lease = await gateway.open(spec(), llm)
    client = anthropic_client(lease)
    answer = await client.messages.create(model="claude-opus-4-1", max_tokens=100, messages=[
        {"role": "user", "content": "Fix it."}])
    kinds = [b.type for b in answer.content]
    assert kinds == ["thinking", "text"]
    assert answer.content[0].thinking == "The test fails on empty input."
    assert answer.content[1].text == "Fixed it."


async def test_count_tokens_is_the_prompts_length(gateway: Gateway, llm: PromptPolicy) -> None:
    lease = await gateway.open(spec(), llm)
    client = anthropic_client(lease)
    messages = [{"role": "user", "content": "How long is this?"}]
    counted = await client.messages.count_tokens(model="claude-haiku-4-5", system="Be brief.",
                                                 messages=messages)
    await client.messages.create(model="m", max_tokens=10, system="Be brief.",
                                 messages=messages)
    assert counted.input_tokens == len(llm.calls[0][0])
    capture = await gateway.close(lease)
    assert capture.requests == 1  # counting is no request


async def test_logprobs_and_usage_are_the_trajectorys(gateway: Gateway,
                                                      llm: PromptPolicy) -> None:
    lease = await gateway.open(spec(), llm)
    client = openai_client(lease)
    answer = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True,
        top_logprobs=3)
    capture = gateway.capture(lease)
    turn = capture.turns[0]
    content = answer.choices[0].logprobs.content
    # Every sampled token but the end-of-turn one, with its own recorded logprob.
    assert [c.logprob for c in content] == pytest.approx(turn.output_logprobs[:-1])
    assert "".join(c.token for c in content) == answer.choices[0].message.content
    # This double reports no alternatives; none are made up (the model's own are tested in
    # test_top_logprobs.py).
    assert all(c.top_logprobs == [] for c in content)
    assert answer.usage.prompt_tokens == len(turn.prompt_ids)
    assert answer.usage.completion_tokens == len(turn.output_ids)
    plain = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hello"}])
    assert plain.choices[0].logprobs is None
    # The same request retried with logprobs: the same generation, now with its logprobs.
    again = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hello"}], logprobs=True)
    assert [c.logprob for c in again.choices[0].logprobs.content] == pytest.approx(
        capture.turns[1].output_logprobs[:-1])
    assert len(capture.turns) == 2


async def test_a_stopped_gateway_holds_nothing(short_tmp: Path, llm: PromptPolicy) -> None:
    llm.gate = asyncio.Event()
    gw = await Gateway(short_tmp / "state", tcp_port=0).start()
    leases = [await gw.open(spec(f"job-{k}"), llm) for k in range(2)]
    clients = [openai_client(lease) for lease in leases]
    calls = [asyncio.ensure_future(c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": f"task {k}"}]))
        for k, c in enumerate(clients)]
    await assert_eventually(lambda: llm.in_flight == 2)
    before = asyncio.all_tasks()
    await gw.stop()
    for call in calls:
        with pytest.raises(Exception):  # noqa: B017 - the connection or a 503, either way
            await call
    assert llm.cancelled == 2 and llm.in_flight == 0
    assert not gw._leases and gw._tcp is None
    assert not any(Path(lease.socket_path).exists() for lease in leases)
    root = short_tmp / "state" / "gateway"
    assert not list(root.iterdir())
    pending = [t for t in before if not t.done() and t is not asyncio.current_task()
               and t not in calls]
    assert not pending, pending


async def test_a_tool_result_with_an_image_is_said_in_words(gateway: Gateway,
                                                            llm: PromptPolicy) -> None:
    lease = await gateway.open(spec(), llm)
    client = anthropic_client(lease)
    await client.messages.create(model="m", max_tokens=10, messages=[
        {"role": "user", "content": "Look at the plot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read",
                                           "input": {"file_path": "plot.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "plot.png:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}},
            {"type": "tool_reference", "tool_name": "WebFetch"}]}]}])
    prompt = llm.tok.decode(llm.calls[0][0])
    assert "plot.png:[image omitted][tool WebFetch]" in prompt
