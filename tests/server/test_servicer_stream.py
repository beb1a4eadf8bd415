"""StreamRollouts as a bare generated stub sees it (no resuming client in between)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import struct_pb2

from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from rollout.v1 import rollout_service_pb2_grpc as pb_grpc
from tests.client.conftest import ServerHarness


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[ServerHarness]:
    h = ServerHarness(tmp_path / "state")
    await h.start()
    yield h
    await h.stop()


def _job(job_id: str, **task: object) -> job_pb2.JobSpec:
    s = struct_pb2.Struct()
    s.update(task or {"reward": 1.0})
    return job_pb2.JobSpec(job_id=job_id, environment="scripted", task=s)


@pytest.mark.timeout(60)
async def test_half_closed_stream_delivers_everything_then_ends(harness: ServerHarness) -> None:
    """A client that sends open + submit and half-closes at once (grpcurl does this) gets every
    trajectory and a clean end of stream, not a hang; what it never acked replays next time."""
    jobs = [_job(f"hc-{i}", sleep={"run": 0.05 * i}) for i in range(5)]
    requests = [pb.StreamRolloutsRequest(open=pb.OpenSession(client_id="half-closer")),
                pb.StreamRolloutsRequest(submit=pb.SubmitJobs(jobs=jobs))]
    async with grpc.aio.insecure_channel(harness.address) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        frames = [f async for f in stub.StreamRollouts(iter(requests), timeout=30)]
        kinds = [f.WhichOneof("kind") for f in frames]
        assert kinds[0] == "opened"
        assert [f.sequence for f in frames] == list(range(1, len(frames) + 1))
        delivered = {f.job_id for f in frames if f.WhichOneof("kind") == "trajectory"}
        finished = {f.job_id for f in frames if f.WhichOneof("kind") == "finished"}
        assert delivered == finished == {j.job_id for j in jobs}

        # Nothing was acked, so reopening replays all five deliveries.
        again = stub.StreamRollouts(iter(requests[:1]), timeout=30)
        replayed = [f async for f in again]
        assert replayed[0].opened.replaying == 5
        assert {f.job_id for f in replayed if f.WhichOneof("kind") == "trajectory"} == delivered


@pytest.mark.timeout(60)
async def test_cancel_in_stream_does_not_block_the_reader(harness: ServerHarness) -> None:
    """A cancel frame starts the cancellation and the reader goes on to the next frame."""
    gated = _job("gated", gate=["run"])
    other = _job("other")
    queue: asyncio.Queue[pb.StreamRolloutsRequest | None] = asyncio.Queue()

    async def requests():  # type: ignore[no-untyped-def]
        while (item := await queue.get()) is not None:
            yield item

    await queue.put(pb.StreamRolloutsRequest(open=pb.OpenSession(client_id="canceller")))
    await queue.put(pb.StreamRolloutsRequest(submit=pb.SubmitJobs(jobs=[gated])))
    async with grpc.aio.insecure_channel(harness.address) as channel:
        call = pb_grpc.RolloutServiceStub(channel).StreamRollouts(requests(), timeout=30)
        seen: dict[str, list[str]] = {}
        async for f in call:
            seen.setdefault(f.job_id, []).append(f.WhichOneof("kind"))
            if f.WhichOneof("kind") == "accepted" and f.job_id == "gated":
                while not harness.handler.started("gated", "run"):
                    await asyncio.sleep(0.01)
                await queue.put(pb.StreamRolloutsRequest(cancel=pb.CancelJobs(job_ids=["gated"])))
                await queue.put(pb.StreamRolloutsRequest(submit=pb.SubmitJobs(jobs=[other])))
            if f.WhichOneof("kind") == "finished":
                if f.job_id == "gated":
                    assert f.finished.state == job_pb2.Job.STATE_CANCELLED
                if {"gated", "other"} <= {j for j, k in seen.items() if "finished" in k}:
                    break
        call.cancel()
    assert "finished" in seen["other"]
