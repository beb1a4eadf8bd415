"""A test environment whose task spells out its episode token by token, and a live server.

The verl and NeMo RL adapter tests both run the production server (``ServerHarness``: servicer,
scheduler, SQLite store, real gRPC on loopback) with this environment registered as
``episode``. Each task lists its turns explicitly, so a test derives the tensors a trainer must
receive from the task alone, independently of the adapter under test::

    {"turns": [{"prompt": [ids], "output": [ids], "logprobs": [floats], "obs": [ids],
                "version": int, "tool": name}, ...],
     "reward": float, "components": {name: float},
     "rewards": [float, ...],             # optional: per sample, by the job id's /<index>
     "fail": "init" | "run" | "eval",     # optional: the stage raises HandlerError
     "sleep": seconds,                     # optional: RUN waits this long (cancellation tests)
     "prompt_fills_budget": n}             # optional: no turn, TOKEN_BUDGET, an n-token prompt
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollout.runtime.handler import AgentHandler, HandlerError, JobContext, RunOutcome
from rollout.runtime.types import Reward, TerminationReason, Turn
from tests.client.conftest import ServerHarness

ENV = "episode"


class EpisodeHandler(AgentHandler):
    name = ENV

    def validate_task(self, task: Mapping[str, Any]) -> None:
        if not isinstance(task.get("turns"), list):
            from rollout.runtime.types import InvalidArgument

            raise InvalidArgument("task.turns must be a list", "INVALID_TASK", "task.turns")

    async def init(self, ctx: JobContext) -> None:
        if ctx.spec.task.get("fail") == "init":
            raise HandlerError("scripted failure in init", "SCRIPTED_FAILURE")

    async def run(self, ctx: JobContext) -> RunOutcome:
        task = ctx.spec.task
        if task.get("sleep"):
            await asyncio.sleep(float(task["sleep"]))
        if task.get("prompt_fills_budget"):  # what the built-in loop does with such a prompt
            return RunOutcome(turns=[], termination=TerminationReason.TOKEN_BUDGET,
                              metadata={"prompt_tokens": str(task["prompt_fills_budget"])})
        turns = [Turn(prompt_ids=[int(i) for i in t.get("prompt", [])],
                      output_ids=[int(i) for i in t["output"]],
                      output_logprobs=[float(x) for x in t["logprobs"]],
                      observation_ids=[int(i) for i in t.get("obs", [])],
                      policy_version=int(t.get("version", 0)), finish_reason="stop",
                      backend="episode", tool_calls=[t["tool"]] if t.get("tool") else [])
                 for t in task["turns"]]
        if task.get("fail") == "run":
            raise HandlerError("scripted failure in run", "SCRIPTED_FAILURE")
        return RunOutcome(turns=turns, termination=TerminationReason.SUBMITTED)

    async def eval(self, ctx: JobContext) -> Reward:
        if ctx.spec.task.get("fail") == "eval":
            raise HandlerError("scripted failure in eval", "SCRIPTED_FAILURE")
        components = {k: float(v) for k, v in dict(ctx.spec.task.get("components", {})).items()}
        rewards = ctx.spec.task.get("rewards")
        if rewards:  # per sample of a group: job ids end in /<index>
            tail = ctx.spec.job_id.rsplit("/", 1)[-1]
            return Reward(float(rewards[int(tail) if tail.isdigit() else 0]), components)
        return Reward(float(ctx.spec.task.get("reward", 0.0)), components)


def episode_harness(state_dir: Path) -> ServerHarness:
    h = ServerHarness(state_dir)
    h.registry.register(ENV, EpisodeHandler())
    return h


def two_turn_tool_episode(base: int = 100, version: int = 3, reward: float = 1.0,
                          **extra: Any) -> dict[str, Any]:
    """A prompt, a tool call, its observation, then an answer: the shape adapters must keep."""
    return {
        "turns": [
            {"prompt": [base + i for i in range(6)], "output": [base + 10, base + 11, base + 12],
             "logprobs": [-0.25, -1.5, -0.125], "obs": [base + 20, base + 21],
             "version": version, "tool": "python"},
            {"prompt": [base + 30, base + 31], "output": [base + 40, base + 41],
             "logprobs": [-2.0, -0.5], "obs": [], "version": version + 1},
        ],
        "reward": reward, "components": {"exact": reward, "format": 0.5},
        **extra,
    }


def expected_flat(task: Mapping[str, Any]) -> dict[str, list[Any]]:
    """The trajectory a trainer must see, worked out from the task: token ids, loss mask (1 on
    model outputs only), logprobs (0 off the outputs) and the length of turn 0's prompt."""
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for t in task["turns"]:
        p, o, obs = list(t.get("prompt", [])), list(t["output"]), list(t.get("obs", []))
        ids += p + o + obs
        mask += [0] * len(p) + [1] * len(o) + [0] * len(obs)
        logprobs += [0.0] * len(p) + list(t["logprobs"]) + [0.0] * len(obs)
    return {"ids": ids, "mask": mask, "logprobs": logprobs,
            "prompt_len": [len(task["turns"][0].get("prompt", []))]}
