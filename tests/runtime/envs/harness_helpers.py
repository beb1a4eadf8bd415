"""Helpers for the harness environment's tests: a driver that runs a harness job's three stages
with a model gateway, and a stand-in gateway for the tests that check only the sandbox's way to
it (the network ones), which answer a fixed reply and record nothing."""

from __future__ import annotations

import json
import secrets
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from rollout.runtime.envs.harness.handler import CAPTURE_KEY
from rollout.runtime.gateway import GatewayLease, GatewayOptions, HarnessCapture
from rollout.runtime.handler import AgentHandler, JobContext, RunOutcome
from rollout.runtime.llm import GenerateRequest, GenerateResult, LLMClient, LLMUnavailable
from rollout.runtime.types import JobSpec, Limits, Reward, SamplingParams
from rollout.server.llm.engine import EngineError

PING_REPLY = {"object": "list", "data": [{"id": "relay-ok", "object": "model"}]}


@dataclass
class PingGateway:
    """TEST DOUBLE of the gateway's transport only: one Unix socket per lease that answers
    ``GET /v1/models`` for the lease's key (401 otherwise). No model behind it."""

    leases: dict[str, tuple[web.AppRunner, str]] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)

    async def open(self, spec: JobSpec, llm: LLMClient, *,
                   options: GatewayOptions | None = None) -> GatewayLease:
        key = secrets.token_hex(16)

        async def models(request: web.Request) -> web.Response:
            self.seen.append(request.headers.get("Authorization", ""))
            if request.headers.get("Authorization") != f"Bearer {key}":
                return web.json_response({"error": "bad key"}, status=401)
            return web.json_response(PING_REPLY)

        app = web.Application()
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        path = str(Path(tempfile.mkdtemp(prefix="gw-", dir="/tmp")) / "s")
        await web.UnixSite(runner, path).start()
        self.leases[key] = (runner, path)
        return GatewayLease(api_key=key, socket_path=path)

    def capture(self, lease: GatewayLease) -> HarnessCapture:
        return HarnessCapture()

    async def close(self, lease: GatewayLease) -> HarnessCapture:
        runner, path = self.leases.pop(lease.api_key)
        await runner.cleanup()
        Path(path).unlink(missing_ok=True)
        Path(path).parent.rmdir()
        return HarnessCapture(requests=len(self.seen))


def harness_task(inner: str, task: dict[str, Any], harness: Any, **extra: Any) -> dict[str, Any]:
    return {"environment": inner, "task": task, "harness": harness, **extra}


@dataclass
class GatewayRig:
    gateway: Any


@pytest.fixture
async def gateway_rig(tmp_path: Path) -> AsyncIterator[GatewayRig]:
    """The server's real model gateway, its sockets under a fresh state directory."""
    from rollout.server.gateway import Gateway

    gateway = await Gateway(tmp_path / "gw-state").start()
    try:
        yield GatewayRig(gateway)
    finally:
        await gateway.stop()


@pytest.fixture
async def tiny_engine() -> AsyncIterator[Any]:
    """The tiny random-initialised model (tests/fixtures/tiny_model.py) in the real engine,
    with a context long enough for a harness's own system prompt and tool descriptions."""
    from rollout.server.llm.transformers_engine import TransformersEngine
    from tests.fixtures.tiny_model import tiny_model_dir

    # One intra-op thread: a harness's own processes share the CPU, and torch's threads spin
    # against them (TransformersEngine's num_threads).
    engine = TransformersEngine(tiny_model_dir(context=16384), name="tiny", num_threads=1)
    try:
        yield engine
    finally:
        await engine.close()


class RecordingClient:
    """``LLMClient`` over one engine that keeps every request and its result, so a test can
    hold the trajectory against what the model was really given and really produced."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: list[tuple[GenerateRequest, GenerateResult]] = []

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def context_length(self) -> int | None:
        return getattr(self.engine, "max_context", None)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        try:
            result = await self.engine.generate(request)
        except EngineError as e:
            raise LLMUnavailable(str(e)) from e
        self.calls.append((request, result))
        return result

    async def end_session(self, session_id: str) -> None:
        await self.engine.release_session(session_id)


@dataclass
class ModelResult:
    reward: Reward
    outcome: RunOutcome
    ctx: JobContext
    llm: RecordingClient

    @property
    def capture(self) -> HarnessCapture:
        return self.ctx.state[CAPTURE_KEY]


_jobs = iter(range(1_000_000))


async def model_rollout(handler: AgentHandler, task: dict[str, Any], engine: Any, *,
                        sandbox_factory: Any, gateway: Any, limits: Limits,
                        sampling: SamplingParams) -> ModelResult:
    """One harness job's three stages and cleanup, its model calls going to ``engine``."""
    llm = RecordingClient(engine)
    spec = JobSpec(job_id=f"harness-model-{next(_jobs)}", environment=handler.name, task=task,
                   sampling=sampling, limits=limits)
    ctx = JobContext(spec=spec, llm=llm, sandbox_factory=sandbox_factory, gateway=gateway)
    async with ctx.resources:
        try:
            handler.validate_task(spec.task)
            await handler.init(ctx)
            ctx.outcome = await handler.run(ctx)
            reward = await handler.eval(ctx)
        finally:
            await handler.cleanup(ctx)
    return ModelResult(reward, ctx.outcome, ctx, llm)


