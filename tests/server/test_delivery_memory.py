"""The memory budget for undelivered trajectories, over real gRPC: clients that stop reading hold
at most their share, the total stays under the budget, and when they read again every
trajectory arrives exactly once (paged in from the store)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import struct_pb2
from prometheus_client import generate_latest

from rollout.runtime.handler import HandlerRegistry
from rollout.runtime.types import Trajectory, Turn
from rollout.server.app import Server
from rollout.server.pipeline.delivery_budget import DeliveryBudget, held_bytes
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from rollout.v1 import rollout_service_pb2_grpc as pb_grpc
from tests.client.conftest import _no_sandbox, make_config
from tests.server.handlers import ScriptedHandler
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(180)

TURNS, WIDTH = 400, 100
"""Scripted turns per trajectory and prompt tokens per turn: about 120 KB encoded, 1.9 MB as
the budget counts the decoded objects."""
SESSIONS, JOBS = 3, 6
UNREAD = [("grpc.http2.bdp_probe", 0)]
"""A client that stops reading lets the server write only its 64 KiB window; with bandwidth
probing the window grows to megabytes (client memory, not the server's: that is not what
this test measures)."""


def _one_size() -> int:
    return held_bytes(Trajectory(job_id="x", turns=[
        Turn(prompt_ids=list(range(1000, 1000 + WIDTH)), output_ids=[3],
             output_logprobs=[-0.5])] * TURNS, metadata={"scripted": "yes"}))


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    cfg = make_config(tmp_path / "state")
    size = _one_size()
    cfg.pipeline.session_memory_bytes = 2 * size + size // 2  # two fit, a third does not
    cfg.pipeline.delivery_memory_bytes = SESSIONS * cfg.pipeline.session_memory_bytes
    registry = HandlerRegistry()
    registry.register("scripted", ScriptedHandler())
    srv = await Server(cfg, registry=registry, sandbox_factory=_no_sandbox).start()
    yield srv
    await srv.stop(0.1)


class Stalled:
    """A session that submits, then reads nothing until told to resume."""

    def __init__(self, channel: grpc.aio.Channel, client_id: str) -> None:
        self.client_id = client_id
        self.requests: asyncio.Queue[pb.StreamRolloutsRequest | None] = asyncio.Queue()
        self.requests.put_nowait(pb.StreamRolloutsRequest(open=pb.OpenSession(
            client_id=client_id, progress=False)))
        self.call = pb_grpc.RolloutServiceStub(channel).StreamRollouts(self._send(),
                                                                      timeout=150)

    async def _send(self) -> AsyncIterator[pb.StreamRolloutsRequest]:
        while (req := await self.requests.get()) is not None:
            yield req

    def submit(self, job_ids: list[str]) -> None:
        jobs = []
        for job_id in job_ids:
            task = struct_pb2.Struct()
            task.update({"turns": TURNS, "width": WIDTH})
            jobs.append(job_pb2.JobSpec(job_id=job_id, environment="scripted", task=task))
        self.requests.put_nowait(pb.StreamRolloutsRequest(submit=pb.SubmitJobs(jobs=jobs)))

    async def read_all(self, want: set[str]) -> list[str]:
        """Read (and ack) until every job of ``want`` delivered; the job ids in order."""
        got: list[str] = []
        async for f in self.call:
            if f.WhichOneof("kind") == "trajectory":
                got.append(f.job_id)
                self.requests.put_nowait(pb.StreamRolloutsRequest(
                    ack=pb.AckTrajectories(delivery_ids=[f.trajectory.delivery_id])))
            if want <= set(got):
                self.requests.put_nowait(None)
                return got
        raise AssertionError(f"stream ended after {got}")


async def test_stalled_sessions_hold_their_share_and_get_everything_once_on_resume(
        server: Server) -> None:
    sched = server.scheduler
    assert sched is not None and sched.delivery.budget is not None
    budget: DeliveryBudget = sched.delivery.budget
    size = _one_size()
    async with grpc.aio.insecure_channel(server.address, options=UNREAD) as channel:
        sessions = [Stalled(channel, f"stalled-{i}") for i in range(SESSIONS)]
        for s in sessions:
            s.submit([f"{s.client_id}-{j}" for j in range(JOBS)])
        await assert_eventually(lambda: sched.status().pending == 0 and sum(
            sched.status().jobs_by_state.values()) >= SESSIONS * JOBS, timeout=90)
        # Every session has more finished for it than its share holds, and reads nothing.
        await assert_eventually(lambda: sched.delivery.starved_sessions == SESSIONS, timeout=20)
        assert budget.peak <= budget.total_bytes
        for s in sessions:
            sub = sched.delivery._subs[s.client_id]
            assert 0 < sub.held_bytes <= budget.session_bytes, (s.client_id, sub.held_bytes)
            assert sub.held_bytes // size <= 2
        metrics = {line.split()[0]: float(line.split()[1]) for line in generate_latest(
            sched.metrics_registry).decode().splitlines() if not line.startswith("#")}
        assert metrics["rollout_delivery_memory_bytes"] == budget.held > 0
        assert metrics["rollout_sessions_over_memory_share"] == SESSIONS
        assert metrics['rollout_delivery_memory_limit_bytes{scope="total"}'] == (
            budget.total_bytes)

        got = await asyncio.gather(*(s.read_all({f"{s.client_id}-{j}" for j in range(JOBS)})
                                     for s in sessions))
        for s, ids in zip(sessions, got, strict=True):
            assert sorted(ids) == sorted(f"{s.client_id}-{j}" for j in range(JOBS)), ids
    assert budget.peak <= budget.total_bytes
    await assert_eventually(lambda: budget.held == 0, timeout=10)


def test_the_budget_rules() -> None:
    b = DeliveryBudget(total_bytes=100, session_bytes=40)
    assert b.refusal(0, 500) == ""  # nothing held anywhere: even a huge one goes, alone
    b.charge(500)
    assert b.refusal(0, 1) == "total"
    b.release(500)
    b.charge(30)
    assert b.refusal(30, 20) == "session"  # over the share
    assert b.refusal(0, 60) == ""  # a session holding nothing takes one that fits the total
    assert b.refusal(0, 71) == "total"
    woken: list[int] = []
    b.wait_for_room(1, lambda: woken.append(1))
    b.release(30)
    assert woken == [1] and b.held == 0 and b.peak == 500
