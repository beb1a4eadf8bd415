"""A group holding jobs of two owners (the operator may submit as any client id) is visible to
neither owner, on every route that takes a group: gRPC CancelJob, a session's cancel frame,
ListJobs' group filter, and the dashboard's group page, its live stream and its jobs filter.
One predicate decides (``server/tenancy/ownership.py``); the admin role opens no tenant's
group either."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest

from rollout.server.tenancy import ownership
from rollout.server.tenancy.auth import OPERATOR, Principal
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from rollout.v1 import rollout_service_pb2_grpc as pb_grpc
from tests.client.conftest import ServerHarness
from tests.server.test_tenancy import ALICE, BOB, CLIENTS, LEGACY, OPS, Session, _job, _kind, _md

pytestmark = pytest.mark.timeout(90)
GROUP = "mixed"


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[ServerHarness]:
    h = ServerHarness(tmp_path / "state", clients=json.dumps(CLIENTS), auth_token=LEGACY,
                      dashboard_port=0)
    await h.start()
    yield h
    await h.stop()


def test_the_one_predicate() -> None:
    alice, admin = Principal("alice"), Principal("ops", frozenset({"admin"}))
    assert ownership.sees_group(alice, ["alice", "rpc:alice#j"])
    assert not ownership.sees_group(alice, ["alice", "bob"])
    assert not ownership.sees_group(alice, [])
    assert not ownership.sees_group(admin, ["alice"])
    assert ownership.sees_group(OPERATOR, ["alice", "bob"])
    assert ownership.sees_server_figures(admin) and not ownership.sees_server_figures(alice)


async def test_a_group_of_two_owners_is_refused_on_every_route(harness: ServerHarness) -> None:
    async with grpc.aio.insecure_channel(harness.address) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        # The operator submits into one group as Alice and as Bob; Bob's job stays running.
        for client, job_id, gate in (("alice", "m-alice", []), ("bob", "m-bob", ["run"])):
            s = Session(channel, LEGACY, client)
            s.send(submit=pb.SubmitJobs(jobs=[_job(job_id, group=GROUP, reward=1.0,
                                                   gate=gate)]))
            await s.until(lambda f: _kind(f) == "accepted")
            s.close()
        for token in (ALICE, BOB, OPS):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.CancelJob(pb.CancelJobRequest(group_id=GROUP), metadata=_md(token))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, token
        alice = Session(channel, ALICE, "alice")
        alice.send(cancel=pb.CancelJobs(group_ids=[GROUP]))
        got = await alice.until(lambda f: _kind(f) == "rejected")
        assert got[-1].rejected.reason == "GROUP_NOT_ACCESSIBLE"
        alice.close()
        listed = await stub.ListJobs(pb.ListJobsRequest(group_id=GROUP), metadata=_md(ALICE))
        assert {j.job_id for j in listed.jobs} <= {"m-alice"}
        running = await stub.GetJob(pb.GetJobRequest(job_id="m-bob"), metadata=_md(LEGACY))
        assert running.job.state == job_pb2.Job.STATE_RUNNING  # nobody cancelled it

        server = harness.server
        assert server is not None and server.dashboard is not None
        base = server.dashboard.url.rstrip("/")
        for token in (ALICE, BOB, OPS):
            async with aiohttp.ClientSession(
                    headers={"Authorization": f"Bearer {token}"}) as http:
                for path in (f"/groups/{GROUP}", f"/live/group/{GROUP}"):
                    async with http.get(base + path) as r:
                        assert r.status == 404, (token, path)
                async with http.get(f"{base}/jobs?group={GROUP}") as r:
                    text = await r.text()
                    assert r.status == 200
                    others = {"m-alice", "m-bob"} - ({"m-alice"} if token == ALICE else
                                                     {"m-bob"} if token == BOB else set())
                    assert not any(f'data-job="{j}"' in text for j in others), token
        async with aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {LEGACY}"}) as http:
            async with http.get(f"{base}/groups/{GROUP}") as r:
                assert r.status == 200  # the operator sees the group
        harness.handler.open("m-bob", "run")
