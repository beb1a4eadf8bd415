"""Held-out accuracy through the service: every task once, greedily, on the served policy."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollout.client.aio import RolloutClient
from rollout.client.specs import job_spec
from rollout.v1 import job_pb2


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    scores: tuple[float, ...]
    """Per task, in the order given: 1.0 solved, 0.0 not (failed jobs count as 0)."""
    failed: int
    by_family: dict[str, float]
    generated_tokens: int
    seconds: float
    turns: float = 0.0
    """Mean LLM turns per task."""
    tool_calls: float = 0.0
    """Mean tool calls per task."""


async def evaluate(client: RolloutClient, tasks: Sequence[Mapping[str, Any]], *,
                   template: Mapping[str, Any], client_id: str, run_tag: str,
                   timeout_s: float = 3600.0) -> EvalResult:
    """Submit one job per task (job ids ``{run_tag}/{i}``, idempotent), wait for all, and
    score them by their EVAL reward (>= 0.5 counts as solved)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    specs = [job_spec(template, **{k: v for k, v in t.items() if k != "job_id"},
                      job_id=f"{run_tag}/{i}") for i, t in enumerate(tasks)]
    index = {s.job_id: i for i, s in enumerate(specs)}
    rewards: dict[int, float] = {}
    failed = tokens = turns = calls = 0
    async with client.session(client_id, auto_ack=True) as session:
        await session.submit(specs)
        async with asyncio.timeout(timeout_s):
            async for frame in session.events():
                kind = frame.WhichOneof("kind")
                if kind == "trajectory" and frame.job_id in index:
                    traj = frame.trajectory.trajectory
                    tokens += sum(len(t.output_ids) for t in traj.turns)
                    turns += len(traj.turns)
                    calls += sum(len(t.tool_calls) for t in traj.turns)
                elif kind == "finished" and frame.job_id in index:
                    ok = frame.finished.state == job_pb2.Job.STATE_SUCCEEDED
                    failed += not ok
                    rewards[index[frame.job_id]] = frame.finished.reward if ok else 0.0
                    if len(rewards) == len(specs):
                        break
                elif kind == "rejected" and frame.job_id in index:
                    raise ValueError(f"held-out job {frame.job_id} rejected: "
                                     f"{frame.rejected.reason}: {frame.rejected.message}")
        await session.aclose()
    scores = tuple(1.0 if rewards[i] >= 0.5 else 0.0 for i in range(len(specs)))
    families: dict[str, list[float]] = {}
    for task, score in zip(tasks, scores, strict=True):
        family = str(task.get("metadata", {}).get("family", "all"))
        families.setdefault(family, []).append(score)
    return EvalResult(accuracy=sum(scores) / len(scores), scores=scores, failed=failed,
                      by_family={k: sum(v) / len(v) for k, v in sorted(families.items())},
                      generated_tokens=tokens, seconds=loop.time() - started,
                      turns=turns / len(specs), tool_calls=calls / len(specs))
