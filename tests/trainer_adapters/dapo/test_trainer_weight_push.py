"""The DAPO trainer end to end on a tiny random model: a real server on loopback with the
in-process engine, the trainer pushing weights while rollouts are between turns.

The environment holds the second turn of every sample outside the first group until the
trainer's first weight push is done, so those trajectories straddle the push. Each turn's
version label is then checked against the weights themselves: the turn's logprobs are
recomputed with an independent full forward pass under every version's checkpoint, and must
match the labelled version's (and not the other's).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout.client.aio import RolloutClient
from rollout.runtime.handler import AgentHandler, HandlerRegistry, JobContext, RunOutcome
from rollout.runtime.llm import GenerateRequest
from rollout.runtime.types import Reward, TerminationReason, Turn
from rollout.server.app import Server
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.transformers_engine import TransformersEngine
from rollout.trainer_adapters.dapo.run_config import load_config
from rollout.trainer_adapters.dapo.trainer import DapoTrainer
from tests.client.conftest import make_config
from tests.fixtures.tiny_model import tiny_model_dir

TURNS = 2
SEPARATOR = [5, 6]


class TwoTurnHandler(AgentHandler):
    """Turn 0 from the task's prompt ids, then (after the gate, for held samples) turn 1 on
    prompt + output + separator. Reward: the sample index's parity (every group is mixed)."""

    name = "twoturn"

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.held = 0

    async def init(self, ctx: JobContext) -> None:
        pass

    async def run(self, ctx: JobContext) -> RunOutcome:
        assert ctx.llm is not None
        spec = ctx.spec
        ids = list(spec.task["prompt_ids"])
        turns: list[Turn] = []
        for k in range(TURNS):
            if k == 1 and spec.group_id and not spec.group_id.endswith("g000000"):
                self.held += 1
                await self.gate.wait()
            new = ids if k == 0 else SEPARATOR
            result = await ctx.llm.generate(GenerateRequest(
                prompt_ids=list(ids), sampling=spec.sampling,
                max_tokens=spec.sampling.max_tokens_per_turn, session_id=spec.job_id,
                group_id=spec.group_id, min_policy_version=spec.min_policy_version))
            turns.append(Turn(prompt_ids=list(new), output_ids=list(result.output_ids),
                              output_logprobs=list(result.logprobs),
                              policy_version=result.policy_version,
                              finish_reason=result.finish_reason,
                              logprobs_kind=result.logprobs_kind))
            ids = ids + list(result.output_ids) + SEPARATOR
        await ctx.llm.end_session(spec.job_id)
        return RunOutcome(turns=turns, termination=TerminationReason.NO_TOOL_CALL)

    async def eval(self, ctx: JobContext) -> Reward:
        index = int(ctx.spec.job_id.rsplit("/", 1)[1])
        return Reward(float(index % 2))


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture
async def served(tiny_dir: Path, tmp_path: Path) -> AsyncIterator[tuple[Server, TwoTurnHandler]]:
    handler = TwoTurnHandler()
    registry = HandlerRegistry()
    registry.register("twoturn", handler)
    pool = BackendPool([TransformersEngine(tiny_dir, name="tiny", ignore_eos=True)],
                       health_interval_s=0)
    await pool.start()
    server = await Server(make_config(tmp_path / "state"), registry=registry, llm=pool,
                          sandbox_factory=None).start()
    yield server, handler
    await server.stop(0.5)
    await pool.close()


