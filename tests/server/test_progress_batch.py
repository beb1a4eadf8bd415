"""Progress coalescing on StreamRollouts (``OpenSession.batch_progress``).

Two views. The servicer's own stream generator, pulled by the test instead of by gRPC: each pull
is "the previous write completed, the next is due", so the test decides exactly what is queued
when a write happens (real scheduler, store and scripted environment; only the transport is the
test). And a real gRPC server read through the bare generated stub, as an old client or any
language's client sees it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import struct_pb2

from rollout.runtime.handler import JobContext
from rollout.server.api.servicer import RolloutServicer
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from tests.client.conftest import ServerHarness
from tests.server.handlers import ScriptedHandler, running_scheduler
from tests.server.raw_stream import PulledStream, run_raw
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(60)
P = pb.StageProgress
INIT, RUN, EVAL = job_pb2.STAGE_INIT, job_pb2.STAGE_RUN, job_pb2.STAGE_EVAL


def expected_events(turns: int) -> list[tuple[int, int, int]]:
    """What the scripted environment reports for one job, worked out by hand from its code:
    the runner's started/finished around each stage, and ``turns`` turn events early in RUN."""
    return ([(INIT, P.EVENT_STARTED, 0), (INIT, P.EVENT_FINISHED, 0), (RUN, P.EVENT_STARTED, 0)]
            + [(RUN, P.EVENT_TURN, t + 1) for t in range(turns)]
            + [(RUN, P.EVENT_FINISHED, 0), (EVAL, P.EVENT_STARTED, 0),
               (EVAL, P.EVENT_FINISHED, 0)])


SCENARIO_EVENTS = {"x": expected_events(1),  # the scripted default of one turn
                   **{j: expected_events(2) for j in ("a0", "a1", "a2")}}


def _key(p: pb.StageProgress) -> tuple[int, int, int]:
    return (p.stage, p.event, p.turns)


def progress_of(frames: list[pb.StreamRolloutsResponse]) -> list[tuple[str, Any]]:
    """(job id, event key) of every progress event, in wire order, batches unpacked."""
    out: list[tuple[str, Any]] = []
    for f in frames:
        if f.WhichOneof("kind") == "progress":
            out.append((f.job_id, _key(f.progress)))
        elif f.WhichOneof("kind") == "progress_batch":
            out += [(e.job_id, _key(e.progress)) for e in f.progress_batch.events]
    return out


def per_job(frames: list[pb.StreamRolloutsResponse]) -> dict[str, list[Any]]:
    jobs: dict[str, list[Any]] = {}
    for job_id, key in progress_of(frames):
        jobs.setdefault(job_id, []).append(key)
    return jobs


class HeldRelease(ScriptedHandler):
    """The scripted environment, plus: a job whose task sets ``hold_release`` keeps its
    resources until the test opens gate (job, "release"). Its delivery then commits only after
    its EVAL-finished progress went out, which is how a trajectory comes to be queued behind
    other jobs' progress."""

    async def cleanup(self, ctx: JobContext) -> None:
        await super().cleanup(ctx)
        if ctx.spec.task.get("hold_release"):
            await self.gate(ctx.spec.job_id, "release").wait()


def _job(job_id: str, **task: Any) -> job_pb2.JobSpec:
    s = struct_pb2.Struct()
    s.update(task or {"reward": 1.0})
    return job_pb2.JobSpec(job_id=job_id, environment="scripted", task=s)


def _seen(frames: list[pb.StreamRolloutsResponse], job_id: str, key: Any) -> bool:
    return (job_id, key) in progress_of(frames)


async def _queued(sched: Any, handler: HeldRelease, client_id: str, held: list[str],
                  waiting: list[str]) -> None:
    """Builds this queue while no write is due: the second half (RUN finished, EVAL started)
    of the ``waiting`` jobs' progress, then the delivery of the ``held`` job, whose own
    progress is already written."""
    for j in waiting:
        handler.open(j, "run")
    await assert_eventually(lambda: all(handler.started(j, "eval") for j in waiting))
    handler.open(held[0], "release")
    await assert_eventually(lambda: sched.client_stats(client_id).get("unacked") == 1)
    await asyncio.sleep(0.05)  # the session's pump moves the published delivery to the queue