def assert_every_token_captured(result: ModelResult) -> None:
    """Each turn's output is exactly what the engine sampled (ids and logprobs), and each
    request's prompt is exactly its segment's tokens so far: nothing the model saw or produced
    is missing from the trajectory, nothing was re-tokenized."""
    turns = result.outcome.turns
    calls = result.llm.calls
    assert len(turns) == len(calls) == result.capture.requests
    starts = sorted({0, *(s.first_turn for s in result.outcome.segments)})
    sequence: list[int] = []
    for i, (turn, (request, generated)) in enumerate(zip(turns, calls, strict=True)):
        if i in starts:
            sequence = []
        assert turn.output_ids == list(generated.output_ids) and turn.output_ids
        assert turn.output_logprobs == list(generated.logprobs)
        sequence += turn.prompt_ids
        assert list(request.prompt_ids) == sequence, f"turn {i}: the prompt is not its segment"
        sequence += turn.output_ids + turn.observation_ids
        mask = turn.loss_mask
        assert sum(mask) == len(turn.output_ids)


class RoutedEngine:
    """TEST DOUBLE: a scripted policy that answers each request by what it shows, for harnesses
    that interleave their calls (a side call beside the main thread, a sub-agent): ``choose``
    gets the request's prompt text and returns the assistant message. Wraps the real
    :class:`ScriptedEngine`, so tokenization, the end-of-turn token and ``max_tokens`` are as
    a model's."""

    def __init__(self, tokenizer: Any, choose: Any) -> None:
        from rollout.server.llm.scripted import ScriptedEngine

        self.choose = choose
        self.prompts: list[str] = []
        self.calls: list[tuple[GenerateRequest, GenerateResult]] = []
        self._pending: list[str] = []
        self.engine = ScriptedEngine(tokenizer, self._next)

    def _next(self, session_id: str, turn: int) -> str:
        return self._pending.pop()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def requests(self) -> list[GenerateRequest]:
        return self.engine.requests

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        text = str(self.engine.tokenizer.decode(list(request.prompt_ids)))
        self.prompts.append(text)
        # ScriptedEngine.generate asks for the message before its first await.
        self._pending.append(self.choose(text))
        result = await self.engine.generate(request)
        self.calls.append((request, result))
        return result

    async def release_session(self, session_id: str) -> None:
        await self.engine.release_session(session_id)


@dataclass
class RoutedResult:
    reward: Reward
    outcome: RunOutcome
    ctx: JobContext
    engine: RoutedEngine

    @property
    def capture(self) -> HarnessCapture:
        return self.ctx.state[CAPTURE_KEY]

    @property
    def log(self) -> str:
        return str(self.outcome.metadata.get("harness_log", ""))


async def routed_rollout(handler: AgentHandler, task: dict[str, Any], choose: Any, *,
                         tokenizer: Any, sandbox_factory: Any, gateway: Any,
                         limits: Limits) -> RoutedResult:
    """One harness job's three stages and cleanup against a :class:`RoutedEngine`."""
    from tests.runtime.doubles import EngineClient

    engine = RoutedEngine(tokenizer, choose)
    spec = JobSpec(job_id=f"harness-routed-{next(_jobs)}", environment=handler.name, task=task,
                   sampling=SamplingParams(temperature=0.0, max_tokens_per_turn=4096,
                                           total_token_budget=200_000), limits=limits)
    ctx = JobContext(spec=spec, llm=EngineClient(engine),  # type: ignore[arg-type]
                     sandbox_factory=sandbox_factory, gateway=gateway)
    async with ctx.resources:
        try:
            handler.validate_task(spec.task)
            await handler.init(ctx)
            ctx.outcome = await handler.run(ctx)
            reward = await handler.eval(ctx)
        finally:
            await handler.cleanup(ctx)
    return RoutedResult(reward, ctx.outcome, ctx, engine)


