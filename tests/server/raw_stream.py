"""A StreamRollouts session driven with the bare generated stub (no client library), for
tests of what the server writes on the wire."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from rollout.v1 import rollout_service_pb2_grpc as pb_grpc


def alone(frames: list[pb.StreamRolloutsResponse]) -> list[pb.StreamRolloutsResponse]:
    """The frames as if each had been written alone (`batch` frames unpacked)."""
    return [g for f in frames for g in (f.batch.frames if f.WhichOneof("kind") == "batch"
                                        else [f])]


async def run_raw(address: str, client_id: str, jobs: list[job_pb2.JobSpec],
                  open_: pb.OpenSession, expect_finished: int | None = None,
                  ) -> list[pb.StreamRolloutsResponse]:
    """Open (no heartbeats), submit all jobs in one frame, read until ``expect_finished``
    (default: all) jobs finished, acknowledging each trajectory, half-close; returns the
    frames as written."""
    expect = len(jobs) if expect_finished is None else expect_finished
    queue: asyncio.Queue[pb.StreamRolloutsRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.StreamRolloutsRequest]:
        while (item := await queue.get()) is not None:
            yield item

    open_.client_id = client_id
    open_.heartbeat_interval.FromSeconds(0)  # only the jobs' frames
    queue.put_nowait(pb.StreamRolloutsRequest(open=open_))
    queue.put_nowait(pb.StreamRolloutsRequest(submit=pb.SubmitJobs(jobs=jobs)))
    wire: list[pb.StreamRolloutsResponse] = []
    finished = 0
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.RolloutServiceStub(channel).StreamRollouts(requests(), timeout=50)
        async for f in call:
            wire.append(f)
            for g in alone([f]):
                if g.WhichOneof("kind") == "trajectory":
                    queue.put_nowait(pb.StreamRolloutsRequest(ack=pb.AckTrajectories(
                        delivery_ids=[g.trajectory.delivery_id])))
                elif g.WhichOneof("kind") == "finished":
                    finished += 1
            if finished == expect:
                queue.put_nowait(None)
                finished = -1
        assert await call.code() == grpc.StatusCode.OK
    return wire
