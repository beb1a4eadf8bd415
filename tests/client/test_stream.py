"""Session round trips against the real server: submit, progress, trajectories, acks, groups,
cancel and duplicate submits."""

from __future__ import annotations

import asyncio

import pytest

from rollout.client.aio import RolloutClient
from rollout.client.errors import RolloutError
from rollout.client.sync import RolloutClientSync
from rollout.client.trajectory import flatten
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from tests.client.conftest import ServerHarness, task
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(30)
S = job_pb2.Job


async def drain(session, *, ack: bool = True) -> list[pb.StreamRolloutsResponse]:
    """Consume a closing session to its end, acknowledging trajectories as they come."""
    frames = []
    async for f in session.events():
        frames.append(f)
        if ack and f.WhichOneof("kind") == "trajectory":
            await session.ack([f.trajectory.delivery_id])
    return frames


def kinds(frames, kind: str) -> list:
    return [f for f in frames if f.WhichOneof("kind") == kind]


async def test_round_trip(harness: ServerHarness) -> None:
    wire: list[pb.StreamRolloutsResponse] = []
    async with RolloutClient(harness.address) as client, \
            client.session("trainer", progress=True, heartbeat_s=0.1, on_wire=wire.append) as s:
        assert s.opened.client_id == "trainer"
        await s.submit([{"job_id": "a", **task(reward=0.25, turns=2)},
                        {"job_id": "b", **task(reward=1.0)}])
        await s.close()
        frames = await drain(s)

    accepted = kinds(frames, "accepted")
    assert sorted(f.job_id for f in accepted) == ["a", "b"]
    assert all(not f.accepted.duplicate and f.accepted.state == S.STATE_QUEUED
               for f in accepted)
    stages = {(f.job_id, f.progress.stage, f.progress.event) for f in kinds(frames, "progress")}
    for job in ("a", "b"):
        for st in (job_pb2.STAGE_INIT, job_pb2.STAGE_RUN, job_pb2.STAGE_EVAL):
            assert (job, st, pb.StageProgress.EVENT_FINISHED) in stages
    turns = [f.progress.turns for f in kinds(frames, "progress")
             if f.job_id == "a" and f.progress.event == pb.StageProgress.EVENT_TURN]
    assert turns == [1, 2]
    trajs = {f.job_id: f.trajectory for f in kinds(frames, "trajectory")}
    assert set(trajs) == {"a", "b"}
    assert trajs["a"].trajectory.reward == 0.25
    flat = flatten(trajs["a"].trajectory)
    assert flat is not None and trajs["a"].trajectory.state == S.STATE_SUCCEEDED
    assert flat.token_ids == [1, 2, 3, 1, 2, 4] and flat.loss_mask == [0, 0, 1, 0, 0, 1]
    finished = {f.job_id: f.finished for f in kinds(frames, "finished")}
    assert finished["a"].state == S.STATE_SUCCEEDED and finished["a"].reward == 0.25
    # sequence numbers are 1, 2, 3, ... without gaps on one stream, the frames inside a
    # `batch` frame counted one by one (the batch frame itself is 0); the progress frames
    # unpacked from one progress_batch frame share its number
    assert all(f.sequence == 0 for f in kinds(wire, "batch"))
    alone = [g for f in wire for g in (f.batch.frames if f.WhichOneof("kind") == "batch"
                                       else [f])]
    assert [f.sequence for f in alone] == list(range(1, len(alone) + 1))
    assert [f.sequence for f in frames] == sorted(f.sequence for f in frames)
    # acknowledged: nothing left to replay for this client
    async with RolloutClient(harness.address) as client, client.session("trainer") as s:
        assert s.opened.replaying == 0


async def test_unacked_trajectory_is_replayed_to_a_new_session(harness: ServerHarness) -> None:
    async with RolloutClient(harness.address) as client:
        async with client.session("t2") as s:
            await s.submit(task(reward=0.5) | {"job_id": "r1"})
            first = await anext(s.trajectories())  # not acknowledged
        async with client.session("t2", auto_ack=True, heartbeat_s=0.1) as s:
            assert s.opened.replaying == 1
            await s.close()
            frames = await drain(s, ack=False)
        again = kinds(frames, "trajectory")
        assert [f.trajectory.delivery_id for f in again] == [first.delivery_id]
        async with client.session("t2") as s:
            assert s.opened.replaying == 0  # auto_ack acknowledged it


