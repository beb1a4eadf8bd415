"""Hot-swap in the middle of a multi-turn run through the pool: no turn is interrupted, each
records the version that produced it, and versions only move forward within a trajectory."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollout.runtime.llm import GenerateRequest
from rollout.runtime.types import SamplingParams
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.transformers_engine import TransformersEngine
from tests.fixtures.tiny_model import random_state_dict
from tests.util import assert_eventually

GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.timeout(90)
async def test_rolling_update_during_trajectories(tiny_dir: Path) -> None:
    engines = [TransformersEngine(tiny_dir, name=f"e{i}", ignore_eos=True) for i in range(2)]
    pool = BackendPool(engines, health_interval_s=0)
    versions: dict[str, list[int]] = {}
    finishes: list[str] = []

    async def trajectory(sid: str) -> None:
        prompt = [1, 40 + len(versions), 41, 42]
        versions[sid] = []
        for turn in range(4):
            result = await pool.generate(GenerateRequest(prompt, GREEDY, 24, sid))
            versions[sid].append(result.policy_version)
            finishes.append(result.finish_reason)
            assert len(result.output_ids) == 24  # never cut short by the swap
            prompt = prompt + result.output_ids + [50 + turn, 51]
        await pool.end_session(sid)

    runs = [asyncio.create_task(trajectory(f"t{i}")) for i in range(4)]
    await assert_eventually(lambda: sum(e.decode_steps for e in engines) > 10)
    updated = await pool.update_weights(random_state_dict(tiny_dir, seed=5), 1)
    assert updated == ["e0", "e1"]
    late = await pool.generate(GenerateRequest([1, 2, 3], GREEDY, 4, "late",
                                               min_policy_version=1))
    await asyncio.gather(*runs)
    assert late.policy_version == 1
    assert set(finishes) == {"length"}
    for history in versions.values():
        assert history == sorted(history)  # a trajectory never goes back to older weights
    seen = {v for history in versions.values() for v in history}
    assert seen == {0, 1}  # the swap really happened in the middle of the run
    await pool.close()
