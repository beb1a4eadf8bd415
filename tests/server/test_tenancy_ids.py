"""Ids between tenants: a request that cannot run says nothing about whose ids exist, and of
two tenants racing for one fresh group id exactly one gets it, decided in the store."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from rollout.v1 import rollout_service_pb2_grpc as pb_grpc
from tests.client.conftest import ServerHarness
from tests.server.test_tenancy import ALICE, BOB, CLIENTS, Session, _job, _md, _reason

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[ServerHarness]:
    h = ServerHarness(tmp_path / "state", clients=json.dumps(CLIENTS))
    await h.start()
    yield h
    await h.stop()


def _kind(f: pb.StreamRolloutsResponse) -> str:
    return f.WhichOneof("kind") or ""


async def _answers(session: Session, job_ids: set[str]) -> dict[str, pb.StreamRolloutsResponse]:
    """The accepted / rejected frame of each of ``job_ids``."""
    got: dict[str, pb.StreamRolloutsResponse] = {}
    async for f in session.call:
        if _kind(f) in ("accepted", "rejected") and f.job_id in job_ids:
            got[f.job_id] = f
            if len(got) == len(job_ids):
                return got
    raise AssertionError(f"stream ended with {sorted(got)} of {sorted(job_ids)}")


def _bogus(job: job_pb2.JobSpec, how: str) -> job_pb2.JobSpec:
    if how == "environment":
        job.environment = "no-such-env"
    else:  # a task the environment refuses (checked by the scheduler, not at the edge)
        job.task.update({"bad": True})
    return job


@pytest.mark.parametrize("how, code, reason", [
    ("environment", grpc.StatusCode.NOT_FOUND, "UNKNOWN_ENVIRONMENT"),
    ("task", grpc.StatusCode.INVALID_ARGUMENT, "INVALID_TASK")])
async def test_a_request_that_cannot_run_answers_alike_for_taken_and_free_ids(
        harness: ServerHarness, how: str, code: grpc.StatusCode, reason: str) -> None:
    """Validation comes before any existence check: Bob's bogus submits under Alice's job id,
    into Alice's group and under fresh ids get one and the same answer."""
    async with grpc.aio.insecure_channel(harness.address) as channel:
        alice = Session(channel, ALICE, "alice")
        alice.send(submit=pb.SubmitJobs(jobs=[
            _job("a-live", group="a-g", reward=1.0, gate=["run"]),  # runs until the end
            _job("a-done")]))
        await alice.until(lambda f: _kind(f) == "finished" and f.job_id == "a-done")

        probes = {"a-live": _job("a-live"), "a-done": _job("a-done"),
                  "b-into-a-g": _job("b-into-a-g", group="a-g"),
                  "b-free": _job("b-free"), "b-free-g": _job("b-free-g", group="free-g")}
        bob = Session(channel, BOB, "bob")
        bob.send(submit=pb.SubmitJobs(jobs=[_bogus(j, how) for j in probes.values()]))
        answers = await _answers(bob, set(probes))
        bob.close()
        for job_id, f in answers.items():
            assert _kind(f) == "rejected", (job_id, f)
            assert (f.rejected.code, f.rejected.reason) == (code.value[0], reason), job_id
        assert len({f.rejected.message.replace(j, "") for j, f in answers.items()}) == 1

        stub = pb_grpc.RolloutServiceStub(channel)
        for job_id, job in probes.items():
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.SubmitRollout(pb.SubmitRolloutRequest(job=job),
                                                  metadata=_md(BOB), timeout=10):
                    pass
            assert (info.value.code(), _reason(info.value)) == (code, reason), job_id
        alice.close()


async def test_two_tenants_racing_for_fresh_group_ids_one_wins_each(
        harness: ServerHarness) -> None:
    """Alice and Bob submit into the same fresh group id in the same instant, many times, with
    more of their jobs committing meanwhile (the store's batches are full): each group ends
    up with one owner, and the loser hears GROUP_ID_TAKEN."""
    rounds = 60
    async with grpc.aio.insecure_channel(harness.address) as channel:
        alice, bob = Session(channel, ALICE, "alice"), Session(channel, BOB, "bob")
        for s in (alice, bob):
            s.send(submit=pb.SubmitJobs(jobs=[_job("warm-" + ("a" if s is alice else "b"))]))
        await asyncio.gather(_answers(alice, {"warm-a"}), _answers(bob, {"warm-b"}))
        winners: dict[str, str] = {}
        for i in range(rounds):
            group = f"race-{i}"
            load = [_job(f"{i}-load-{k}") for k in range(4)]
            a_jobs = [_job(f"a-{group}", group=group), *[_job(f"a-{j.job_id}") for j in load]]
            b_jobs = [_job(f"b-{group}", group=group), *[_job(f"b-{j.job_id}") for j in load]]
            # Alternate who sends first, so a fixed order cannot be what decides.
            first, second = (alice, bob) if i % 2 else (bob, alice)
            first.send(submit=pb.SubmitJobs(jobs=a_jobs if first is alice else b_jobs))
            second.send(submit=pb.SubmitJobs(jobs=b_jobs if first is alice else a_jobs))
            got_a, got_b = await asyncio.gather(_answers(alice, {f"a-{group}"}),
                                                _answers(bob, {f"b-{group}"}))
            fa, fb = got_a[f"a-{group}"], got_b[f"b-{group}"]
            kinds = sorted([_kind(fa), _kind(fb)])
            assert kinds == ["accepted", "rejected"], (group, fa, fb)
            loser = fb if _kind(fa) == "accepted" else fa
            assert loser.rejected.reason == "GROUP_ID_TAKEN", loser
            assert loser.rejected.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
            winners[group] = "alice" if _kind(fa) == "accepted" else "bob"
        alice.close()
        bob.close()
    await harness.server.store.flush()  # type: ignore[union-attr]
    conn = sqlite3.connect(harness.state_dir / "jobs.sqlite3")
    try:
        owners = dict(conn.execute(
            "SELECT group_id, group_concat(DISTINCT owner) FROM jobs"
            " WHERE group_id LIKE 'race-%' GROUP BY group_id").fetchall())
    finally:
        conn.close()
    assert owners == winners
    assert set(winners.values()) == {"alice", "bob"}  # both orders were exercised