def assert_each_token_owned_once(result: Any) -> None:
    """With several chains (a sub-agent, a side call): each turn is one generation, its prompt
    exactly its chain's tokens so far, and every sampled token is trained in exactly one
    turn (none of a side call's)."""
    calls = result.llm.calls if hasattr(result, "llm") else result.engine.calls
    turns, segments = result.outcome.turns, result.outcome.segments
    assert len(turns) == len(calls)
    bounds = [s.first_turn for s in segments] + [len(turns)]
    unmatched = list(calls)
    trained = 0
    for segment, start, end in zip(segments, bounds, bounds[1:], strict=False):
        sequence: list[int] = []
        for turn in turns[start:end]:
            sequence += turn.prompt_ids
            match = [c for c in unmatched if list(c[0].prompt_ids) == sequence
                     and list(c[1].output_ids) == turn.output_ids]
            assert match, f"turn {turns.index(turn)}: no generation had this prompt and output"
            unmatched.remove(match[0])
            mask = turn.loss_mask
            assert mask[:len(turn.prompt_ids)] == [0] * len(turn.prompt_ids)
            assert sum(mask) == (0 if segment.side_call else len(turn.output_ids))
            trained += sum(mask)
            sequence += turn.output_ids + turn.observation_ids
    assert not unmatched
    assert trained == sum(len(r.output_ids) for req, r in calls
                          if not _side_call_prompt(req, turns, segments))


def _side_call_prompt(request: Any, turns: list[Any], segments: list[Any]) -> bool:
    bounds = [s.first_turn for s in segments] + [len(turns)]
    for segment, start, end in zip(segments, bounds, bounds[1:], strict=False):
        if segment.side_call and any(
                list(request.prompt_ids)[-len(t.prompt_ids):] == t.prompt_ids
                for t in turns[start:end]):
            return True
    return False


def read_recording(path: Path) -> list[dict[str, Any]]:
    """A harness's recorded requests (one JSON object per line: ``{"path", "body", ...}``)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(name="gateway")
async def replay_gateway(tmp_path: Path) -> AsyncIterator[Any]:
    """A real gateway to replay recordings through (see :func:`replay_recorded`)."""
    from rollout.server.gateway import Gateway

    gw = await Gateway(tmp_path / "state").start()
    yield gw
    await gw.stop()


async def replay_recorded(gateway: Any, requests: list[dict[str, Any]], answers: list[str],
                          side_calls: tuple[Any, ...], headers: dict[str, str]) -> Any:
    """Send a harness's recorded request bodies (``{"path", "body"}``, as sent) through the
    real gateway for one job whose preset has ``side_calls``; the scripted policy answers
    ``answers`` in request order; the job's key goes in both dialects' headers. Returns the
    gateway's capture of the job."""
    import httpx2

    from rollout.server.llm.backend_pool import BackendPool
    from rollout.server.llm.scripted import ScriptedEngine
    from tests.runtime.doubles import smollm2_tokenizer

    tok = smollm2_tokenizer()
    engine = ScriptedEngine(tok, {"job": list(answers)},
                            end_of_turn_id=tok.convert_tokens_to_ids("<|im_end|>"))
    pool = BackendPool([engine], health_interval_s=0)
    try:
        lease = await gateway.open(
            JobSpec(job_id="job", environment="harness", task={},
                    sampling=SamplingParams(seed=7, total_token_budget=65536),
                    limits=Limits(max_turns=8)),
            pool, options=GatewayOptions(side_calls=side_calls))
        transport = httpx2.AsyncHTTPTransport(uds=lease.socket_path)
        async with httpx2.AsyncClient(transport=transport, timeout=60) as http:
            for request in requests:
                reply = await http.post(f"http://gateway{request['path']}",
                                        content=json.dumps(request["body"]),
                                        headers={**headers, "x-api-key": lease.api_key,
                                                 "authorization": f"Bearer {lease.api_key}",
                                                 "content-type": "application/json"})
                assert reply.status_code == 200, reply.text[:2000]
        return gateway.capture(lease)
    finally:
        await pool.close()


def chains_of(capture: Any, tokenizer: Any) -> list[tuple[bool, list[tuple[str, bool]]]]:
    """Each chain of a capture: (side call, [(its turns' output text, trained)])."""
    segments, turns = capture.segments, capture.turns
    ends = [s.first_turn for s in segments[1:]] + [len(turns)]
    return [(s.side_call, [(str(tokenizer.decode(t.output_ids, skip_special_tokens=True)),
                            t.trained) for t in turns[s.first_turn:end]])
            for s, end in zip(segments, ends, strict=True)]


def mswea_action(command: str) -> str:
    """One reply in mini-swe-agent's text-based format (what a model it prompts writes)."""
    return f"THOUGHT: next step.\n\n```mswea_bash_command\n{command}\n```"


MSWEA_SUBMIT = mswea_action("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")


def need_mini_swe_agent() -> None:
    """Skip the test unless the set-up installed mini-swe-agent (the message says what to
    run)."""
    from rollout.runtime.envs.harness import presets as harness_presets

    try:
        harness_presets.resolve("mini-swe-agent")
    except Exception as e:
        pytest.skip(f"mini-swe-agent is not installed: {e}")
