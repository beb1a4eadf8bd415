"""BackendService over a real grpc.aio server on port 0, plus the ``rollout backends`` CLI."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from safetensors.torch import save_file

from rollout.client.errors import RolloutError
from rollout.entrypoints import cli
from rollout.server.api.backends_servicer import BackendServicer
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.http_server import serve
from rollout.server.llm.transformers_engine import TransformersEngine
from rollout.v1 import backend_service_pb2 as pb
from rollout.v1 import backend_service_pb2_grpc as pb_grpc
from tests.fixtures.tiny_model import random_state_dict
from tests.server.llm.conftest import FakeEngine
from tests.util import assert_eventually


class Harness:
    def __init__(self, pool: BackendPool, stub: pb_grpc.BackendServiceStub, address: str):
        self.pool, self.stub, self.address = pool, stub, address


@pytest.fixture
async def harness(tiny_dir: Path) -> AsyncIterator[Harness]:
    pool = BackendPool([FakeEngine("fake-a")], health_interval_s=0)
    servicer = BackendServicer(
        pool, admission_timeout_s=5,
        in_process_factory=lambda d, device, name: TransformersEngine(d, device=device,
                                                                      name=name))
    server = grpc.aio.server()
    pb_grpc.add_BackendServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield Harness(pool, pb_grpc.BackendServiceStub(channel), f"127.0.0.1:{port}")
    await channel.close()
    await server.stop(None)
    await pool.close()


def error_of(err: grpc.aio.AioRpcError) -> RolloutError:
    return RolloutError.from_rpc_error(err)


async def expect(call: Any, code: grpc.StatusCode, reason: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    err = error_of(info.value)
    assert (err.code, err.reason, err.from_server) == (code, reason, True)


async def test_add_list_remove_http_backend(harness: Harness, tiny_dir: Path) -> None:
    engine = TransformersEngine(tiny_dir, name="srv")
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(engine, "127.0.0.1", 0, "tiny", ready))
    port = await ready
    try:
        reply = await harness.stub.AddBackend(pb.AddBackendRequest(
            name="gpu-1", weight=2, http=pb.HttpBackendSource(
                url=f"http://127.0.0.1:{port}", model="tiny", policy_version=4)))
        assert reply.backend.kind == pb.BACKEND_KIND_HTTP
        assert reply.backend.state == pb.Backend.STATE_HEALTHY
        assert (reply.backend.weight, reply.backend.policy_version) == (2.0, 4)
        assert reply.backend.add_time.seconds > 0
        await expect(harness.stub.AddBackend(pb.AddBackendRequest(
            name="gpu-1", http=pb.HttpBackendSource(url=f"http://127.0.0.1:{port}",
                                                    model="tiny"))),
            grpc.StatusCode.ALREADY_EXISTS, "BACKEND_ALREADY_EXISTS")
        page = await harness.stub.ListBackends(pb.ListBackendsRequest(page_size=1))
        assert [b.name for b in page.backends] == ["fake-a"] and page.next_page_token
        page = await harness.stub.ListBackends(
            pb.ListBackendsRequest(page_size=1, page_token=page.next_page_token))
        assert [b.name for b in page.backends] == ["gpu-1"] and not page.next_page_token
        removed = await harness.stub.RemoveBackend(pb.RemoveBackendRequest(name="gpu-1"))
        assert removed.backend.state == pb.Backend.STATE_DRAINING
        assert [b.name for b in harness.pool.backends()] == ["fake-a"]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.parametrize("request_,code,reason", [
    (pb.AddBackendRequest(name="", http=pb.HttpBackendSource(url="http://x:1", model="m")),
     grpc.StatusCode.INVALID_ARGUMENT, "INVALID_BACKEND_NAME"),
    (pb.AddBackendRequest(name="a b"), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_BACKEND_NAME"),
    (pb.AddBackendRequest(name="n"), grpc.StatusCode.INVALID_ARGUMENT, "MISSING_BACKEND_SOURCE"),
    (pb.AddBackendRequest(name="n", weight=-1, http=pb.HttpBackendSource(url="http://x:1",
                                                                         model="m")),
     grpc.StatusCode.INVALID_ARGUMENT, "INVALID_BACKEND_WEIGHT"),
    (pb.AddBackendRequest(name="n", http=pb.HttpBackendSource(url="ftp://x", model="m")),
     grpc.StatusCode.INVALID_ARGUMENT, "INVALID_BACKEND_URL"),
    (pb.AddBackendRequest(name="n", http=pb.HttpBackendSource(url="http://127.0.0.1:9",
                                                              model="m")),
     grpc.StatusCode.UNAVAILABLE, "BACKEND_UNHEALTHY"),
    (pb.AddBackendRequest(name="n", in_process=pb.InProcessBackendSource(
        model_path="/nonexistent")), grpc.StatusCode.FAILED_PRECONDITION, "MODEL_NOT_FOUND"),
    (pb.AddBackendRequest(name="fake-a", http=pb.HttpBackendSource(url="http://x:1", model="m")),
     grpc.StatusCode.ALREADY_EXISTS, "BACKEND_ALREADY_EXISTS"),
])
async def test_add_rejects_bad_requests(harness: Harness, request_: pb.AddBackendRequest,
                                        code: grpc.StatusCode, reason: str) -> None:
    await expect(harness.stub.AddBackend(request_), code, reason)


async def test_managed_vllm_without_vllm_is_failed_precondition(
        harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout.server.llm import vllm_launcher

    monkeypatch.setattr(vllm_launcher, "vllm_executable", lambda: None)
    await expect(harness.stub.AddBackend(pb.AddBackendRequest(
        name="v", managed_vllm=pb.ManagedVllmBackendSource(model="m"))),
        grpc.StatusCode.FAILED_PRECONDITION, "VLLM_NOT_INSTALLED")


class GatedHealthEngine(FakeEngine):
    """Its health probe answers only when the test says so; records that it was closed."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.probing = False
        self.answer = asyncio.Event()
        self.closed = False

    async def health(self) -> bool:
        self.probing = True
        await self.answer.wait()
        return True

    async def close(self) -> None:
        self.closed = True


