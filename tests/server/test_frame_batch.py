"""Frame batching on StreamRollouts (``OpenSession.batch_frames``).

The servicer's own stream generator pulled by the test (each pull is "the previous write
completed"), so the test decides what is queued when a write is due; and a real gRPC server read
through the bare generated stub, as any language's client sees it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2

from rollout.server.api.servicer import RolloutServicer
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from tests.client.conftest import ServerHarness
from tests.server.handlers import running_scheduler
from tests.server.raw_stream import PulledStream, alone, run_raw

pytestmark = pytest.mark.timeout(60)


def _job(job_id: str, environment: str = "scripted", **task: Any) -> job_pb2.JobSpec:
    s = struct_pb2.Struct()
    s.update(task or {"reward": 1.0})
    return job_pb2.JobSpec(job_id=job_id, environment=environment, task=s)


def kinds(frames: list[pb.StreamRolloutsResponse], kind: str) -> list[pb.StreamRolloutsResponse]:
    return [f for f in frames if f.WhichOneof("kind") == kind]


async def test_answers_ready_together_go_out_as_one_frame_and_a_lone_one_at_once(
        tmp_path: Path) -> None:
    """Five answers queued by one submit are one `batch` frame; a later lone answer is written
    by itself without waiting for anything more (the jobs stay gated, so nothing else comes)."""
    async with running_scheduler(tmp_path / "db") as (sched, handler):
        stream = PulledStream(RolloutServicer(sched, heartbeat_s=0), "c", batch_frames=True)
        try:
            assert (await stream.pull()).WhichOneof("kind") == "opened"
            ids = [f"j{i}" for i in range(5)]
            stream.requests.put_nowait(pb.StreamRolloutsRequest(submit=pb.SubmitJobs(
                jobs=[_job(j, gate=["init"]) for j in ids])))
            first = await stream.pull()
            assert first.WhichOneof("kind") == "batch" and first.sequence == 0
            assert [(f.job_id, f.WhichOneof("kind")) for f in first.batch.frames] == [
                (j, "accepted") for j in ids]
            assert [f.sequence for f in first.batch.frames] == [2, 3, 4, 5, 6]
            stream.requests.put_nowait(pb.StreamRolloutsRequest(submit=pb.SubmitJobs(
                jobs=[_job("late", gate=["init"])])))
            lone = await stream.pull()  # times out if the writer waited for company
            assert (lone.WhichOneof("kind"), lone.job_id, lone.sequence) == ("accepted",
                                                                             "late", 7)
            for j in [*ids, "late"]:
                handler.open(j, "init")
        finally:
            await stream.close()


async def test_a_backlog_is_split_into_batches_of_at_most_the_limit(tmp_path: Path) -> None:
    async with running_scheduler(tmp_path / "db") as (sched, handler):
        stream = PulledStream(RolloutServicer(sched, heartbeat_s=0, max_frame_batch=4), "c",
                              batch_frames=True)
        try:
            await stream.pull()
            stream.requests.put_nowait(pb.StreamRolloutsRequest(submit=pb.SubmitJobs(
                jobs=[_job(f"b{i}", gate=["init"]) for i in range(10)])))
            while len(kinds(alone(stream.frames), "accepted")) < 10:
                await stream.pull()
            sizes = [len(f.batch.frames) if f.WhichOneof("kind") == "batch" else 1
                     for f in stream.frames[1:]]
            assert sizes == [4, 4, 2]
            assert [f.job_id for f in alone(stream.frames[1:])] == [f"b{i}" for i in range(10)]
            for i in range(10):
                handler.open(f"b{i}", "init")
        finally:
            await stream.close()


# ----------------------------------------------------------------------------- over gRPC


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[ServerHarness]:
    h = ServerHarness(tmp_path / "state")
    await h.start()
    yield h
    await h.stop()


def _assert_each_job_once(frames: list[pb.StreamRolloutsResponse], ids: list[str]) -> None:
    for kind in ("accepted", "trajectory", "finished"):
        assert sorted(f.job_id for f in kinds(frames, kind)) == sorted(ids), kind
    seen: dict[str, list[str]] = {}
    for f in frames:
        seen.setdefault(f.job_id, []).append(f.WhichOneof("kind"))
    assert all(seen[j] == ["accepted", "trajectory", "finished"] for j in ids)


async def test_n_jobs_take_far_fewer_writes_than_frames(harness: ServerHarness) -> None:
    """200 jobs: 601 frames (opened, then accepted, trajectory and finished per job). The
    answers to one submit are queued together and each trajectory with its finished frame, so
    a batching session is written in at most one write per job plus a few."""
    ids = [f"n{i}" for i in range(200)]
    wire = await run_raw(harness.address, "batched", [_job(j) for j in ids],
                          pb.OpenSession(batch_frames=True), 200)
    frames = alone(wire)
    assert len(frames) == 1 + 3 * 200
    assert len(wire) <= 200 + 5
    assert max(len(f.batch.frames) for f in kinds(wire, "batch")) >= 100  # the answers
    _assert_each_job_once(frames, ids)
    assert [f.sequence for f in frames] == list(range(1, len(frames) + 1))
    assert all(f.sequence == 0 and not f.job_id for f in kinds(wire, "batch"))


async def test_old_client_gets_one_write_per_frame(harness: ServerHarness) -> None:
    """An OpenSession from before batching never sees a `batch` frame."""
    ids = [f"o{i}" for i in range(60)]
    wire = await run_raw(harness.address, "old", [_job(j) for j in ids], pb.OpenSession(), 60)
    assert not kinds(wire, "batch") and len(wire) == 1 + 3 * 60
    _assert_each_job_once(wire, ids)
    assert [f.sequence for f in wire] == list(range(1, len(wire) + 1))


async def test_a_bad_job_in_a_batch_is_rejected_alone(harness: ServerHarness) -> None:
    """One submit frame with a job of an unknown environment, one with a bad task, one whose
    task holds a NaN (which JSON cannot carry), one with an empty id among good ones: each bad
    one gets its own `rejected` answer naming it; the others are accepted and run."""
    good = [f"g{i}" for i in range(6)]
    jobs = [_job(good[0]), _job("bad-env", environment="no-such-env"), _job(good[1]),
            _job("bad-task", bad=True), _job("nan-task", reward=float("nan")),
            *(_job(j) for j in good[2:]), _job("", reward=1.0)]
    wire = await run_raw(harness.address, "mixed", jobs, pb.OpenSession(batch_frames=True), 6)
    frames = alone(wire)
    rejected = {f.job_id: f.rejected for f in kinds(frames, "rejected")}
    assert set(rejected) == {"bad-env", "bad-task", "nan-task", ""}
    assert rejected["bad-env"].reason == "UNKNOWN_ENVIRONMENT"
    assert rejected["bad-env"].code == grpc.StatusCode.NOT_FOUND.value[0]
    assert rejected["bad-task"].reason == "INVALID_TASK"
    assert (rejected["nan-task"].reason, rejected["nan-task"].field) == ("INVALID_TASK", "task")
    assert rejected[""].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert all(r.message for r in rejected.values())
    _assert_each_job_once([f for f in frames if f.job_id in good], good)
    assert kinds(wire, "batch")


async def test_a_live_delivery_carries_the_bytes_the_store_wrote(tmp_path: Path) -> None:
    """The trajectory is encoded once, by the store's writer; the delivery hands those bytes
    to the session (which sends them without converting again), and they are the trajectory."""
    from rollout.runtime.types import JobSpec
    from rollout.server.api.proto_convert import trajectory_to_proto
    from rollout.server.api.stream_events import trajectory_message
    from rollout.server.pipeline.subscription import TrajectoryReady

    async with running_scheduler(tmp_path / "db") as (sched, _):
        sub = await sched.attach("c", progress=False)
        await sched.submit([JobSpec(job_id="e", environment="scripted",
                                    task={"reward": 0.5, "turns": 2})], "c")
        ready = None
        async for ev in sub:
            if isinstance(ev, TrajectoryReady):
                ready = ev
                break
        assert ready is not None and ready.encoded
        assert trajectory_message(ready) == trajectory_to_proto(ready.trajectory)
        sent = trajectory_message(ready)
        assert sent.reward == 0.5 and len(sent.turns) == 2
        stored = await sched.store.get_trajectory("e")
        assert stored is not None and trajectory_to_proto(stored) == sent


async def test_batches_stay_under_the_byte_bound_without_measuring_frames(
        tmp_path: Path) -> None:
    """Deliveries ready together are split so that each batch stays under its byte bound
    (here 2,000 bytes, from a small message limit), sized from the bytes the store encoded (a
    trajectory is never measured again on the event loop)."""
    n = 40
    async with running_scheduler(tmp_path / "db") as (sched, handler):
        servicer = RolloutServicer(sched, heartbeat_s=0, max_page_bytes=2000)
        stream = PulledStream(servicer, "c", batch_frames=True)
        try:
            await stream.pull()
            ids = [f"t{i}" for i in range(n)]
            stream.requests.put_nowait(pb.StreamRolloutsRequest(submit=pb.SubmitJobs(
                jobs=[_job(j, gate=["eval"], turns=3) for j in ids])))
            while len(kinds(alone(stream.frames), "accepted")) < n:
                await stream.pull()
            mark = len(stream.frames)
            for j in ids:
                handler.open(j, "eval")
            while len(kinds(alone(stream.frames), "finished")) < n:
                await stream.pull()
            written = stream.frames[mark:]
            assert len(kinds(alone(written), "trajectory")) == n
            batches = kinds(written, "batch")
            assert batches, "deliveries ready together were not batched at all"
            assert max(f.ByteSize() for f in batches) <= 2000
        finally:
            await stream.close()
