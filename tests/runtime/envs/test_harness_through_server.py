"""A harness job through a real server, as a trainer submits it: mini-swe-agent on a shipped swe
task in a bwrap sandbox, its model calls through the server's own gateway. The trainer receives
the reward of the inner environment's grader and a trajectory whose generated tokens are the
policy's, exactly."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from rollout.client.aio import RolloutClient
from rollout.client.trajectory import flatten_segments
from rollout.runtime.envs.harness.handler import HarnessHandler
from rollout.runtime.handler import HandlerRegistry
from rollout.runtime.tasksets.shipped import load_tasks
from rollout.server.app import Server
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.scripted import ScriptedEngine
from tests.client.conftest import make_config
from tests.runtime.envs.harness_helpers import mswea_action, need_mini_swe_agent

pytestmark = pytest.mark.timeout(240)

TASK = next(t for t in load_tasks("swe") if "spec" not in t)


action = mswea_action


async def test_a_trainer_gets_the_harness_jobs_reward_and_exact_tokens(tmp_path: Path,
                                                                       tok: Any) -> None:
    need_mini_swe_agent()
    script = [action(f"git apply <<'PATCH_EOF'\n{TASK['patch']}PATCH_EOF"),
              action("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")]
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine(tok, {"mini-1": script}, end_of_turn_id=eot)
    registry = HandlerRegistry()
    registry.register("harness", HarnessHandler)
    pool = BackendPool([engine], health_interval_s=0)
    server = await Server(make_config(tmp_path / "state"), registry=registry, llm=pool).start()
    try:
        async with RolloutClient(f"127.0.0.1:{server.port}") as client, \
                client.session("trainer") as session:
            await session.submit([{
                "job_id": "mini-1", "environment": "harness",
                "task": {"environment": "swe", "task": TASK, "harness": "mini-swe-agent"},
                "limits": {"max_turns": 6, "run_timeout": "150s"}}])
            async with asyncio.timeout(200):
                async for ready in session.trajectories():
                    traj = ready.trajectory
                    await session.ack([ready.delivery_id])
                    break
    finally:
        await server.stop(0.1)
        await pool.close()
    assert traj.reward == 1.0, (dict(traj.reward_components), dict(traj.metadata))
    (flat,) = flatten_segments(traj)
    generated = [t for t, m in zip(flat.token_ids, flat.loss_mask, strict=True) if m]
    assert generated == [i for text in script
                         for i in [*tok.encode(text, add_special_tokens=False), eot]]
    # The merged sequence is what the policy was prompted with, plus its last reply.
    assert flat.token_ids == [*engine.requests[-1].prompt_ids,
                              *tok.encode(script[-1], add_special_tokens=False), eot]