async def test_add_cancelled_as_the_probe_answers_adds_nothing_and_closes(
        tiny_dir: Path) -> None:
    """A cancel that lands in the same loop step as the health probe's answer must win: with
    Python 3.11's ``asyncio.wait_for`` (gh-86296) the answer won, the cancelled call added its
    engine to the pool and nobody owned it."""
    engine = GatedHealthEngine("late")
    pool = BackendPool([FakeEngine("fake-a")], health_interval_s=0)
    servicer = BackendServicer(pool, admission_timeout_s=30,
                               in_process_factory=lambda d, device, name: engine)
    request = pb.AddBackendRequest(name="late", in_process=pb.InProcessBackendSource(
        model_path=str(tiny_dir)))
    try:
        task = asyncio.create_task(servicer.AddBackend(request, None))  # type: ignore[arg-type]
        await assert_eventually(lambda: engine.probing, timeout=10)
        engine.answer.set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [b.name for b in pool.backends()] == ["fake-a"]
        assert engine.closed
    finally:
        await pool.close()


async def test_in_process_update_weights_and_versions(harness: Harness, tiny_dir: Path,
                                                      tmp_path: Path) -> None:
    reply = await harness.stub.AddBackend(pb.AddBackendRequest(
        name="local", in_process=pb.InProcessBackendSource(model_path=str(tiny_dir))))
    assert reply.backend.kind == pb.BACKEND_KIND_IN_PROCESS
    save_file(random_state_dict(tiny_dir, seed=4), str(tmp_path / "model.safetensors"))
    updated = await harness.stub.UpdateWeights(pb.UpdateWeightsRequest(
        checkpoint_path=str(tmp_path), policy_version=9, backend_names=["local"]))
    assert [(b.name, b.policy_version) for b in updated.backends] == [("local", 9)]
    await expect(harness.stub.UpdateWeights(pb.UpdateWeightsRequest(
        checkpoint_path="/missing", policy_version=10, backend_names=["local"])),
        grpc.StatusCode.NOT_FOUND, "CHECKPOINT_NOT_FOUND")
    await expect(harness.stub.UpdateWeights(pb.UpdateWeightsRequest(
        checkpoint_path=str(tmp_path), policy_version=1, backend_names=["nope"])),
        grpc.StatusCode.NOT_FOUND, "BACKEND_NOT_FOUND")
    await expect(harness.stub.UpdateWeights(pb.UpdateWeightsRequest(policy_version=1)),
                 grpc.StatusCode.INVALID_ARGUMENT, "MISSING_CHECKPOINT")
    (tmp_path / "bad").mkdir()
    save_file({"x": random_state_dict(tiny_dir, 1)["lm_head.weight"]},
              str(tmp_path / "bad" / "model.safetensors"))
    await expect(harness.stub.UpdateWeights(pb.UpdateWeightsRequest(
        checkpoint_path=str(tmp_path / "bad"), policy_version=11, backend_names=["local"])),
        grpc.StatusCode.FAILED_PRECONDITION, "CHECKPOINT_MISMATCH")
    # An in-process engine loads its own weights: it cannot merely be relabelled.
    await expect(harness.stub.SetPolicyVersion(pb.SetPolicyVersionRequest(
        policy_version=12, backend_names=["local"])),
        grpc.StatusCode.FAILED_PRECONDITION, "BACKEND_LOADS_OWN_WEIGHTS")
    relabelled = await harness.stub.SetPolicyVersion(pb.SetPolicyVersionRequest(
        policy_version=12, backend_names=["fake-a"]))
    assert relabelled.backends[0].policy_version == 12
    await expect(harness.stub.RemoveBackend(pb.RemoveBackendRequest(name="ghost")),
                 grpc.StatusCode.NOT_FOUND, "BACKEND_NOT_FOUND")
    await expect(harness.stub.ListBackends(pb.ListBackendsRequest(page_token="zz")),
                 grpc.StatusCode.INVALID_ARGUMENT, "INVALID_PAGE_TOKEN")


async def test_cli_backends(harness: Harness, capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # rich would truncate the table to 80 columns
    code = await asyncio.to_thread(cli.main, ["backends", "list", "--address", harness.address])
    assert code == 0 and "fake-a" in capsys.readouterr().out
    code = await asyncio.to_thread(cli.main, ["backends", "set-version", "3", "--backend",
                                              "fake-a", "--address", harness.address])
    assert code == 0 and harness.pool.get("fake-a").policy_version == 3
    code = await asyncio.to_thread(cli.main, ["backends", "remove", "ghost", "--address",
                                              harness.address])
    assert code == 2 and "NOT_FOUND BACKEND_NOT_FOUND" in capsys.readouterr().err
    code = await asyncio.to_thread(cli.main, ["backends", "add", "x", "--url",
                                              "http://127.0.0.1:9", "--model", "m",
                                              "--address", harness.address])
    assert code == 2 and "UNAVAILABLE BACKEND_UNHEALTHY" in capsys.readouterr().err
    code = await asyncio.to_thread(cli.main, ["backends", "remove", "fake-a", "--address",
                                              harness.address])
    assert code == 0 and "DRAINING" in capsys.readouterr().out
