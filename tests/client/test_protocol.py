"""The session protocol of docs/PROTOCOL.md against a real server: job-id ownership and the
re-submit policies, SubmitRollout retries, group-id reuse, CancelJob of unknown groups, ack
confirmation and held-back counts in heartbeats, and the store identity."""

from __future__ import annotations

import asyncio
import shutil
import time

import grpc
import pytest

from rollout.client.aio import RolloutClient
from rollout.client.errors import RolloutError
from rollout.client.specs import job_spec
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from tests.client.conftest import ServerHarness, task
from tests.client.test_stream import drain, kinds
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(40)
S = job_pb2.Job


async def run_once(client: RolloutClient, client_id: str, specs: list, *,
                   if_finished: str = "report") -> list[pb.StreamRolloutsResponse]:
    async with client.session(client_id, heartbeat_s=0.1) as s:
        await s.submit(specs, if_finished=if_finished)
        await s.close()
        return await drain(s)


async def test_owner_resubmit_of_finished_job_report_replay_reject(
        harness: ServerHarness) -> None:
    async with RolloutClient(harness.address) as client:
        first = await run_once(client, "owner", [{"job_id": "j1", **task(reward=0.5, turns=2)}])
        (orig,) = kinds(first, "trajectory")
        assert not orig.trajectory.resubmitted

        report = await run_once(client, "owner", [{"job_id": "j1", **task()}])
        assert [(f.accepted.duplicate, f.accepted.state) for f in kinds(report, "accepted")] \
            == [(True, S.STATE_SUCCEEDED)]
        assert not kinds(report, "trajectory") and not kinds(report, "finished")

        replay = await run_once(client, "owner", [{"job_id": "j1", **task()}],
                                if_finished="replay")
        order = [f.WhichOneof("kind") for f in replay if f.job_id == "j1"]
        assert order == ["accepted", "trajectory", "finished"]
        (again,) = kinds(replay, "trajectory")
        # the stored result under the next delivery id, flagged as a re-delivery
        assert again.trajectory.resubmitted
        assert again.trajectory.delivery_id == orig.trajectory.delivery_id + 1
        assert again.trajectory.trajectory == orig.trajectory.trajectory
        assert kinds(replay, "finished")[0].finished.reward == 0.5

        # an unknown policy number (the Python client refuses to send one) is refused
        call = client.stub.StreamRollouts()
        await call.write(pb.StreamRolloutsRequest(open=pb.OpenSession(client_id="raw")))
        await call.write(pb.StreamRolloutsRequest(submit=pb.SubmitJobs(
            jobs=[job_spec({"job_id": "j9", **task()})], if_finished=9)))  # type: ignore[arg-type]
        frames = [await call.read(), await call.read()]
        call.cancel()
        assert frames[1].rejected.reason == "INVALID_ENUM_VALUE"
        assert frames[1].rejected.field == "submit.if_finished"
        reject = await run_once(client, "owner", [{"job_id": "j1", **task()}],
                                if_finished="reject")
        (rej,) = kinds(reject, "rejected")
        assert (rej.rejected.code, rej.rejected.reason) == (
            grpc.StatusCode.ALREADY_EXISTS.value[0], "JOB_ALREADY_FINISHED")
        # the job ran once, whatever was re-submitted
        assert [e for e in harness.handler.events if e[:3] == ("j1", "init", "start")] == [
            ("j1", "init", "start")]
        # the re-delivery was acknowledged like any other: nothing is left to replay
        async with client.session("owner", heartbeat_s=0.1) as s:
            assert s.opened.replaying == 0
            assert s.opened.acked_through == again.trajectory.delivery_id


async def test_replay_of_a_pruned_result_is_refused(harness: ServerHarness) -> None:
    async with RolloutClient(harness.address) as client:
        await run_once(client, "p", [{"job_id": "old", **task()}])
        assert harness.server is not None and harness.server.scheduler is not None
        await harness.server.scheduler.store.prune(time.time() + 1)
        frames = await run_once(client, "p", [{"job_id": "old", **task()}],
                                if_finished="replay")
        (rej,) = kinds(frames, "rejected")
        assert (rej.rejected.code, rej.rejected.reason) == (
            grpc.StatusCode.FAILED_PRECONDITION.value[0], "JOB_RESULT_PRUNED")
        with pytest.raises(RolloutError) as info:
            [f async for f in client.submit_rollout({"job_id": "old", **task()})]
        assert info.value.reason == "JOB_RESULT_PRUNED"


