"""Tool processes start without a Python-level fork in the server process, so gRPC's at-fork
handlers never run: 200 bash starts while a real gRPC server streams frames, none failing."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2, struct_pb2

from rollout.runtime.sandbox import Sandbox
from rollout.runtime.tools.bash import BashError, BashSession
from rollout.runtime.tools.ipython import IPythonKernel
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from rollout.v1 import rollout_service_pb2_grpc as pb_grpc
from tests.client.conftest import ServerHarness
from tests.runtime.sandbox_helpers import temp_sandbox

_AT_FORK = {"before": 0, "child": 0}


def _before() -> None:
    _AT_FORK["before"] += 1


def _in_child() -> None:
    _AT_FORK["child"] += 1


# Python runs every registered at-fork handler together (gRPC's among them, when it registers
# any): if ours never runs during the starts, none did.
os.register_at_fork(before=_before, after_in_child=_in_child)


@pytest.fixture
async def sb() -> AsyncIterator[Sandbox]:
    async with temp_sandbox("sp") as sandbox:
        yield sandbox


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[ServerHarness]:
    h = ServerHarness(tmp_path / "state")
    await h.start()
    yield h
    await h.stop()


async def _stream_until(stop: asyncio.Event, address: str, frames: list[int]) -> None:
    """Submit batches of scripted jobs on one session and read every frame, until ``stop``."""
    queue: asyncio.Queue[pb.StreamRolloutsRequest | None] = asyncio.Queue()

    async def requests():  # type: ignore[no-untyped-def]
        while (item := await queue.get()) is not None:
            yield item

    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.RolloutServiceStub(channel).StreamRollouts(requests(), timeout=300)
        await queue.put(pb.StreamRolloutsRequest(open=pb.OpenSession(
            client_id="spawn-load", heartbeat_interval=duration_pb2.Duration(seconds=1))))
        batch, pending = 0, 0
        async for frame in call:
            frames[0] += 1
            kind = frame.WhichOneof("kind")
            if kind == "trajectory":
                await queue.put(pb.StreamRolloutsRequest(ack=pb.AckTrajectories(
                    delivery_ids=[frame.trajectory.delivery_id])))
            if kind == "finished":
                pending -= 1
            if kind in ("opened", "finished") and pending == 0:
                if stop.is_set():
                    break
                jobs = []
                for i in range(8):
                    task = struct_pb2.Struct()
                    task.update({"reward": 1.0})
                    jobs.append(job_pb2.JobSpec(job_id=f"b{batch}-{i}", environment="scripted",
                                                task=task))
                batch, pending = batch + 1, len(jobs)
                await queue.put(pb.StreamRolloutsRequest(submit=pb.SubmitJobs(jobs=jobs)))
        await queue.put(None)


@pytest.mark.timeout(300)
async def test_200_bash_starts_while_grpc_streams(sb: Sandbox, harness: ServerHarness) -> None:
    stop, frames = asyncio.Event(), [0]
    streamer = asyncio.ensure_future(_stream_until(stop, harness.address, frames))
    forks_before = dict(_AT_FORK)
    failures: list[str] = []

    async def one(i: int) -> None:
        try:
            shell = await BashSession.start(sb)
        except BashError as e:
            failures.append(str(e))
            return
        try:
            res = await shell.run(f"echo $(({i} * {i}))")
            if res.output.strip() != str(i * i):
                failures.append(f"shell {i} answered {res.output!r}")
        finally:
            await shell.close()

    try:
        for start in range(0, 200, 4):  # four starts in flight at a time
            await asyncio.gather(*(one(i) for i in range(start, start + 4)))
            assert not streamer.done(), streamer.exception()
    finally:
        stop.set()
        await asyncio.wait_for(streamer, 60)
    assert failures == []
    assert frames[0] > 50  # the server really was streaming throughout
    assert _AT_FORK == forks_before


async def test_ipython_kernel_start_runs_no_at_fork_handler(sb: Sandbox) -> None:
    before = dict(_AT_FORK)
    kernel = await IPythonKernel.start(sb)
    try:
        assert (await kernel.execute("6 * 7")).output.strip() == "42"
    finally:
        await kernel.close()
    assert _AT_FORK == before


def test_the_at_fork_probe_sees_a_python_level_fork() -> None:
    """Control: a spawn that does run Python in the child (``preexec_fn``) trips the probe, so
    the equalities above are not vacuous."""
    before = _AT_FORK["before"]
    subprocess.run(["true"], preexec_fn=lambda: None, check=True)
    assert _AT_FORK["before"] == before + 1