async def _scenario(tmp_path: Path, batch: bool) -> tuple[list[Any], list[Any], HeldRelease]:
    """Job x finishes while progress of a0..a2 waits to be written; returns the frames of that
    write and of the rest of the run."""
    handler = HeldRelease()
    async with running_scheduler(tmp_path / "db", handler, init_workers=4, run_workers=4,
                                 eval_workers=4) as (sched, _):
        stream = PulledStream(RolloutServicer(sched, heartbeat_s=0), "c", progress=True,
                              batch_progress=batch)
        try:
            assert (await stream.pull()).WhichOneof("kind") == "opened"
            waiting = ["a0", "a1", "a2"]
            stream.requests.put_nowait(pb.StreamRolloutsRequest(submit=pb.SubmitJobs(jobs=[
                _job("x", hold_release=True), *(_job(j, gate=["run", "eval"], turns=2)
                                                for j in waiting)])))
            # Written as they come: every answer, x's whole progress, a*'s up to their gate.
            await stream.pull_until(lambda fs: len([f for f in fs if f.WhichOneof("kind")
                                                    == "accepted"]) == 4
                                    and _seen(fs, "x", (EVAL, P.EVENT_FINISHED, 0))
                                    and all(_seen(fs, j, (RUN, P.EVENT_TURN, 2))
                                            for j in waiting))
            await _queued(sched, handler, "c", ["x"], waiting)
            mark = len(stream.frames)
            await stream.pull_until(lambda fs: _seen(fs, "a2", (EVAL, P.EVENT_STARTED, 0))
                                    and any(f.WhichOneof("kind") == "finished"
                                            for f in fs[mark:]))
            burst = stream.frames[mark:]
            for j in waiting:
                handler.open(j, "eval")
            await stream.pull_until(lambda fs: len([f for f in fs if f.WhichOneof("kind")
                                                    == "finished"]) == 4)
            return burst, stream.frames, handler
        finally:
            await stream.close()


async def test_trajectory_is_written_ahead_of_queued_progress_of_other_jobs(tmp_path) -> None:
    burst, frames, _ = await _scenario(tmp_path, batch=True)
    kinds = [f.WhichOneof("kind") for f in burst]
    # x's delivery was queued after six progress events of a0..a2; it is written first, and
    # those six go out together in the next write.
    assert kinds == ["trajectory", "finished", "progress_batch"]
    assert burst[0].job_id == burst[1].job_id == "x"
    assert per_job(burst[2:]) == {j: [(RUN, P.EVENT_FINISHED, 0), (EVAL, P.EVENT_STARTED, 0)]
                                  for j in ("a0", "a1", "a2")}
    # Over the whole stream: each job's events complete and in the order they happened, all
    # of them before that job's trajectory; sequence numbers without gaps; no empty batch.
    assert per_job(frames) == SCENARIO_EVENTS
    _assert_progress_precedes_trajectory(frames)
    assert [f.sequence for f in frames] == list(range(1, len(frames) + 1))
    assert all(f.progress_batch.events for f in frames
               if f.WhichOneof("kind") == "progress_batch")
    assert not any(f.WhichOneof("kind") == "progress" for f in frames)


async def test_old_style_session_gets_one_frame_per_event_in_queue_order(tmp_path) -> None:
    """Without batch_progress the same run is written as before batching existed: one
    `progress` frame per event, in the order queued (so x's trajectory follows them)."""
    burst, frames, _ = await _scenario(tmp_path, batch=False)
    assert [f.WhichOneof("kind") for f in burst] == ["progress"] * 6 + ["trajectory",
                                                                      "finished"]
    assert not any(f.WhichOneof("kind") == "progress_batch" for f in frames)
    assert per_job(frames) == SCENARIO_EVENTS
    _assert_progress_precedes_trajectory(frames)


def _assert_progress_precedes_trajectory(frames: list[pb.StreamRolloutsResponse]) -> None:
    delivered: set[str] = set()
    for f in frames:
        if f.WhichOneof("kind") == "trajectory":
            delivered.add(f.job_id)
        for job_id, key in progress_of([f]):
            assert job_id not in delivered, f"progress {key} of {job_id} after its trajectory"


