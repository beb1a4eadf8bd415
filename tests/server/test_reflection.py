"""Server reflection: the .proto comments reach grpcurl, v1 is served beside v1alpha, and
`describe Service.Method` works. Runs the real grpcurl against a real server."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

from rollout.server.api import reflection
from tests.client.conftest import ServerHarness

pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parents[2]


def grpcurl() -> str:
    exe = ROOT / ".venv" / "bin" / "grpcurl"
    if not exe.exists():
        exe = Path(sys.executable).parent / "grpcurl"
    assert exe.exists(), "grpcurl is missing: run scripts/setup_test.sh"
    return str(exe)


async def run(*args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        grpcurl(), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, out.decode()
    return out.decode()


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[ServerHarness]:
    h = ServerHarness(tmp_path / "state")
    await h.start()
    yield h
    await h.stop()


async def test_grpcurl_describe_shows_the_proto_comments(server: ServerHarness) -> None:
    addr = server.address
    services = (await run("-plaintext", addr, "list")).split()
    assert {"rollout.v1.RolloutService", "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= set(services)
    svc = await run("-plaintext", addr, "describe", "rollout.v1.RolloutService")
    assert "RolloutService runs multi-turn agent rollouts" in svc
    assert "docs/PROTOCOL.md" in svc
    # method-level describe (failed with grpcio-reflection's symbol lookup)
    method = await run("-plaintext", addr, "describe", "rollout.v1.RolloutService.SubmitRollout")
    assert "replays its stored trajectory" in method
    assert "rpc SubmitRollout" in method
    msg = await run("-plaintext", addr, "describe", "rollout.v1.Heartbeat")
    assert "durably acknowledged" in msg and "int64 acked_through = 4" in msg
    field = await run("-plaintext", addr, "describe", "rollout.v1.Heartbeat.held_back")
    assert "not yet sent because max_unacked" in field
    enum = await run("-plaintext", addr, "describe", "rollout.v1.FinishedJobPolicy")
    assert "FINISHED_JOB_POLICY_REPLAY" in enum and "new delivery id" in enum


async def _ask(addr: str, service: str, req_cls: type, resp_cls: type, req: object) -> object:
    async with grpc.aio.insecure_channel(addr) as ch:
        call = ch.stream_stream(f"/{service}/ServerReflectionInfo",
                                request_serializer=req_cls.SerializeToString,
                                response_deserializer=resp_cls.FromString)
        responses = [r async for r in call(iter([req]))]
    assert len(responses) == 1
    return responses[0]


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_both_reflection_versions_serve_files_with_source_info(
        server: ServerHarness, version: str) -> None:
    if version == "v1":
        service, req_cls, resp_cls = reflection.V1, reflection.V1Request, reflection.V1Response
    else:
        service = reflection.V1ALPHA
        req_cls = reflection_pb2.ServerReflectionRequest
        resp_cls = reflection_pb2.ServerReflectionResponse
    resp = await _ask(server.address, service, req_cls, resp_cls,
                      req_cls(file_containing_symbol="rollout.v1.RolloutService.GetJob"))
    files = {}
    for raw in resp.file_descriptor_response.file_descriptor_proto:  # type: ignore[attr-defined]
        f = descriptor_pb2.FileDescriptorProto.FromString(raw)
        files[f.name] = f
    # the file, with its imports (a client needs them to build the types)
    assert {"rollout/v1/rollout_service.proto", "rollout/v1/job.proto",
            "rollout/v1/trajectory.proto", "google/protobuf/duration.proto"} <= set(files)
    svc = files["rollout/v1/rollout_service.proto"]
    comments = " ".join(loc.leading_comments for loc in svc.source_code_info.location)
    assert "GetJob returns one job" in comments
    missing = await _ask(server.address, service, req_cls, resp_cls,
                         req_cls(file_containing_symbol="rollout.v1.NoSuchThing"))
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]  # type: ignore[attr-defined]


def test_the_committed_descriptor_set_matches_the_generated_code() -> None:
    """The set served is the one the Python code was generated from (same messages)."""
    from rollout.v1 import rollout_service_pb2

    served = {f.name: f for f in reflection.load_descriptor_set().file}
    doc = served["rollout/v1/rollout_service.proto"]

    served_shape = {(m.name, f.name, f.number) for m in doc.message_type for f in m.field}
    live_shape = {(m.name, f.name, f.number)
                  for m in rollout_service_pb2.DESCRIPTOR.message_types_by_name.values()
                  for f in m.fields}
    assert served_shape == live_shape
    assert [m.name for m in doc.service[0].method] == [
        m.name for m in rollout_service_pb2.DESCRIPTOR.services_by_name[
            "RolloutService"].methods]
