"""Everything a client sends is bounded and checked, against a real server over loopback.

Each test sends the hostile input a fuzzer or a careless client would and checks both the
answer (status, reason, a message that says what to fix) and that the server is still fine.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2
from google.protobuf.duration_pb2 import Duration
from grpc_status import rpc_status

from rollout.runtime.envs.common import DATA_DIR
from rollout.runtime.envs.swe.handler import SweHandler
from rollout.runtime.tasksets.shipped import load_tasks
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from rollout.v1 import rollout_service_pb2_grpc as pb_grpc
from tests.client.conftest import ServerHarness

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[ServerHarness]:
    h = ServerHarness(tmp_path / "state")
    h.registry.register("swe", SweHandler())
    await h.start()
    yield h
    await h.stop()


def _job(job_id: str, **fields: Any) -> job_pb2.JobSpec:
    s = struct_pb2.Struct()
    s.update({"reward": 1.0})
    return job_pb2.JobSpec(job_id=job_id, environment="scripted", task=s, **fields)


def _reason(err: grpc.aio.AioRpcError) -> str:
    from google.rpc import error_details_pb2

    status = rpc_status.from_call(err)
    assert status is not None
    for d in status.details:
        info = error_details_pb2.ErrorInfo()
        if d.Unpack(info):
            return info.reason
    return ""


async def _stream(address: str, frames: list[pb.StreamRolloutsRequest],
                  until: Any = None) -> tuple[list[pb.StreamRolloutsResponse], Any]:
    """Frames in, frames out until ``until(frame)`` is true or the stream ends; the call's
    error (or None) second."""
    out: list[pb.StreamRolloutsResponse] = []
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.RolloutServiceStub(channel).StreamRollouts(iter(frames), timeout=20)
        try:
            async for f in call:
                out.append(f)
                if until is not None and until(f):
                    call.cancel()
                    break
        except grpc.aio.AioRpcError as err:
            return out, err
    return out, None


async def test_tiny_heartbeat_interval_is_refused(harness: ServerHarness) -> None:
    opened = pb.OpenSession(client_id="beater", heartbeat_interval=Duration(nanos=1))
    frames, err = await _stream(harness.address, [pb.StreamRolloutsRequest(open=opened)])
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _reason(err) == "HEARTBEAT_TOO_SHORT" and "server.min_heartbeat_s" in err.details()
    assert frames == []  # refused before the session opened
    # 0 (no heartbeats) and the floor itself are fine.
    for interval in (Duration(), Duration(nanos=100_000_000)):
        ok = pb.OpenSession(client_id="beater", heartbeat_interval=interval)
        frames, err = await _stream(harness.address, [pb.StreamRolloutsRequest(open=ok)],
                                    until=lambda f: f.WhichOneof("kind") == "opened")
        assert err is None and frames[0].WhichOneof("kind") == "opened"


async def test_huge_metadata_is_rejected_and_listing_stays_possible(
        harness: ServerHarness) -> None:
    big = {"k": "x" * (8 << 20)}
    many = {f"k{i}": "v" for i in range(100)}
    async with grpc.aio.insecure_channel(harness.address) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        for i, metadata in enumerate((big, many)):
            call = stub.SubmitRollout(pb.SubmitRolloutRequest(job=_job(f"md-{i}",
                                                                        metadata=metadata)))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in call:
                    pass
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert _reason(info.value) == "METADATA_TOO_LARGE"
        listed = await stub.ListJobs(pb.ListJobsRequest(), timeout=10)
        assert list(listed.jobs) == []


async def test_list_pages_stay_under_the_byte_budget(tmp_path: Path) -> None:
    """Jobs near the metadata limit: a default page of 100 would pass the budget (half the
    message limit), so the server stops early and the page token resumes exactly there."""
    limit = 128 << 10
    h = ServerHarness(tmp_path / "state", max_message_bytes=limit)
    await h.start()
    try:
        value = "v" * (15 << 10)
        frames = [pb.StreamRolloutsRequest(open=pb.OpenSession(client_id="lister"))]
        frames += [pb.StreamRolloutsRequest(submit=pb.SubmitJobs(jobs=[
            _job(f"pg-{i:02d}", metadata={"m": value}) for i in range(k, k + 4)]))
            for k in range(0, 20, 4)]
        _, err = await _stream(h.address, frames,
                               until=lambda f: f.WhichOneof("kind") == "accepted"
                               and f.job_id == "pg-19")
        assert err is None
        seen: list[str] = []
        token = ""
        async with grpc.aio.insecure_channel(h.address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            while True:
                page = await stub.ListJobs(pb.ListJobsRequest(page_size=100, page_token=token),
                                           timeout=10)
                assert 0 < page.ByteSize() <= limit // 2
                seen += [j.job_id for j in page.jobs]
                token = page.next_page_token
                if not token:
                    break
        assert seen == [f"pg-{i:02d}" for i in range(20)]  # nothing skipped or repeated
        assert len(seen) > (limit // 2) // (15 << 10)  # so it did take several pages
    finally:
        await h.stop()


async def test_unknown_huge_environment_name_is_not_found_not_resource_exhausted(
        harness: ServerHarness) -> None:
    """The name is cut short in the message: echoed whole, 20 KB would pass the default 8 KiB
    metadata limit and the default client would see RESOURCE_EXHAUSTED instead."""
    name = "e" * 20_000
    async with grpc.aio.insecure_channel(harness.address) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        job = _job("huge-env")
        job.environment = name
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.SubmitRollout(pb.SubmitRolloutRequest(job=job), timeout=10):
                pass
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert _reason(info.value) == "UNKNOWN_ENVIRONMENT"
        assert len(info.value.details() or "") < 400
        frames, _ = await _stream(harness.address, [
            pb.StreamRolloutsRequest(open=pb.OpenSession(client_id="huge-env-client")),
            pb.StreamRolloutsRequest(submit=pb.SubmitJobs(jobs=[job]))],
            until=lambda f: f.WhichOneof("kind") == "rejected")
        rejected = [f.rejected for f in frames if f.WhichOneof("kind") == "rejected"]
        assert [r.reason for r in rejected] == ["UNKNOWN_ENVIRONMENT"]
        assert len(rejected[0].message) < 400


@pytest.mark.parametrize("token", ["9" * 30, str(1 << 63), "-1", "1e3", "\u0663"])
async def test_page_token_out_of_range_is_invalid_argument(harness: ServerHarness,
                                                           token: str) -> None:
    """A token past SQLite's 64-bit integer overflowed in the query (INTERNAL)."""
    async with grpc.aio.insecure_channel(harness.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pb_grpc.RolloutServiceStub(channel).ListJobs(
                pb.ListJobsRequest(page_token=token), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _reason(info.value) == "INVALID_PAGE_TOKEN"


async def test_undecodable_frames_get_invalid_argument_and_no_traceback(
        harness: ServerHarness, caplog: pytest.LogCaptureFixture) -> None:
    garbage = b"\xff\xff\xff\xff\x0f"  # a truncated varint: no message parses from this
    caplog.set_level(logging.DEBUG)
    async with grpc.aio.insecure_channel(harness.address) as channel:
        get_job = channel.unary_unary("/rollout.v1.RolloutService/GetJob",
                                      request_serializer=None, response_deserializer=None)
        for _ in range(20):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await get_job(garbage, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert _reason(info.value) == "UNDECODABLE_REQUEST"
        stream = channel.stream_stream("/rollout.v1.RolloutService/StreamRollouts",
                                       request_serializer=None, response_deserializer=None)
        open_frame = pb.StreamRolloutsRequest(
            open=pb.OpenSession(client_id="fuzz")).SerializeToString()
        call = stream(iter([open_frame, garbage]), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _reason(info.value) == "UNDECODABLE_REQUEST"
        # The server still answers well-formed calls.
        stub = pb_grpc.RolloutServiceStub(channel)
        assert (await stub.ListJobs(pb.ListJobsRequest(), timeout=5)).jobs is not None
    tracebacks = [r for r in caplog.records if r.exc_info and r.levelno >= logging.WARNING]
    assert tracebacks == []
    assert not any("Exception deserializing" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("bad", ["job-1\n", "job 1", "j" * 129, "", "ü"])
async def test_ids_are_checked_with_fullmatch(harness: ServerHarness, bad: str) -> None:
    async with grpc.aio.insecure_channel(harness.address) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        call = stub.SubmitRollout(pb.SubmitRolloutRequest(job=_job(bad)))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(info.value.details()) < 300  # a long id is not echoed whole
        for rpc, request in ((stub.GetJob, pb.GetJobRequest(job_id=bad)),
                             (stub.CancelJob, pb.CancelJobRequest(job_id=bad)),
                             (stub.ListJobs, pb.ListJobsRequest(group_id=bad or "\n"))):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await rpc(request, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, rpc
        if bad:
            frames, err = await _stream(harness.address, [pb.StreamRolloutsRequest(
                open=pb.OpenSession(client_id=bad))])
            assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
            frames, err = await _stream(harness.address, [
                pb.StreamRolloutsRequest(open=pb.OpenSession(client_id="ok")),
                pb.StreamRolloutsRequest(submit=pb.SubmitJobs(jobs=[_job(bad)]))],
                until=lambda f: f.WhichOneof("kind") == "rejected")
            rejected = [f for f in frames if f.WhichOneof("kind") == "rejected"]
            invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert rejected and rejected[0].rejected.code == invalid


async def test_bad_ack_is_rejected_in_stream_and_the_session_goes_on(
        harness: ServerHarness) -> None:
    queue: asyncio.Queue[pb.StreamRolloutsRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.StreamRolloutsRequest]:
        while (item := await queue.get()) is not None:
            yield item

    await queue.put(pb.StreamRolloutsRequest(open=pb.OpenSession(client_id="acker")))
    await queue.put(pb.StreamRolloutsRequest(ack=pb.AckTrajectories(delivery_ids=[-5, 0])))
    await queue.put(pb.StreamRolloutsRequest(submit=pb.SubmitJobs(jobs=[_job("after-ack")])))
    kinds: list[str] = []
    async with grpc.aio.insecure_channel(harness.address) as channel:
        call = pb_grpc.RolloutServiceStub(channel).StreamRollouts(requests(), timeout=20)
        async for f in call:
            kinds.append(f.WhichOneof("kind"))
            if f.WhichOneof("kind") == "rejected":
                assert f.rejected.reason == "INVALID_ACK" and f.rejected.field == "ack.delivery_ids"
            if f.WhichOneof("kind") == "trajectory":
                await queue.put(pb.StreamRolloutsRequest(
                    ack=pb.AckTrajectories(delivery_ids=[f.trajectory.delivery_id])))
            if f.WhichOneof("kind") == "finished":
                break
        call.cancel()
    assert "rejected" in kinds and "trajectory" in kinds and "finished" in kinds


def _swe_task(repo_source: str) -> job_pb2.JobSpec:
    task = dict(load_tasks("swe")[0], repo_source=repo_source)
    s = struct_pb2.Struct()
    s.update(task)
    return job_pb2.JobSpec(job_id=f"swe-{abs(hash(repo_source))}", environment="swe", task=s)


async def _submit_status(address: str, spec: job_pb2.JobSpec) -> tuple[grpc.StatusCode, str, str]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.RolloutServiceStub(channel).SubmitRollout(
            pb.SubmitRolloutRequest(job=spec), timeout=10)
        try:
            async for msg in call:
                if msg.WhichOneof("kind") == "accepted":
                    call.cancel()
                    return grpc.StatusCode.OK, "", ""
        except grpc.aio.AioRpcError as err:
            return err.code(), _reason(err), err.details()
    return grpc.StatusCode.OK, "", ""


async def test_repo_source_outside_the_allowed_roots_is_refused(
        harness: ServerHarness, tmp_path: Path) -> None:
    outside = tmp_path / "private"
    outside.mkdir()
    secret_repo = outside / "repo.bundle"
    secret_repo.write_bytes((DATA_DIR / load_tasks("swe")[0]["repo_source"]).read_bytes())
    tasks_dir = harness.state_dir / "tasks"
    tasks_dir.mkdir(parents=True, exist_ok=True)
    (tasks_dir / "link.bundle").symlink_to(secret_repo)  # a link inside leading out
    cases = [str(secret_repo), str(tasks_dir / "link.bundle"), "../../../../../../etc/passwd",
             str(tasks_dir / ".." / ".." / "private" / "repo.bundle"),
             "/root/does-not-exist.bundle"]
    for source in cases:
        code, reason, details = await _submit_status(harness.address, _swe_task(source))
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "PATH_NOT_ALLOWED"), source
        assert "server.task_path_roots" in details
        assert "No such file" not in details  # permission before existence
    # Inside the roots: the shipped data dir (relative) and <state_dir>/tasks are accepted.
    os.link(secret_repo, tasks_dir / "copy.bundle")
    for source in (load_tasks("swe")[0]["repo_source"], str(tasks_dir / "copy.bundle")):
        code, reason, details = await _submit_status(harness.address, _swe_task(source))
        assert code == grpc.StatusCode.OK, (source, reason, details)


async def test_task_path_roots_config_replaces_the_defaults(tmp_path: Path) -> None:
    extra = tmp_path / "datasets"
    extra.mkdir()
    bundle = extra / "r.bundle"
    bundle.write_bytes((DATA_DIR / load_tasks("swe")[0]["repo_source"]).read_bytes())
    h = ServerHarness(tmp_path / "state", task_path_roots=f'["{extra}"]')
    h.registry.register("swe", SweHandler())
    await h.start()
    try:
        code, _, _ = await _submit_status(h.address, _swe_task(str(bundle)))
        assert code == grpc.StatusCode.OK
        code, reason, _ = await _submit_status(h.address,
                                               _swe_task(load_tasks("swe")[0]["repo_source"]))
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "PATH_NOT_ALLOWED")
    finally:
        await h.stop()


async def test_a_bwrap_server_refuses_a_task_image_at_submit(harness: ServerHarness) -> None:
    """A task naming an Apptainer-only image (``oras://``) on a bwrap server is refused when
    submitted (the server tells task validation its runtime), not after queueing for INIT.
    (``docker://`` and OCI references run on bwrap too: docs/images.md.)"""
    spec = _swe_task(load_tasks("swe")[0]["repo_source"])
    spec.task["spec"] = {"image": "oras://example.org/img:1", "test_cmd": "pytest -rA"}
    code, reason, details = await _submit_status(harness.address, spec)
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_TASK"), details
    assert "bwrap" in details
