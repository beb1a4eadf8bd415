"""StreamRollouts sessions without the client library, for tests of what the server writes:
over gRPC with the bare generated stub, or on the servicer with the test as the transport."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from rollout.server.api.servicer import RolloutServicer
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from rollout.v1 import rollout_service_pb2_grpc as pb_grpc
from tests.util import scaled


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


class PulledStream:
    """One StreamRollouts call on the servicer, with the test as its transport."""

    def __init__(self, servicer: RolloutServicer, client_id: str, **open_: Any) -> None:
        self.requests: asyncio.Queue[pb.StreamRolloutsRequest | None] = asyncio.Queue()
        msg = pb.OpenSession(client_id=client_id, **open_)
        msg.heartbeat_interval.FromSeconds(0)  # no heartbeats: only job frames are queued
        self.requests.put_nowait(pb.StreamRolloutsRequest(open=msg))
        self.gen = servicer.StreamRollouts(self._requests(), None)  # type: ignore[arg-type]
        self.frames: list[pb.StreamRolloutsResponse] = []

    async def _requests(self) -> AsyncIterator[pb.StreamRolloutsRequest]:
        while (req := await self.requests.get()) is not None:
            yield req

    async def pull(self) -> pb.StreamRolloutsResponse:
        frame = await asyncio.wait_for(anext(self.gen), scaled(10))
        self.frames.append(frame)
        return frame

    async def pull_until(self, done: Any) -> None:
        while not done(self.frames):
            await self.pull()

    async def close(self) -> None:
        self.requests.put_nowait(None)
        await self.gen.aclose()