async def test_a_backlog_is_split_into_bounded_batches_in_order(tmp_path) -> None:
    """15 events queued while no write is due, at most 4 per frame: four frames (4, 4, 4, 3),
    each job's events in order across them."""
    jobs = ["b0", "b1", "b2"]
    async with running_scheduler(tmp_path / "db", init_workers=4, run_workers=4,
                                 eval_workers=4) as (sched, handler):
        stream = PulledStream(RolloutServicer(sched, heartbeat_s=0, max_progress_batch=4),
                              "c", progress=True, batch_progress=True)
        try:
            await stream.pull()
            stream.requests.put_nowait(pb.StreamRolloutsRequest(submit=pb.SubmitJobs(
                jobs=[_job(j, gate=["init", "run"], turns=3) for j in jobs])))
            await stream.pull_until(lambda fs: len([f for f in fs if f.WhichOneof("kind")
                                                    == "accepted"]) == 3
                                    and len(progress_of(fs)) == 3)  # INIT started
            mark = len(stream.frames)
            for j in jobs:  # five more events each, up to the RUN gate
                handler.open(j, "init")
            await assert_eventually(lambda: all(handler.started(j, "run") for j in jobs))
            await asyncio.sleep(0.05)  # the session's pump moves the last ones to the queue
            await stream.pull_until(lambda fs: len(progress_of(fs)) == 18)
            assert [len(f.progress_batch.events) for f in stream.frames[mark:]] == [4, 4, 4, 3]
            assert per_job(stream.frames) == {j: expected_events(3)[:6] for j in jobs}
        finally:
            await stream.close()


# ----------------------------------------------------------------------------- over gRPC


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[ServerHarness]:
    h = ServerHarness(tmp_path / "state")
    await h.start()
    yield h
    await h.stop()


async def test_old_client_over_grpc_gets_single_frames(harness: ServerHarness) -> None:
    """An OpenSession from before batching (progress only) never sees progress_batch."""
    jobs = [_job(f"o{i}", turns=2) for i in range(40)]
    frames = await run_raw(harness.address, "old", jobs, pb.OpenSession(progress=True))
    assert not any(f.WhichOneof("kind") == "progress_batch" for f in frames)
    assert per_job(frames) == {j.job_id: expected_events(2) for j in jobs}
    _assert_progress_precedes_trajectory(frames)


async def test_batching_under_load_over_grpc_keeps_each_jobs_order(
        harness: ServerHarness) -> None:
    """300 jobs at once: events pile up while writes are in flight and share frames; each
    job's events still arrive complete, in order, before its trajectory."""
    jobs = [_job(f"l{i}", turns=2) for i in range(300)]
    frames = await run_raw(harness.address, "loaded", jobs,
                            pb.OpenSession(progress=True, batch_progress=True))
    batches = [f for f in frames if f.WhichOneof("kind") == "progress_batch"]
    assert not any(f.WhichOneof("kind") == "progress" for f in frames)
    assert max(len(f.progress_batch.events) for f in batches) > 1
    events = len(progress_of(frames))
    assert events == 300 * len(expected_events(2))
    assert len(batches) < events
    assert per_job(frames) == {j.job_id: expected_events(2) for j in jobs}
    _assert_progress_precedes_trajectory(frames)
    assert [f.sequence for f in frames] == list(range(1, len(frames) + 1))


def test_turn_frames_carry_the_attempts_running_totals() -> None:
    """A RUN ``turn`` event becomes a frame with turns completed, tokens and tool calls so far;
    a handler that reports only its 0-based ``turn`` still gets a completed-turns count."""
    from rollout.runtime.types import Stage
    from rollout.server.api.stream_events import progress_to_proto as _progress_to_proto
    from rollout.server.pipeline.subscription import StageProgress

    loop_event = StageProgress("j", Stage.RUN, "turn", {
        "turn": 2, "turns_done": 3, "generated_tokens": 417, "tool_calls_total": 4})
    msg = _progress_to_proto(loop_event)
    assert (msg.event, msg.turns, msg.output_tokens, msg.tool_calls) == (
        pb.StageProgress.EVENT_TURN, 3, 417, 4)
    bare = _progress_to_proto(StageProgress("j", Stage.RUN, "turn", {"turn": 4}))
    assert (bare.turns, bare.output_tokens, bare.tool_calls) == (5, 0, 0)
    started = _progress_to_proto(StageProgress("j", Stage.INIT, "started"))
    assert (started.event, started.turns) == (pb.StageProgress.EVENT_STARTED, 0)