def write_jobs(path: Path, n: int, seed: int) -> Path:
    gen = torch.Generator().manual_seed(seed)
    rows = [{"environment": "twoturn",
             "task": {"prompt_ids": torch.randint(10, 400, (6,), generator=gen).tolist()}}
            for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def full_sequence_logprobs(model_dir: Path, turns: list[Any]) -> list[list[float]]:
    """Per turn, the logprob of each output token under ``model_dir``'s weights, from one
    forward pass over the whole trajectory (no KV cache, no engine code)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids: list[int] = []
    spans = []
    for turn in turns:
        ids += list(turn.prompt_ids)
        spans.append((len(ids), len(turn.output_ids)))
        ids += list(turn.output_ids)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [[float(logp[start + j - 1, ids[start + j]]) for j in range(n)] for start, n in spans]


@pytest.mark.timeout(300)
async def test_weights_pushed_mid_rollout_label_every_turn(served: Any, tiny_dir: Path,
                                                           tmp_path: Path) -> None:
    server, handler = served
    opened_after: list[int] = []

    async def on_step(step: int, version: int) -> None:
        if not handler.gate.is_set():
            opened_after.append(version)
            handler.gate.set()

    cfg = load_config(None, {
        "run.dir": str(tmp_path / "run"), "run.steps": 3, "run.eval_every": 3,
        "run.keep_weights": 0,
        "data.train": str(write_jobs(tmp_path / "train.jsonl", 40, 1)),
        "data.heldout": str(write_jobs(tmp_path / "heldout.jsonl", 3, 2)),
        "rollout.max_tokens": 6, "rollout.max_turns": TURNS,
        "batch.groups_per_batch": 1, "batch.group_size": 4, "batch.max_in_flight_groups": 3,
        "batch.max_staleness": 1, "algo.lr": 0.05, "algo.warmup_steps": 0,
        "algo.overlong_cache": 0, "algo.micro_batch_size": 2,
        "service.client_id": "dapo-test"})
    summary = await DapoTrainer(cfg, server.address, model_dir=tiny_dir, on_step=on_step).run()
    assert summary.steps == 3 and summary.policy_version == 3
    assert opened_after == [1] and handler.held > 0
    rows = list((tmp_path / "run" / "metrics.csv").read_text().splitlines())
    assert len(rows) == 1 + 4  # header, step 0 (evaluation), steps 1-3
    # Every training step reports its peak RSS and the rollout-vs-trainer mismatch (samples
    # up to one version stale here, so the KL is whatever the lag made it).
    import csv

    steps = list(csv.DictReader(rows))[1:]
    assert all(float(r["peak_rss_gib"]) > 0.05 for r in steps), steps
    assert all(math.isfinite(float(r["mismatch_kl_token"])) and math.isfinite(
        float(r["mismatch_kl_seq"])) for r in steps), steps
    assert all(0 <= float(r["mismatch_masked"]) <= 1 and float(r["mismatch_weight_mean"]) > 0
               for r in steps), steps

    checkpoints = {0: tiny_dir, **{v: tmp_path / "run" / "weights" / f"v{v}"
                                   for v in (1, 2, 3)}}
    trajectories = []
    async with RolloutClient(server.address) as client:
        async for job in client.list_jobs(client_id="dapo-test", state="SUCCEEDED"):
            got = await client.get_job(job.job_id, include_trajectory=True)
            trajectories.append(got.trajectory)
    assert trajectories
    straddling = [t for t in trajectories if len({turn.policy_version for turn in t.turns}) > 1]
    assert straddling, "no trajectory had turns on both sides of a weight push"
    cache: dict[tuple[str, int], list[list[float]]] = {}
    for traj in trajectories:
        versions = sorted({turn.policy_version for turn in traj.turns} | {0, 1})
        recomputed = {v: cache.setdefault((traj.job_id, v), await asyncio.to_thread(
            full_sequence_logprobs, checkpoints[v], list(traj.turns))) for v in versions}
        for k, turn in enumerate(traj.turns):
            label = turn.policy_version
            errors = {v: max(abs(a - b) for a, b in zip(turn.output_logprobs, recomputed[v][k],
                                                        strict=True))
                      for v in versions}
            assert errors[label] < 2e-3, (traj.job_id, k, label, errors)
            others = [e for v, e in errors.items() if v != label]
            assert min(others) > 10 * errors[label] + 1e-3, (traj.job_id, k, label, errors)