async def test_group_finish_after_cancels_the_rest(harness: ServerHarness) -> None:
    template = task(gate=["run"])
    async with RolloutClient(harness.address) as client, \
            client.session("g", heartbeat_s=0.1) as s:
        ids = await s.submit_group(template, 4, "grp", finish_after=2)
        assert ids == [f"grp/{i}" for i in range(4)]
        await assert_eventually(lambda: all(harness.handler.started(j, "run") for j in ids))
        harness.handler.open("grp/0", "run")
        harness.handler.open("grp/1", "run")
        await s.close()
        frames = await drain(s)
    states = {f.job_id: f.finished for f in kinds(frames, "finished")}
    assert {j: states[j].state for j in ids} == {
        "grp/0": S.STATE_SUCCEEDED, "grp/1": S.STATE_SUCCEEDED,
        "grp/2": S.STATE_CANCELLED, "grp/3": S.STATE_CANCELLED}
    assert states["grp/2"].error.reason == "GROUP_FINISHED"
    trajs = kinds(frames, "trajectory")
    assert {t.trajectory.trajectory.group_id for t in trajs} == {"grp"}
    assert len(trajs) == 4  # every terminal job delivers one trajectory


async def test_group_seeds_differ(harness: ServerHarness) -> None:
    from rollout.client.specs import group_specs

    specs = group_specs({**task(), "sampling": {"seed": 7}}, 3, "seeded")
    assert len({s.sampling.seed for s in specs}) == 3
    assert all(s.group.size == 3 for s in specs)


async def test_cancel_on_stream_and_unary(harness: ServerHarness) -> None:
    async with RolloutClient(harness.address) as client, \
            client.session("c", heartbeat_s=0.1) as s:
        await s.submit([{"job_id": "x1", **task(gate=["run"])},
                        {"job_id": "x2", **task(gate=["run"])}])
        await assert_eventually(lambda: harness.handler.started("x2", "run"))
        await s.cancel(job_ids=["x1"])
        assert await client.cancel(job_id="x2") == ["x2"]
        with pytest.raises(RolloutError) as exc:
            await client.cancel(job_id="x2")
        assert exc.value.code.name == "FAILED_PRECONDITION"
        assert exc.value.reason == "JOB_ALREADY_FINISHED"
        await s.cancel(job_ids=["nope"])  # answered with a rejected frame; stream goes on
        await s.close()
        frames = await drain(s)
    finished = {f.job_id: f.finished.state for f in kinds(frames, "finished")}
    assert finished == {"x1": S.STATE_CANCELLED, "x2": S.STATE_CANCELLED}
    rejected = kinds(frames, "rejected")
    assert [(f.job_id, f.rejected.reason) for f in rejected] == [("nope", "JOB_NOT_FOUND")]
    assert (("x1", "run", "cancelled") in harness.handler.events)


async def test_duplicate_submit_runs_once(harness: ServerHarness) -> None:
    async with RolloutClient(harness.address) as client, \
            client.session("d", heartbeat_s=0.1) as s:
        await s.submit({"job_id": "dup", **task(gate=["run"])})
        await s.submit({"job_id": "dup", **task(gate=["run"])})
        await assert_eventually(lambda: harness.handler.started("dup", "run"))
        harness.handler.open("dup", "run")
        await s.close()
        frames = await drain(s)
        # after it finished, the owner's third submit is a duplicate that reports the final
        # state; another client may not take the id
        async with client.session("d", heartbeat_s=0.1) as s1:
            await s1.submit({"job_id": "dup", **task()})
            await s1.close()
            late = await drain(s1)
        async with client.session("d2", heartbeat_s=0.1) as s2:
            await s2.submit({"job_id": "dup", **task()})
            await s2.close()
            other = await drain(s2)
    dup = [f.accepted.duplicate for f in kinds(frames, "accepted")]
    assert dup == [False, True]
    assert [e for e in harness.handler.events if e[:2] == ("dup", "init")] == [
        ("dup", "init", "start"), ("dup", "init", "end")]
    assert len(kinds(frames, "trajectory")) == 1
    (acc,) = kinds(late, "accepted")
    assert acc.accepted.duplicate and acc.accepted.state == S.STATE_SUCCEEDED
    assert not kinds(late, "trajectory")  # delivered and acknowledged before (policy REPORT)
    (rej,) = kinds(other, "rejected")
    assert (rej.job_id, rej.rejected.reason, rej.rejected.code) == ("dup", "JOB_ID_TAKEN", 6)
    assert not kinds(other, "accepted") and not kinds(other, "trajectory")