async def test_submit_rollout_retry_of_a_finished_job_replays_it(
        harness: ServerHarness) -> None:
    async with RolloutClient(harness.address) as client:
        first = [f async for f in client.submit_rollout({"job_id": "u", **task(reward=0.75)})]
        # The retry used to wait forever: the first call had acknowledged the delivery.
        async with asyncio.timeout(10):
            second = [f async for f in client.submit_rollout({"job_id": "u", **task()})]
    assert [f.WhichOneof("kind") for f in second] == ["accepted", "trajectory", "finished"]
    assert second[0].accepted.duplicate and second[0].accepted.state == S.STATE_SUCCEEDED
    traj = [f.trajectory for f in first if f.WhichOneof("kind") == "trajectory"]
    assert [second[1].trajectory] == traj and traj[0].reward == 0.75
    assert second[2].finished.state == S.STATE_SUCCEEDED and second[2].finished.reward == 0.75


async def test_job_ids_and_session_of_another_client(harness: ServerHarness) -> None:
    async with RolloutClient(harness.address) as client:
        async with client.session("alice", heartbeat_s=0.1) as a:
            await a.submit({"job_id": "shared", **task(gate=["run"])})
            await assert_eventually(lambda: harness.handler.started("shared", "run"))
            # while it runs, and after it finished, the id is alice's
            live = await run_once(client, "bob", [{"job_id": "shared", **task()}])
            harness.handler.open("shared", "run")
            await a.close()
            mine = await drain(a)
        done = await run_once(client, "bob", [{"job_id": "shared", **task()}],
                              if_finished="replay")
    for frames in (live, done):
        (rej,) = kinds(frames, "rejected")
        assert (rej.rejected.code, rej.rejected.reason) == (
            grpc.StatusCode.ALREADY_EXISTS.value[0], "JOB_ID_TAKEN")
        assert not kinds(frames, "trajectory")
    assert len(kinds(mine, "trajectory")) == 1


async def test_group_id_is_reusable_once_all_its_jobs_ended(harness: ServerHarness) -> None:
    group = {"group": {"group_id": "prompt-1", "size": 2, "finish_after": 1}}
    async with RolloutClient(harness.address) as client:
        first = await run_once(client, "g", [
            {"job_id": "s0/a", **task(), **group},
            {"job_id": "s0/b", **task(gate=["run"]), **group}])
        ended = {f.job_id: f.finished for f in kinds(first, "finished")}
        assert ended["s0/a"].state == S.STATE_SUCCEEDED
        assert (ended["s0/b"].state, ended["s0/b"].error.reason) == (
            S.STATE_CANCELLED, "GROUP_FINISHED")
        # the next step samples the same prompt under the same group id: a new group
        second = await run_once(client, "g", [
            {"job_id": "s1/a", **task(reward=0.25), **group},
            {"job_id": "s1/b", **task(reward=0.25), **group}])
        states = {f.job_id: f.finished.state for f in kinds(second, "finished")}
        assert states["s1/a"] == S.STATE_SUCCEEDED or states["s1/b"] == S.STATE_SUCCEEDED
        assert harness.handler.started("s1/a", "init") or harness.handler.started(
            "s1/b", "init")
        # and the closure of the first one is not kept: a restart does not revive it
        assert harness.server is not None and harness.server.scheduler is not None
        store = harness.server.scheduler.store

        async def no_closures() -> bool:  # dropped by a write after the last job ended
            return await store.closed_groups() == {}
        await assert_eventually(no_closures)
        await harness.restart()
        third = await run_once(client, "g", [{"job_id": "s2/a", **task(), **group}])
        assert [f.finished.state for f in kinds(third, "finished")] == [S.STATE_SUCCEEDED]


async def test_cancel_of_an_unknown_group_is_not_found(harness: ServerHarness) -> None:
    async with RolloutClient(harness.address) as client:
        with pytest.raises(RolloutError) as info:
            await client.cancel(group_id="never-was")
        assert (info.value.code, info.value.reason) == (grpc.StatusCode.NOT_FOUND,
                                                       "GROUP_NOT_FOUND")
        async with client.session("c", heartbeat_s=0.1) as s:
            await s.cancel(group_ids=["never-was"])
            await s.close()
            frames = await drain(s)
        (rej,) = kinds(frames, "rejected")
        assert (rej.rejected.code, rej.rejected.reason) == (
            grpc.StatusCode.NOT_FOUND.value[0], "GROUP_NOT_FOUND")
        # cancelling a group whose jobs all ended cancels nothing and leaves the id usable
        grp = {"group": {"group_id": "done-grp", "size": 1}}
        await run_once(client, "c", [{"job_id": "d/0", **task(), **grp}])
        assert await client.cancel(group_id="done-grp") == []
        later = await run_once(client, "c", [{"job_id": "d/1", **task(), **grp}])
        assert [f.finished.state for f in kinds(later, "finished")] == [S.STATE_SUCCEEDED]


