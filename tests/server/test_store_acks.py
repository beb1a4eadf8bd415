"""Acknowledgements are per client: one trainer's acks never touch another's deliveries.

Delivery ids are numbered per client, so two trainers both hold a delivery 1, 2, 3; every
statement that acknowledges or summarises must name the client."""

from __future__ import annotations

import pytest

from rollout.runtime.types import (
    JobSpec,
    JobState,
    Stage,
    StageTimings,
    TerminationReason,
    Trajectory,
    Turn,
)
from rollout.server.store import FinishRecord, JobStore

pytestmark = pytest.mark.timeout(30)


async def _deliver(store: JobStore, client: str, n: int) -> list[int]:
    specs = [JobSpec(job_id=f"{client}-{i}", environment="scripted", task={"i": i})
             for i in range(n)]
    await store.insert_jobs([(s, client) for s in specs], 1.0)
    ids = []
    for s in specs:
        traj = Trajectory(job_id=s.job_id, turns=[Turn([1], [2], [-0.5], [])], reward=1.0,
                          termination=TerminationReason.SUBMITTED)
        ids.append(await store.finish(FinishRecord(
            s.job_id, client, JobState.SUCCEEDED, Stage.EVAL, None, 1.0, StageTimings(), traj,
            2.0)))
    return ids


async def test_acked_through_and_ack_through_stay_within_one_client(tmp_path) -> None:
    store = JobStore(tmp_path / "s.db")
    await store.open()
    try:
        assert await _deliver(store, "alice", 3) == [1, 2, 3]
        assert await _deliver(store, "bob", 5) == [1, 2, 3, 4, 5]
        await store.ack("bob", [2])
        # alice acknowledged nothing; bob's ack of 2 is no ack of alice's 2.
        assert await store.acked_through("alice") == 0
        assert await store.acked_through("bob") == 0  # 1 is still open
        await store.ack("alice", through=3)
        assert await store.acked_through("alice") == 3
        # bob's 1, 3, 4, 5 are untouched by alice's ack through 3.
        assert [d.delivery_id for d in await store.unacked("bob")] == [1, 3, 4, 5]
        assert await store.acked_through("bob") == 0
        await store.ack("bob", [1])
        assert await store.acked_through("bob") == 2
        # With everything of alice's acknowledged, her mark is her own highest delivery (3),
        # not bob's (5).
        assert await store.acked_through("alice") == 3
        assert await store.acked_through("carol") == 0
    finally:
        await store.close()
