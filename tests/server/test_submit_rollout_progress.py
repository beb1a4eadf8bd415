"""SubmitRollout with ``batch_progress``: the job's progress events that wait for a write go
out in ``progress_batch`` frames, complete, in order, before the trajectory; a request without
it (every client written before the field) gets one ``progress`` frame per event.

The expected events are the scripted environment's, worked out by hand from its code
(``expected_events`` in test_progress_batch.py), not read back from the servicer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rollout.server.api.servicer import RolloutServicer
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from rollout.v1 import rollout_service_pb2_grpc as pb_grpc
from tests.client.conftest import ServerHarness
from tests.server.handlers import running_scheduler
from tests.server.test_progress_batch import _job, _key, expected_events
from tests.util import assert_eventually, scaled

pytestmark = pytest.mark.timeout(60)


def progress_of(frames: list[pb.SubmitRolloutResponse]) -> list[Any]:
    """Every progress event's key in wire order, batches unpacked (all of one job)."""
    out: list[Any] = []
    for f in frames:
        if f.WhichOneof("kind") == "progress":
            out.append(_key(f.progress))
        elif f.WhichOneof("kind") == "progress_batch":
            assert f.progress_batch.events, "an empty batch was written"
            out += [_key(e.progress) for e in f.progress_batch.events]
    return out


def kinds(frames: list[pb.SubmitRolloutResponse]) -> list[str]:
    return [str(f.WhichOneof("kind")) for f in frames]


async def test_waiting_progress_goes_out_in_bounded_batches_before_the_trajectory(
        tmp_path: Path) -> None:
    """INIT and the first half of RUN (3 stage events + 20 turns) happen while the caller is
    not reading; its next reads get them as batches of at most 8 (8, 8, 7), then the rest."""
    turns = 20
    async with running_scheduler(tmp_path / "db") as (sched, handler):
        servicer = RolloutServicer(sched, heartbeat_s=0, max_progress_batch=8)
        call = servicer.SubmitRollout(pb.SubmitRolloutRequest(
            job=_job("s", gate=["run"], turns=turns), batch_progress=True),
            None)  # type: ignore[arg-type]
        frames: list[pb.SubmitRolloutResponse] = []

        async def pull() -> pb.SubmitRolloutResponse:
            frames.append(await asyncio.wait_for(anext(call), scaled(10)))
            return frames[-1]

        try:
            assert (await pull()).WhichOneof("kind") == "accepted"
            await assert_eventually(lambda: handler.started("s", "run"))  # turns emitted
            await asyncio.sleep(0.05)
            for size in (8, 8, 7):
                frame = await pull()
                assert frame.WhichOneof("kind") == "progress_batch"
                assert len(frame.progress_batch.events) == size
                assert {e.job_id for e in frame.progress_batch.events} == {"s"}
            assert progress_of(frames) == expected_events(turns)[:3 + turns]
            handler.open("s", "run")
            while frames[-1].WhichOneof("kind") != "finished":
                await pull()
        finally:
            await call.aclose()
    assert progress_of(frames) == expected_events(turns)
    assert kinds(frames)[-2:] == ["trajectory", "finished"]
    assert "progress" not in kinds(frames)
    assert frames[-1].finished.state == job_pb2.Job.STATE_SUCCEEDED
    assert len(frames[-2].trajectory.turns) == turns


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[ServerHarness]:
    h = ServerHarness(tmp_path / "state")
    await h.start()
    yield h
    await h.stop()


async def _submit(harness: ServerHarness, request: pb.SubmitRolloutRequest
                  ) -> list[pb.SubmitRolloutResponse]:
    async with grpc.aio.insecure_channel(harness.address) as channel:
        call = pb_grpc.RolloutServiceStub(channel).SubmitRollout(request, timeout=30)
        return [f async for f in call]


async def test_over_grpc_batched_and_old_style_requests(harness: ServerHarness) -> None:
    """Over real gRPC: with batch_progress the 45 events of a 40-turn job arrive complete and
    in order in fewer frames, before the trajectory; without it, one frame per event."""
    turns = 40
    batched = await _submit(harness, pb.SubmitRolloutRequest(
        job=_job("g-batched", turns=turns), batch_progress=True))
    assert progress_of(batched) == expected_events(turns)
    assert "progress" not in kinds(batched)
    assert kinds(batched).count("progress_batch") < len(expected_events(turns))
    assert kinds(batched)[0] == "accepted" and kinds(batched)[-2:] == ["trajectory",
                                                                       "finished"]

    old = await _submit(harness, pb.SubmitRolloutRequest(job=_job("g-old", turns=turns)))
    assert kinds(old) == (["accepted"] + ["progress"] * len(expected_events(turns))
                          + ["trajectory", "finished"])
    assert progress_of(old) == expected_events(turns)