async def test_heartbeats_confirm_acks_and_count_held_back(harness: ServerHarness) -> None:
    async with RolloutClient(harness.address) as client, \
            client.session("flow", heartbeat_s=0.1, max_unacked=1) as s:
        await s.submit([{"job_id": f"h{i}", **task()} for i in range(3)])
        beats: list[pb.Heartbeat] = []
        trajs: list[pb.TrajectoryReady] = []

        async def read_until(check) -> None:
            async for f in s.events():
                if f.WhichOneof("kind") == "heartbeat":
                    beats.append(f.heartbeat)
                elif f.WhichOneof("kind") == "trajectory":
                    trajs.append(f.trajectory)
                if check():
                    return

        async with asyncio.timeout(15):
            # all three finished: one sent, two held back by max_unacked=1, none acknowledged
            await read_until(lambda: beats and beats[-1].jobs_in_flight == 0
                             and beats[-1].unacked == 3)
            assert (beats[-1].held_back, beats[-1].acked_through) == (2, 0)
            assert [t.delivery_id for t in trajs] == [1]
            await s.ack([1])
            await read_until(lambda: len(trajs) == 2 and beats[-1].acked_through == 1)
            assert [t.delivery_id for t in trajs] == [1, 2]
            await read_until(lambda: beats[-1].held_back == 1 and beats[-1].unacked == 2)
            await s.ack([2])
            await read_until(lambda: len(trajs) == 3)
            await s.ack([3])
            await read_until(lambda: beats[-1].acked_through == 3 and beats[-1].unacked == 0)


async def test_store_id_is_stable_across_restarts_and_changes_with_the_store(
        harness: ServerHarness) -> None:
    async with RolloutClient(harness.address) as client:
        first = await run_once(client, "st", [{"job_id": "x1", **task()}])
        (opened,) = kinds(first, "opened")
        assert len(opened.opened.store_id) >= 16
        assert opened.opened.acked_through == 0
    await harness.restart()
    async with RolloutClient(harness.address) as client:
        again = await run_once(client, "st", [])
        (op2,) = kinds(again, "opened")
        assert op2.opened.store_id == opened.opened.store_id
        assert op2.opened.acked_through == 1 and not op2.opened.store_changed
        # A session that outlives a server whose state directory was wiped: the old ids must
        # not acknowledge the new store's deliveries.
        async with client.session("st", heartbeat_s=0.1) as s:
            await s.submit({"job_id": "y1", **task()})
            y1 = await asyncio.wait_for(anext(aiter(s.trajectories())), 15)
            await s.ack([y1.delivery_id])
            assert s.acked_through == 2
            # a job that is running when the state is lost
            await s.submit({"job_id": "z1", **task(gate=["run"])})
            await assert_eventually(lambda: harness.handler.started("z1", "run"))
            await harness.stop()
            shutil.rmtree(harness.state_dir)
            await harness.start()
            await s.submit({"job_id": "y2", **task()})
            got = await asyncio.wait_for(anext(aiter(s.trajectories())), 15)
            assert s.store_resets == 1 and s.opened.store_changed
            assert s.opened.store_id != opened.opened.store_id
            # the new store's first delivery reaches the caller (not swallowed as a replay)
            assert got.delivery_id == 1 and got.trajectory.job_id in ("y2", "z1")
            # z1, accepted by the lost store, is submitted again by the session and runs
            harness.handler.open("z1", "run")
            ids = {got.trajectory.job_id}
            async with asyncio.timeout(15):
                async for t in s.trajectories():
                    ids.add(t.trajectory.job_id)
                    if ids == {"y2", "z1"}:
                        break
            assert ids == {"y2", "z1"}


async def test_submit_rollout_retry_after_the_caller_vanished_settles_its_delivery(
        harness: ServerHarness) -> None:
    assert harness.server is not None and harness.server.scheduler is not None
    store = harness.server.scheduler.store
    async with RolloutClient(harness.address) as client:
        call = client.stub.SubmitRollout(pb.SubmitRolloutRequest(job=job_spec(
            {"job_id": "gone", **task(gate=["eval"])})))
        first = await call.read()
        assert first.WhichOneof("kind") == "accepted"
        call.cancel()  # the caller goes away before the result
        sched = harness.server.scheduler
        await assert_eventually(lambda: sched.status().sessions == 0)  # server noticed
        await assert_eventually(lambda: harness.handler.started("gone", "eval"))
        harness.handler.open("gone", "eval")

        async def delivered_unacked() -> bool:  # committed with the job's end, nobody took it
            return await store.unacked_delivery("rpc:gone", "gone") is not None
        await assert_eventually(delivered_unacked)
        retry = [f async for f in client.submit_rollout({"job_id": "gone", **task()})]
    assert [f.WhichOneof("kind") for f in retry] == ["accepted", "trajectory", "finished"]
    assert await store.unacked_delivery("rpc:gone", "gone") is None
