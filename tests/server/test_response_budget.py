"""``sampling.max_response_tokens`` through a real server: the ``math`` environment's agent loop on
a tiny random model served by the in-process transformers engine. The budget bounds what the
model generates (not the prompt), ends the rollout as TOKEN_BUDGET, and a bad value is refused
with INVALID_ARGUMENT naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from rollout.client.aio import RolloutClient
from rollout.client.errors import RolloutError
from rollout.runtime.envs.math.handler import MathHandler
from rollout.runtime.handler import HandlerRegistry
from rollout.server.app import Server
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.transformers_engine import TransformersEngine
from rollout.v1 import trajectory_pb2
from tests.client.conftest import make_config
from tests.fixtures.tiny_model import tiny_model_dir

pytestmark = pytest.mark.timeout(300)


async def _no_sandbox(**options: Any) -> Any:
    raise RuntimeError("math tasks without tools open no sandbox")


def spec(job_id: str, **sampling: Any) -> dict[str, Any]:
    return {"job_id": job_id, "environment": "math",
            "task": {"question": "What is 2 + 2?", "answer": "4", "tools": []},
            "sampling": {"temperature": 1.0, "seed": 7, "max_tokens_per_turn": 20, **sampling},
            "limits": {"max_turns": 3}}


async def run(client: RolloutClient, job: dict[str, Any]) -> trajectory_pb2.Trajectory:
    async for frame in client.submit_rollout(job, progress=False):
        if frame.WhichOneof("kind") == "trajectory":
            return frame.trajectory
    raise AssertionError("no trajectory frame")


async def test_response_budget_ends_the_rollout_through_a_real_server(tmp_path: Path) -> None:
    # ignore_eos: every turn would run to max_tokens_per_turn (20) but for the budget.
    engine = TransformersEngine(tiny_model_dir(context=8192), num_threads=1, ignore_eos=True)
    pool = BackendPool([engine])
    await pool.start()
    registry = HandlerRegistry()
    registry.register("math", MathHandler)
    server = await Server(make_config(tmp_path / "state"), registry=registry, llm=pool,
                          sandbox_factory=_no_sandbox).start()
    try:
        async with RolloutClient(f"127.0.0.1:{server.port}") as client:
            bounded = await run(client, spec("bounded", max_response_tokens=7))
            free = await run(client, spec("free"))
            with pytest.raises(RolloutError) as err:
                await run(client, spec("zero", max_response_tokens=0))
    finally:
        await server.stop(0.2)
        await pool.close()

    assert bounded.termination_reason == trajectory_pb2.TERMINATION_REASON_TOKEN_BUDGET
    assert sum(len(t.output_ids) for t in bounded.turns) == 7
    assert bounded.turns[0].prompt_ids  # the prompt is long; it does not count
    # The same job without the bound generates the whole turn.
    assert free.termination_reason != trajectory_pb2.TERMINATION_REASON_TOKEN_BUDGET
    assert len(free.turns[0].output_ids) == 20
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.max_response_tokens" in str(err.value)