async def test_unary_helpers(harness: ServerHarness) -> None:
    async with RolloutClient(harness.address) as client:
        frames = [f async for f in client.submit_rollout({"job_id": "u1", **task(reward=0.75)})]
        assert frames[0].WhichOneof("kind") == "accepted"
        assert frames[-1].finished.state == S.STATE_SUCCEEDED
        assert [f.trajectory.reward for f in frames if f.WhichOneof("kind") == "trajectory"] \
            == [0.75]
        for i in range(5):
            async for _ in client.submit_rollout({"job_id": f"p{i}", **task()}):
                pass
        got = await client.get_job("u1", include_trajectory=True)
        assert got.job.state == S.STATE_SUCCEEDED and got.trajectory.reward == 0.75
        listed = [j.job_id async for j in client.list_jobs(page_size=2)]
        assert sorted(listed) == sorted(["u1", "p0", "p1", "p2", "p3", "p4"])
        assert len([j async for j in client.list_jobs(page_size=2, limit=3)]) == 3
        assert len([j async for j in client.list_jobs(state="succeeded")]) == 6
        st = await client.status()
        assert [s.stage for s in st.stages] == [1, 2, 3]
        assert "scripted" in st.environments
        with pytest.raises(RolloutError) as exc:
            await client.get_job("missing")
        assert (exc.value.code.name, exc.value.reason) == ("NOT_FOUND", "JOB_NOT_FOUND")


def test_sync_client(threaded_server) -> None:
    with RolloutClientSync(threaded_server.address) as client:
        assert "scripted" in client.status().environments
        with client.session("sync", auto_ack=True, heartbeat_s=0.1) as s:
            s.submit_group(task(reward=0.5), 2, "sg")
            s.close()
            trajs = list(s.trajectories())
        assert sorted(t.trajectory.job_id for t in trajs) == ["sg/0", "sg/1"]
        assert sorted(j.job_id for j in client.list_jobs(group_id="sg")) == ["sg/0", "sg/1"]
        with pytest.raises(RolloutError):
            client.get_job("missing")



async def test_concurrent_single_submits_and_acks_share_frames(harness: ServerHarness) -> None:
    """200 callers each submit one job at once (as an adapter's samples do), then each acks
    its own trajectory at once: while one write is in flight the rest wait and go out merged,
    so a handful of request frames carry them all; every job is answered and runs once."""
    n = 200
    async with RolloutClient(harness.address) as client, \
            client.session("many", heartbeat_s=0.1) as s:
        written = s.frames_written
        ids = await asyncio.gather(*(s.submit({"job_id": f"m{i}", **task()})
                                     for i in range(n)))
        assert sorted(j for one in ids for j in one) == sorted(f"m{i}" for i in range(n))
        submit_frames = s.frames_written - written
        assert submit_frames <= 5, submit_frames
        frames, dids = [], []
        async for f in s.events():
            frames.append(f)
            if f.WhichOneof("kind") == "trajectory":
                dids.append(f.trajectory.delivery_id)
            if len(kinds(frames, "finished")) == n:
                break
        written = s.frames_written
        await asyncio.gather(*(s.ack([d]) for d in dids))
        assert s.frames_written - written <= 5
        assert s.acked_through == n
        await s.close()
        frames += await drain(s)
    assert sorted(f.job_id for f in kinds(frames, "accepted")) == sorted(f"m{i}" for i in range(n))
    assert sorted(f.job_id for f in kinds(frames, "finished")) == sorted(f"m{i}" for i in range(n))
    assert all(not f.accepted.duplicate for f in kinds(frames, "accepted"))
