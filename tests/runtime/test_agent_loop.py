"""The agent loop against the scripted policy (real tokenizer, real token accounting)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.agent_loop import (
    TURNS_KEY,
    build_system_prompt,
    prepare_messages,
    run_agent_loop,
)
from rollout.runtime.handler import JobContext
from rollout.runtime.llm import LLMUnavailable
from rollout.runtime.tokens import ChatTokenizer
from rollout.runtime.tools.base import ToolResult
from rollout.runtime.tools.submit import SUBMITTED_ANSWER_KEY, SubmitTool
from rollout.runtime.types import GroupSpec, JobSpec, Limits, SamplingParams, TerminationReason
from rollout.server.llm.engine import EngineError
from rollout.server.llm.scripted import ScriptedEngine
from tests.runtime.doubles import QWEN25_TEMPLATE, EngineClient, smollm2_tokenizer
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(60)

TASK = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Do it."}]


def call(name: str, **arguments: Any) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


class EchoTool:
    name = "echo"
    description = "Echo the text back."
    parameters: Mapping[str, Any] = {"type": "object", "properties": {"text": {"type": "string"}}}

    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls: list[Mapping[str, Any]] = []
        self.delay_s = delay_s

    async def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        self.calls.append(arguments)
        await asyncio.sleep(self.delay_s)
        return ToolResult(f"echo: {arguments.get('text')}")


class CrashTool:
    name = "crash"
    description = "Always fails."
    parameters: Mapping[str, Any] = {"type": "object", "properties": {}}

    async def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        if arguments.get("timeout"):
            raise TimeoutError("the tool's own timeout, not the job's deadline")
        raise RuntimeError("disk on fire")


@pytest.fixture(scope="module")
def tok() -> Any:
    return smollm2_tokenizer()


def make_ctx(tok: Any, script: Sequence[str], *, job_id: str = "job-1", latency_s: float = 0.0,
             context_length: int | None = None,
             **sampling: Any) -> tuple[JobContext, ScriptedEngine, EngineClient, list[Any]]:
    engine = ScriptedEngine(tok, {job_id: list(script)}, policy_version=4, latency_s=latency_s)
    client = EngineClient(engine, context_length=context_length)
    events: list[Any] = []
    spec = JobSpec(job_id=job_id, environment="test", task={},
                   sampling=SamplingParams(**{"seed": 100, **sampling}),
                   limits=Limits(max_turns=5), group=GroupSpec("g-1", size=2),
                   min_policy_version=2)
    ctx = JobContext(spec=spec, llm=client, progress=lambda e, d: events.append((e, dict(d))))
    return ctx, engine, client, events


async def test_tool_call_then_submit_builds_an_exact_trajectory(tok: Any) -> None:
    script = [f"Let me look.\n{call('echo', text='hi')}", call("submit", answer="42")]
    ctx, engine, client, events = make_ctx(tok, script)
    echo = EchoTool()
    out = await run_agent_loop(ctx, [echo, SubmitTool(ctx.state)], TASK)

    assert out.termination is TerminationReason.SUBMITTED
    assert out.metadata[SUBMITTED_ANSWER_KEY] == "42" == ctx.state[SUBMITTED_ANSWER_KEY]
    assert echo.calls == [{"text": "hi"}]
    t0, t1 = out.turns
    assert [t.tool_calls for t in out.turns] == [["echo"], ["submit"]]
    # Model tokens are exactly what the policy produced, with their logprobs.
    eot = tok.eos_token_id
    assert t0.output_ids == [*tok.encode(script[0], add_special_tokens=False), eot]
    assert len(t0.output_logprobs) == len(t0.output_ids)
    assert (t0.policy_version, t0.backend, t0.finish_reason) == (4, "scripted", "stop")
    # Each request's prompt is the previous prompt + output + observation + generation prompt.
    r0, r1 = engine.requests
    assert list(r0.prompt_ids) == t0.prompt_ids
    assert list(r1.prompt_ids) == (t0.prompt_ids + t0.output_ids + t0.observation_ids
                                   + t1.prompt_ids)
    assert tok.decode(t0.observation_ids) == "\n<|im_start|>tool\necho: hi<|im_end|>\n"
    assert tok.decode(t1.prompt_ids) == "<|im_start|>assistant\n"
    # Sampling routing: session = job, group, policy floor, per-turn seed.
    assert [(r.session_id, r.group_id, r.min_policy_version, r.seed) for r in engine.requests] \
        == [("job-1", "g-1", 2, 100), ("job-1", "g-1", 2, 101)]
    system = tok.decode(t0.prompt_ids)
    assert system.startswith("<|im_start|>system\nUse the tools.\n\n# Tools")
    assert '"name": "submit"' in system and "<tool_call>" in system
    assert client.ended == ["job-1"]
    assert [e for e, _ in events] == ["turn", "turn"]
    assert events[0][1]["tool_calls"] == ["echo"] and events[1][1]["turn"] == 1
    # Running totals of the attempt, for progress displays that keep no per-job state.
    assert [(d["turns_done"], d["generated_tokens"], d["tool_calls_total"]) for _, d in events] \
        == [(1, len(t0.output_ids), 1), (2, len(t0.output_ids) + len(t1.output_ids), 2)]
    assert out.metadata["final_text"] == script[1]


async def test_noncanonical_model_ids_reach_the_trajectory_untouched(tok: Any) -> None:
    ctx, engine, _, _ = make_ctx(tok, [call("echo", text="hello"), "ok"])
    real_generate = engine.generate
    odd = tok.convert_tokens_to_ids(["h", "ello"])  # "hello", canonically one token

    async def respell(request: Any) -> Any:
        res = await real_generate(request)
        one = tok.convert_tokens_to_ids("hello")
        out = [i for t in res.output_ids for i in (odd if t == one else [t])]
        return type(res)(out, [0.0] * len(out), res.finish_reason, res.policy_version,
                          res.backend)

    engine.generate = respell  # type: ignore[method-assign]
    echo = EchoTool()
    out = await run_agent_loop(ctx, [echo], TASK)
    assert echo.calls == [{"text": "hello"}]
    first = out.turns[0].output_ids
    assert any(first[i:i + 2] == odd for i in range(len(first)))
    traj = [i for t in out.turns for i in t.prompt_ids + t.output_ids + t.observation_ids]
    start = len(out.turns[0].prompt_ids)
    assert traj[start:start + len(first)] == first
    assert list(engine.requests[1].prompt_ids)[start:start + len(first)] == first


async def test_model_mistakes_become_error_observations(tok: Any) -> None:
    script = ['<tool_call>\n{"name": "echo", "arguments": {oops</tool_call>',
              call("nosuch", x=1), call("crash"), call("crash", timeout=True),
              "I give up; the answer is 7."]
    ctx, _, _, _ = make_ctx(tok, script)
    out = await run_agent_loop(ctx, [EchoTool(), CrashTool()], TASK)
    assert out.termination is TerminationReason.NO_TOOL_CALL
    assert len(out.turns) == 5
    obs = [tok.decode(t.observation_ids) for t in out.turns]
    assert "Error: could not parse tool call" in obs[0]
    assert "unknown tool 'nosuch'" in obs[1] and "crash, echo" in obs[1]
    assert "tool crash failed: RuntimeError: disk on fire" in obs[2]
    assert "tool crash failed: TimeoutError: the tool's own timeout" in obs[3]
    assert out.turns[4].observation_ids == []
    assert out.metadata["final_text"] == "I give up; the answer is 7."
    assert SUBMITTED_ANSWER_KEY not in out.metadata


async def test_max_turns_runs_the_last_calls_and_stops(tok: Any) -> None:
    ctx, engine, _, _ = make_ctx(tok, [call("echo", text=str(i)) for i in range(5)])
    echo = EchoTool()
    out = await run_agent_loop(ctx, [echo], TASK, max_turns=3)
    assert out.termination is TerminationReason.MAX_TURNS
    assert len(out.turns) == len(engine.requests) == 3
    assert len(echo.calls) == 3  # the last turn's edit still counts for EVAL
    assert out.turns[-1].observation_ids == []


def initial_prompt(tok: Any) -> list[int]:
    chat = ChatTokenizer(tok)
    msgs, tools = prepare_messages(chat, [EchoTool()], TASK)
    return chat.initial_prompt(msgs, tools)


async def test_token_budget_clips_turns_and_bounds_the_trajectory(tok: Any) -> None:
    budget = len(initial_prompt(tok)) + 60
    ctx, engine, _, _ = make_ctx(tok, [call("echo", text="x"), "word " * 200],
                                 total_token_budget=budget, max_tokens_per_turn=512)
    out = await run_agent_loop(ctx, [EchoTool()], TASK)
    assert out.termination is TerminationReason.TOKEN_BUDGET
    traj = [i for t in out.turns for i in t.prompt_ids + t.output_ids + t.observation_ids]
    assert len(traj) == budget
    assert engine.requests[0].max_tokens == 60
    assert engine.requests[1].max_tokens == budget - len(engine.requests[1].prompt_ids)
    assert out.turns[1].finish_reason == "length"


async def test_response_budget_counts_only_generated_tokens(tok: Any) -> None:
    first = call("echo", text="x")
    n_first = len(tok.encode(first, add_special_tokens=False))
    ctx, engine, _, _ = make_ctx(tok, [first, "word " * 200], max_tokens_per_turn=512,
                                 max_response_tokens=n_first + 30)
    out = await run_agent_loop(ctx, [EchoTool()], TASK)
    assert out.termination is TerminationReason.TOKEN_BUDGET
    # The prompt and the echo's observation do not count; the second turn gets what is left.
    assert engine.requests[0].max_tokens == n_first + 30
    assert engine.requests[1].max_tokens == n_first + 30 - len(out.turns[0].output_ids)
    assert sum(len(t.output_ids) for t in out.turns) == n_first + 30
    assert out.turns[1].finish_reason == "length"


async def test_response_budget_spent_by_a_tool_turn_ends_after_its_calls(tok: Any) -> None:
    first = call("echo", text="x")
    # The scripted model ends its turn with one end-of-turn token.
    ctx, engine, _, _ = make_ctx(tok, [first, first], max_response_tokens=len(
        tok.encode(first, add_special_tokens=False)) + 1)
    echo = EchoTool()
    out = await run_agent_loop(ctx, [echo], TASK)
    assert out.termination is TerminationReason.TOKEN_BUDGET
    assert len(engine.requests) == 1 and len(echo.calls) == 1
    assert out.turns[-1].observation_ids == []


async def test_context_length_smaller_than_budget_is_the_reported_limit(tok: Any) -> None:
    ctx, engine, _, _ = make_ctx(tok, ["word " * 100],
                                 context_length=len(initial_prompt(tok)) + 10)
    out = await run_agent_loop(ctx, [EchoTool()], TASK)
    assert out.termination is TerminationReason.CONTEXT_LENGTH
    assert engine.requests[0].max_tokens == 10


@pytest.mark.parametrize("engine_honours_timeout", [True, False])
async def test_deadline_during_generation_returns_turns_so_far(
        tok: Any, engine_honours_timeout: bool) -> None:
    ctx, engine, client, _ = make_ctx(tok, [call("echo", text="a"), "never ever again"],
                                      latency_s=0.0)
    echo = EchoTool()
    real_generate = engine.generate

    async def slow_second_turn(request: Any) -> Any:
        if len(engine.requests) == 1:
            engine.latency_s = 30.0
            if not engine_honours_timeout:  # an engine that ignores timeout_s
                request = dataclasses.replace(request, timeout_s=None)
        return await real_generate(request)

    engine.generate = slow_second_turn  # type: ignore[method-assign]
    out = await run_agent_loop(ctx, [echo], TASK, deadline=time.monotonic() + 2.0)
    assert out.termination is TerminationReason.DEADLINE
    assert out.turns[0].tool_calls == ["echo"]
    if engine_honours_timeout:  # the partial second turn is kept as sampled
        assert len(out.turns) == 2 and out.turns[1].finish_reason == "deadline"
        ids = tok.encode("never ever again", add_special_tokens=False)
        assert out.turns[1].output_ids == ids[:len(ids) // 2]
    else:  # the loop's own backstop cancels the call: nothing of it can be kept
        assert len(out.turns) == 1
    assert client.ended == ["job-1"]


async def test_does_not_start_a_turn_that_cannot_finish(tok: Any) -> None:
    ctx, engine, _, _ = make_ctx(tok, [call("echo", text="a"), "x"])
    out = await run_agent_loop(ctx, [EchoTool(delay_s=0.4)], TASK,
                               deadline=time.monotonic() + 0.6)
    assert out.termination is TerminationReason.DEADLINE
    assert len(engine.requests) == 1  # turn 1 (expected to take ~0.4 s) was never started


async def test_backend_failure_raises_and_still_ends_the_session(tok: Any) -> None:
    ctx, _, client, _ = make_ctx(tok, [call("echo", text="a")])  # the 2nd turn has no script
    with pytest.raises(LLMUnavailable):
        await run_agent_loop(ctx, [EchoTool()], TASK)
    assert client.ended == ["job-1"]
    assert len(ctx.state[TURNS_KEY]) == 1


async def test_cancellation_propagates_and_turns_stay_salvageable(tok: Any) -> None:
    ctx, engine, client, _ = make_ctx(tok, [call("echo", text="a"), "slow"])
    engine.latency_s = 0.0
    echo = EchoTool()

    async def run() -> Any:
        return await run_agent_loop(ctx, [echo], TASK)

    real_generate = engine.generate

    async def gated(request: Any) -> Any:
        if engine.requests:
            engine.latency_s = 30.0
        return await real_generate(request)

    engine.generate = gated  # type: ignore[method-assign]
    task = asyncio.create_task(run())
    await assert_eventually(lambda: len(engine.requests) == 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client.ended == ["job-1"]
    assert [t.tool_calls for t in ctx.state[TURNS_KEY]] == [["echo"]]


async def test_abort_from_the_backend_is_a_cancelled_trajectory(tok: Any) -> None:
    ctx, engine, _, _ = make_ctx(tok, [call("echo", text="a"), "slow"])
    real_generate = engine.generate

    async def aborting(request: Any) -> Any:
        if engine.requests:
            engine.latency_s = 30.0
            asyncio.get_running_loop().call_later(0.05, asyncio.ensure_future,
                                                  engine.abort(request.session_id))
        return await real_generate(request)

    engine.generate = aborting  # type: ignore[method-assign]
    out = await run_agent_loop(ctx, [EchoTool()], TASK)
    assert out.termination is TerminationReason.CANCELLED and len(out.turns) == 1


async def test_template_with_tool_support_renders_the_tools_itself(tok: Any) -> None:
    ctx, _, _, _ = make_ctx(tok, [call("echo", text="q"), call("submit", answer="x")])
    out = await run_agent_loop(ctx, [EchoTool(), SubmitTool(ctx.state)], TASK,
                               chat_template=QWEN25_TEMPLATE)
    assert out.termination is TerminationReason.SUBMITTED
    text = tok.decode(out.turns[0].prompt_ids)
    assert text.count("# Tools") == 1 and text.startswith("<|im_start|>system\nUse the tools.")
    assert "<tool_response>\necho: q\n</tool_response>" in tok.decode(out.turns[0].observation_ids)
    assert out.metadata["template_append_only"] == "true"


def test_build_system_prompt_lists_every_tool() -> None:
    text = build_system_prompt([EchoTool(), SubmitTool()], "Be brief.")
    assert text.startswith("Be brief.\n\n# Tools")
    schemas = [json.loads(line) for line in text.split("<tools>\n")[1].split("\n</tools>")[0]
               .splitlines()]
    assert [s["function"]["name"] for s in schemas] == ["echo", "submit"]
    assert build_system_prompt([], "Be brief.") == "Be brief."


async def test_submit_tool_requires_an_answer_and_stringifies_values() -> None:
    state: dict[str, Any] = {}
    tool = SubmitTool(state)
    bad = await tool({})
    assert bad.is_error and not bad.finish and SUBMITTED_ANSWER_KEY not in state
    ok = await tool({"answer": [1, 2]})
    assert ok.finish and state[SUBMITTED_ANSWER_KEY] == "[1, 2]" == tool.answer


async def test_through_the_backend_pool_with_failover(tok: Any) -> None:
    """The real pool between loop and engines: the backend of turn 0 dies, the turn is retried
    on the other one, and the trajectory carries on (the engines share the script position)."""
    from rollout.server.llm.backend_pool import BackendPool

    turns: dict[str, int] = {}
    script = {"job-1": [call("echo", text="a"), call("echo", text="b"), "done"]}
    engines = [ScriptedEngine(tok, script, name=n, turns=turns, policy_version=4)
               for n in ("a", "b")]
    served: list[str] = []
    for engine in engines:
        real = engine.generate

        async def generate(request: Any, engine: ScriptedEngine = engine,
                           real: Any = real) -> Any:
            if served and served[0] == engine.name:
                raise EngineError(f"{engine.name} crashed")
            result = await real(request)
            served.append(engine.name)
            return result

        engine.generate = generate  # type: ignore[method-assign]
    pool = BackendPool(engines, health_interval_s=0, wait_for_backend_s=5.0)
    ctx, _, _, _ = make_ctx(tok, [])
    ctx.llm = pool
    try:
        out = await run_agent_loop(ctx, [EchoTool()], TASK)
    finally:
        await pool.close()
    first, other = served[0], served[1]
    assert first != other
    assert [t.backend for t in out.turns] == [first, other, other]
    assert out.termination is TerminationReason.NO_TOOL_CALL
    assert out.metadata["final_text"] == "done"
    assert "job-1" in next(e for e in engines if e.name == other).released


async def test_real_bash_tool_in_a_bwrap_sandbox(tok: Any, tmp_path: Path) -> None:
    from rollout.runtime.sandbox.base import SandboxConfig, create_sandbox
    from rollout.runtime.tools import make_tools

    script = [call("bash", command="cd /workspace && echo hello > f.txt && export X=41"),
              call("bash", command="cat f.txt; pwd; echo $((X + 1)); id -u"),
              call("submit", answer="done")]
    ctx, _, _, _ = make_ctx(tok, script)
    ctx.sandbox_factory = functools.partial(create_sandbox, SandboxConfig(state_dir=tmp_path))
    async with ctx.resources:
        sandbox = await ctx.open_sandbox()
        tools = [*make_tools(sandbox, ["bash"]), SubmitTool(ctx.state)]
        out = await run_agent_loop(ctx, tools, TASK)
    assert out.termination is TerminationReason.SUBMITTED
    second = tok.decode(out.turns[1].observation_ids)
    assert "hello\n/workspace\n42\n" in second  # the shell kept cwd and exports across turns
    assert "\n0\n" not in second  # not root inside the sandbox


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_real_smollm2_trajectory_round_trips(tok: Any) -> None:
    """The real model through the in-process engine: ids, mask and logprobs line up."""
    from rollout.server.llm.smollm2 import smollm2_dir
    from rollout.server.llm.transformers_engine import TransformersEngine

    engine = TransformersEngine(smollm2_dir(), name="smol")
    client = EngineClient(engine)
    spec = JobSpec(job_id="real-1", environment="test", task={},
                   sampling=SamplingParams(temperature=0.0, max_tokens_per_turn=40, seed=3),
                   limits=Limits(max_turns=3))
    ctx = JobContext(spec=spec, llm=client)
    example = call("echo", text="hello")
    # A worked example in the history makes the 135M model reliably use the tool format.
    task = [{"role": "system", "content": "You call tools."},
            {"role": "user", "content": "Call the echo tool with the text 'hello'."},
            {"role": "assistant", "content": example}, {"role": "tool", "content": "echo: hello"},
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": "Call the echo tool with the text 'hi'."}]
    echo = EchoTool()
    try:
        out = await run_agent_loop(ctx, [echo], task)
    finally:
        await engine.close()
    assert echo.calls == [{"text": "hi"}] and len(out.turns) == 2
    ids = [i for t in out.turns for i in t.prompt_ids + t.output_ids + t.observation_ids]
    mask = [m for t in out.turns for m in t.loss_mask]
    assert [i for i, m in zip(ids, mask, strict=True) if m] == [
        i for t in out.turns for i in t.output_ids]
    for t in out.turns:
        assert len(t.output_logprobs) == len(t.output_ids) > 0
        assert all(lp <= 0.0 for lp in t.output_logprobs)
        assert t.backend == "smol" and t.finish_reason in ("stop", "length")
    # The ids decode back to the conversation as the template renders it.
    chat = ChatTokenizer(tok)
    msgs, _ = prepare_messages(chat, [echo], task)
    texts = [chat.decode(client_strip(tok, t.output_ids)) for t in out.turns]
    conversation = [*msgs, {"role": "assistant", "content": texts[0]},
                    {"role": "tool", "name": "echo", "content": "echo: hi"},
                    {"role": "assistant", "content": texts[1]}]
    rendered = chat.render(conversation, add_generation_prompt=False)
    expected = rendered[:-1]  # the last turn's "\n" after <|im_end|> comes with a next turn
    if out.turns[-1].output_ids[-1] != tok.eos_token_id:  # cut by max_tokens: no closing
        expected = rendered[:-len("<|im_end|>\n")]
    assert tok.decode(ids) == expected


def client_strip(tok: Any, ids: list[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids


class FakePython(EchoTool):
    """A tool named ``python`` that records the code it was given."""

    name = "python"
    parameters: Mapping[str, Any] = {"type": "object", "properties": {"code": {"type": "string"}}}

    async def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        self.calls.append(arguments)
        return ToolResult("76")


async def test_fenced_python_runs_only_where_the_job_has_a_python_tool(tok: Any) -> None:
    """A model that writes a ```python block instead of a tagged call: the loop runs it with the
    job's ``python`` tool; without one, the block is the model's final text."""
    script = ["```python\nprint(31 + 45)\n```", "The answer is \\boxed{76}."]
    ctx, _, _, _ = make_ctx(tok, script)
    py = FakePython()
    out = await run_agent_loop(ctx, [py, SubmitTool(ctx.state)], TASK)
    assert py.calls == [{"code": "print(31 + 45)"}]
    assert [t.tool_calls for t in out.turns] == [["python"], []]
    assert out.termination is TerminationReason.NO_TOOL_CALL
    assert out.metadata["final_text"] == script[1]

    ctx, _, _, _ = make_ctx(tok, script[:1], job_id="job-2")
    echo = EchoTool()
    out = await run_agent_loop(ctx, [echo, SubmitTool(ctx.state)], TASK)
    assert [t.tool_calls for t in out.turns] == [[]] and echo.calls == []
    assert out.termination is TerminationReason.NO_TOOL_CALL
