"""Fixtures for the environment tests: a real bwrap sandbox runtime, the real SmolLM2
tokenizer, and a driver that runs one task through init -> run -> eval with a scripted policy."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.handler import AgentHandler, JobContext, RunOutcome
from rollout.runtime.sandbox.base import SandboxConfig, create_sandbox
from rollout.runtime.types import JobSpec, Limits, Reward, SamplingParams
from rollout.server.llm.scripted import ScriptedEngine
from tests.runtime.doubles import EngineClient, smollm2_tokenizer

Rollout = Callable[..., Awaitable["RolloutResult"]]


def call(name: str, **arguments: Any) -> str:
    """One assistant message that calls a tool, in the format the agent loop parses."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@dataclass
class RolloutResult:
    reward: Reward
    outcome: RunOutcome
    ctx: JobContext
    engine: ScriptedEngine

    def prompt_text(self, turn: int = -1) -> str:
        """What the policy was shown before ``turn`` (default: the whole conversation)."""
        ids = self.engine.requests[turn].prompt_ids
        return str(self.engine.tokenizer.decode(list(ids)))


@pytest.fixture(scope="session")
def tok() -> Any:
    return smollm2_tokenizer()


@pytest.fixture(scope="session")
def sandbox_factory(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    state = tmp_path_factory.mktemp("env-state")
    return functools.partial(create_sandbox, SandboxConfig(state_dir=Path(state)))


@pytest.fixture
def rollout(tok: Any, sandbox_factory: Any) -> Rollout:
    """``await rollout(handler, task, script)``: the job's three stages, then its cleanup."""
    counter = iter(range(1_000_000))

    async def run(handler: AgentHandler, task: Mapping[str, Any],
                  script: Sequence[str] | Callable[[str, int], str], *,
                  limits: Limits | None = None, inspect: Callable[[JobContext], Any] | None = None,
                  gateway: Any = None, sampling: SamplingParams | None = None,
                  ) -> RolloutResult:
        job_id = f"{handler.name}-{next(counter)}"
        if callable(script):  # (session, turn) -> message; see in_order
            engine = ScriptedEngine(tok, script)
            script = [""] * (limits.max_turns if limits else 1)
        else:
            engine = ScriptedEngine(tok, {job_id: list(script)})
        spec = JobSpec(job_id=job_id, environment=handler.name, task=dict(task),
                       sampling=sampling or SamplingParams(
                           temperature=0.0, max_tokens_per_turn=4096, total_token_budget=32768),
                       limits=limits or Limits(max_turns=len(script) or 1))
        ctx = JobContext(spec=spec, llm=EngineClient(engine), sandbox_factory=sandbox_factory,
                         gateway=gateway)
        async with ctx.resources:
            try:
                handler.validate_task(spec.task)
                await handler.init(ctx)
                if inspect is not None:
                    await inspect(ctx)
                ctx.outcome = await handler.run(ctx)
                reward = await handler.eval(ctx)
            finally:
                await handler.cleanup(ctx)
        return RolloutResult(reward, ctx.outcome, ctx, engine)

    return run


def in_order(messages: Sequence[str]) -> Callable[[str, int], str]:
    """A script that answers with ``messages`` one after another across the job's
    conversations (a multi-step task ends its session after each step, which restarts a
    per-session script)."""
    it = iter(messages)
    return lambda session, turn: next(it)


# The harness environment's fixtures: the real model gateway, and the tiny model's engine.
from tests.runtime.envs.harness_helpers import gateway_rig, tiny_engine  # noqa: E402, F401
