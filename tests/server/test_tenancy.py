"""Tenants kept apart: credentials bound to client ids, roles, TLS and mTLS (real servers).

Alice, Bob and an operator each hold their own token; Bob tries everything the issue's
reliability tester did with a shared token (open Alice's session, read, cancel and ack her
jobs, take her job ids and groups) and must get PERMISSION_DENIED every time, while Alice's
jobs run on and deliver to her.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from rollout.runtime.handler import HandlerRegistry
from rollout.runtime.types import InvalidArgument
from rollout.server.app import Server
from rollout.server.llm.backend_pool import BackendPool
from rollout.v1 import backend_service_pb2, backend_service_pb2_grpc, job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from rollout.v1 import rollout_service_pb2_grpc as pb_grpc
from tests.client.conftest import ServerHarness, _no_sandbox, make_config
from tests.server.handlers import ScriptedHandler
from tests.server.tls_certs import TestCA
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(60)

ALICE, BOB, OPS, LEGACY = ("alice-token-0123456789", "bob-token-0123456789",
                           "ops-token-0123456789", "legacy-token-0123456789")
CLIENTS = [{"client_id": "alice", "token": ALICE},
           {"client_id": "bob", "token": BOB},
           {"client_id": "ops", "token": OPS, "roles": ["admin"]}]


def _md(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def _job(job_id: str, group: str = "", **task: Any) -> job_pb2.JobSpec:
    s = struct_pb2.Struct()
    s.update(task or {"reward": 1.0})
    spec = job_pb2.JobSpec(job_id=job_id, environment="scripted", task=s)
    if group:
        spec.group.CopyFrom(job_pb2.GroupSpec(group_id=group, size=4))
    return spec


def _reason(err: grpc.aio.AioRpcError) -> str:
    from google.rpc import error_details_pb2

    status = rpc_status.from_call(err)
    for d in status.details if status else ():
        info = error_details_pb2.ErrorInfo()
        if d.Unpack(info):
            return info.reason
    return ""


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[ServerHarness]:
    h = ServerHarness(tmp_path / "state", clients=json.dumps(CLIENTS),
                      auth_token=LEGACY)
    await h.start()
    yield h
    await h.stop()


class Session:
    """A bare StreamRollouts call fed from a queue, for one principal."""

    def __init__(self, channel: grpc.aio.Channel, token: str | None, client_id: str) -> None:
        self.queue: asyncio.Queue[pb.StreamRolloutsRequest | None] = asyncio.Queue()
        self.queue.put_nowait(pb.StreamRolloutsRequest(open=pb.OpenSession(client_id=client_id)))
        self.call = pb_grpc.RolloutServiceStub(channel).StreamRollouts(
            self._requests(), metadata=_md(token) if token else (), timeout=30)

    async def _requests(self) -> AsyncIterator[pb.StreamRolloutsRequest]:
        while (item := await self.queue.get()) is not None:
            yield item

    def send(self, **kind: Any) -> None:
        self.queue.put_nowait(pb.StreamRolloutsRequest(**kind))

    async def until(self, pred: Any) -> list[pb.StreamRolloutsResponse]:
        got = []
        async for f in self.call:
            got.append(f)
            if pred(f):
                return got
        raise AssertionError(f"stream ended first: {got}")

    def close(self) -> None:
        self.call.cancel()


def _kind(f: pb.StreamRolloutsResponse) -> str:
    return str(f.WhichOneof("kind"))


async def test_another_client_can_neither_open_read_cancel_ack_nor_take_ids(
        harness: ServerHarness) -> None:
    async with grpc.aio.insecure_channel(harness.address) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        alice = Session(channel, ALICE, "alice")
        alice.send(submit=pb.SubmitJobs(jobs=[_job("a-gated", group="a-group", reward=1.0,
                                                   gate=["run"]),  # runs until opened
                                              _job("a-done")]))
        first = await alice.until(lambda f: _kind(f) == "trajectory" and f.job_id == "a-done")
        delivery = next(f.trajectory.delivery_id for f in first if _kind(f) == "trajectory")

        # Bob opens Alice's session: refused before anything is replayed to him.
        bob_as_alice = Session(channel, BOB, "alice")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await bob_as_alice.until(lambda f: True)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert _reason(info.value) == "CLIENT_ID_MISMATCH"

        # Read, cancel and list: the same answer whether the job exists or not.
        for job_id in ("a-gated", "a-done", "never-submitted"):
            for rpc, req in ((stub.GetJob, pb.GetJobRequest(job_id=job_id,
                                                            include_trajectory=True)),
                             (stub.CancelJob, pb.CancelJobRequest(job_id=job_id))):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await rpc(req, metadata=_md(BOB), timeout=5)
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, (rpc, job_id)
                assert _reason(info.value) == "JOB_NOT_ACCESSIBLE"
                assert "it does not exist, or another client" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CancelJob(pb.CancelJobRequest(group_id="a-group"), metadata=_md(BOB))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListJobs(pb.ListJobsRequest(client_id="alice"), metadata=_md(BOB))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert list((await stub.ListJobs(pb.ListJobsRequest(), metadata=_md(BOB))).jobs) == []

        # Bob's own session: cancel Alice's job, take her job id and her group, ack her ids.
        bob = Session(channel, BOB, "bob")
        bob.send(cancel=pb.CancelJobs(job_ids=["a-gated"], group_ids=["a-group"]))
        bob.send(submit=pb.SubmitJobs(jobs=[_job("a-done"), _job("b-1", group="a-group")]))
        bob.send(ack=pb.AckTrajectories(delivery_ids=[delivery]))
        rejected: list[pb.StreamRolloutsResponse] = []
        async for f in bob.call:
            assert _kind(f) not in ("trajectory", "finished"), f
            if _kind(f) == "rejected":
                rejected.append(f)
            if len(rejected) == 4:
                break
        bob.close()
        reasons = sorted(f.rejected.reason for f in rejected)
        assert reasons == ["GROUP_ID_TAKEN", "GROUP_NOT_ACCESSIBLE", "JOB_ID_TAKEN",
                           "JOB_NOT_ACCESSIBLE"]
        # A job id is owned by the client that first used it: taking it is ALREADY_EXISTS
        # (the id is visibly in use; nothing of the job is shown), the rest is not Bob's.
        assert all(f.rejected.code == (grpc.StatusCode.ALREADY_EXISTS.value[0]
                                       if f.rejected.reason == "JOB_ID_TAKEN"
                                       else grpc.StatusCode.PERMISSION_DENIED.value[0])
                   for f in rejected)
        # SubmitRollout with Alice's id: refused, and her trajectory is not streamed to Bob.
        call = stub.SubmitRollout(pb.SubmitRolloutRequest(job=_job("a-done")),
                                  metadata=_md(BOB), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for msg in call:
                assert msg.WhichOneof("kind") != "trajectory"
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert _reason(info.value) == "JOB_ID_TAKEN"

        # Alice's work is untouched: the gated job still runs and finishes for her, and the
        # delivery Bob "acked" is still unacknowledged for her (it replays on reconnect).
        got = await stub.GetJob(pb.GetJobRequest(job_id="a-gated"), metadata=_md(ALICE))
        assert got.job.state == job_pb2.Job.STATE_RUNNING
        harness.handler.open("a-gated", "run")
        await alice.until(lambda f: _kind(f) == "finished" and f.job_id == "a-gated")
        alice.close()
        again = Session(channel, ALICE, "alice")
        opened = await again.until(lambda f: _kind(f) == "opened")
        assert opened[0].opened.replaying == 2
        again.close()
        mine = await stub.ListJobs(pb.ListJobsRequest(), metadata=_md(ALICE))
        assert {j.job_id for j in mine.jobs} == {"a-gated", "a-done"}
        assert {j.state for j in mine.jobs} == {job_pb2.Job.STATE_SUCCEEDED}


async def test_operator_credentials_and_open_services(harness: ServerHarness) -> None:
    async with grpc.aio.insecure_channel(harness.address) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        alice = Session(channel, ALICE, "alice")
        alice.send(submit=pb.SubmitJobs(jobs=[_job("a-1")]))
        await alice.until(lambda f: _kind(f) == "finished")
        alice.close()
        # The old single token is an operator: any client id, any job (documented).
        got = await stub.GetJob(pb.GetJobRequest(job_id="a-1"), metadata=_md(LEGACY))
        assert got.job.client_id == "alice"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetJob(pb.GetJobRequest(job_id="nope"), metadata=_md(LEGACY))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        operator = Session(channel, LEGACY, "alice")
        assert _kind((await operator.until(lambda f: True))[0]) == "opened"
        operator.close()
        # The admin role is for BackendService; it does not open other tenants' jobs.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetJob(pb.GetJobRequest(job_id="a-1"), metadata=_md(OPS))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # No or a wrong credential: UNAUTHENTICATED; health and reflection stay open.
        for md in ((), _md("wrong-token-0123456789"), (("authorization", "Basic x"),)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ListJobs(pb.ListJobsRequest(), metadata=md)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel)
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == \
            health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = [r async for r in refl.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services="")]))]
        assert "rollout.v1.RolloutService" in str(answers[0])


async def test_reflection_can_be_switched_off(tmp_path: Path) -> None:
    h = ServerHarness(tmp_path / "state", reflection="false")
    await h.start()
    try:
        async with grpc.aio.insecure_channel(h.address) as channel:
            refl = reflection_pb2_grpc.ServerReflectionStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                _ = [r async for r in refl.ServerReflectionInfo(iter([
                    reflection_pb2.ServerReflectionRequest(list_services="")]))]
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await h.stop()


async def test_backend_service_needs_the_admin_role(tmp_path: Path) -> None:
    cfg = make_config(tmp_path / "state", clients=json.dumps(CLIENTS))
    registry = HandlerRegistry()
    registry.register("scripted", ScriptedHandler())
    pool = BackendPool()
    server = await Server(cfg, registry=registry, llm=pool, sandbox_factory=_no_sandbox).start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = backend_service_pb2_grpc.BackendServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ListBackends(backend_service_pb2.ListBackendsRequest(),
                                        metadata=_md(ALICE))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert _reason(info.value) == "ADMIN_REQUIRED"
            listed = await stub.ListBackends(backend_service_pb2.ListBackendsRequest(),
                                             metadata=_md(OPS))
            assert list(listed.backends) == []
    finally:
        await server.stop(0.1)
        await pool.close()


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Any]:
    ca = TestCA()
    (tmp_path / "ca.crt").write_bytes(ca.pem)
    server_cert, server_key = ca.issue("rollout-server", dns=("localhost",),
                                       ips=("127.0.0.1",), server=True).write(tmp_path, "server")
    return {"ca": ca, "ca_file": tmp_path / "ca.crt", "cert": server_cert, "key": server_key,
            "dir": tmp_path}


def _tls_channel(address: str, ca_pem: bytes, client: Any = None) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca_pem,
        private_key=client.key_pem if client else None,
        certificate_chain=client.cert_pem if client else None)
    return grpc.aio.secure_channel(address, creds)


async def test_tls_key_of_another_certificate_is_named_not_port_in_use(
        pki: dict[str, Any]) -> None:
    """gRPC reports a key that does not match its certificate as "Failed to bind" when the
    port is added; the server must name the key instead of blaming the port."""
    _, other_key = pki["ca"].issue("other", server=True).write(pki["dir"], "other")
    h = ServerHarness(pki["dir"] / "state", clients=json.dumps(CLIENTS),
                      tls_cert_file=pki["cert"], tls_key_file=other_key)
    with pytest.raises(InvalidArgument) as info:
        await h.start()
    assert info.value.reason == "BAD_CONFIG" and info.value.field == "server.tls_key_file"
    assert "not the private key" in str(info.value) and str(other_key) in str(info.value)
    swapped = ServerHarness(pki["dir"] / "state2", clients=json.dumps(CLIENTS),
                            tls_cert_file=pki["key"], tls_key_file=pki["cert"])
    with pytest.raises(InvalidArgument) as info:
        await swapped.start()
    assert info.value.reason == "BAD_CONFIG" and "PEM" in str(info.value)


async def test_tls_port_with_tokens(pki: dict[str, Any]) -> None:
    h = ServerHarness(pki["dir"] / "state", clients=json.dumps(CLIENTS),
                      tls_cert_file=pki["cert"], tls_key_file=pki["key"])
    await h.start()
    try:
        async with _tls_channel(h.address, pki["ca"].pem) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            listed = await stub.ListJobs(pb.ListJobsRequest(), metadata=_md(ALICE), timeout=10)
            assert list(listed.jobs) == []
        async with grpc.aio.insecure_channel(h.address) as plain:  # plaintext to a TLS port
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.RolloutServiceStub(plain).ListJobs(
                    pb.ListJobsRequest(), metadata=_md(ALICE), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await h.stop()


async def test_mtls_identity_is_the_client_id(pki: dict[str, Any]) -> None:
    clients = [{"client_id": "alice", "tls_identity": "alice.trainers.example"},
               {"client_id": "bob", "tls_identity": "bob-node-7"}]
    h = ServerHarness(pki["dir"] / "state", clients=json.dumps(clients),
                      tls_cert_file=pki["cert"], tls_key_file=pki["key"],
                      tls_client_ca_file=pki["ca_file"])
    await h.start()
    ca: TestCA = pki["ca"]
    try:
        # Identity in a DNS SAN (Alice) or in the CN (Bob).
        alice_cert = ca.issue("ignored-cn", dns=("alice.trainers.example",))
        bob_cert = ca.issue("bob-node-7")
        async with _tls_channel(h.address, ca.pem, alice_cert) as channel:
            alice = Session(channel, None, "alice")  # no token: the certificate is it
            alice.send(submit=pb.SubmitJobs(jobs=[_job("m-1")]))
            await alice.until(lambda f: _kind(f) == "finished")
            alice.close()
        async with _tls_channel(h.address, ca.pem, bob_cert) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetJob(pb.GetJobRequest(job_id="m-1"), timeout=5)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            call = stub.StreamRollouts(iter([pb.StreamRolloutsRequest(
                open=pb.OpenSession(client_id="alice"))]), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in call:
                    pass
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # Signed by the CA but mapped to no client: UNAUTHENTICATED, saying what to add.
        async with _tls_channel(h.address, ca.pem, ca.issue("stranger")) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.RolloutServiceStub(channel).ListJobs(pb.ListJobsRequest(),
                                                                   timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "tls_identity" in info.value.details()
        # No certificate, or one from another CA: the handshake itself fails.
        other = TestCA("another CA").issue("alice.trainers.example")
        for client in (None, other):
            async with _tls_channel(h.address, ca.pem, client) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await pb_grpc.RolloutServiceStub(channel).ListJobs(pb.ListJobsRequest(),
                                                                       timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # Health (docs/operating-limits.md): the handshake wants a certificate of the CA, so a
        # probe without one cannot connect; any certificate of the CA will do, mapped or not.
        check = health_pb2.HealthCheckRequest(service="")
        async with _tls_channel(h.address, ca.pem, None) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health_pb2_grpc.HealthStub(channel).Check(check, timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        async with _tls_channel(h.address, ca.pem, ca.issue("k8s-probe")) as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(check, timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await h.stop()


def test_bad_client_entries_are_refused_with_the_key_to_fix() -> None:
    from rollout.runtime.types import InvalidArgument
    from rollout.server.tenancy.auth import Authenticator

    for entry, words in (({"client_id": "a", "token": "short"}, "at least 16"),
                         ({"client_id": "a b", "token": "x" * 20}, "client_id"),
                         ({"client_id": "a", "roles": ["root"], "token": "x" * 20}, "roles"),
                         ({"client_id": "a"}, "token, token_sha256 or tls_identity"),
                         ({"client_id": "a", "tokn": "x" * 20}, "unknown keys")):
        with pytest.raises(InvalidArgument, match=words) as info:
            Authenticator("", [entry])
        assert "server.clients[0]" in str(info.value)


# ----------------------------------------------------- SubmitRollout jobs, reserved ids, status


async def _submit_rollout(stub: pb_grpc.RolloutServiceStub, token: str,
                          spec: job_pb2.JobSpec) -> list[pb.SubmitRolloutResponse]:
    return [f async for f in stub.SubmitRollout(pb.SubmitRolloutRequest(job=spec),
                                                metadata=_md(token), timeout=20)]


async def _list_all(stub: pb_grpc.RolloutServiceStub, token: str, **req: Any) -> list[Any]:
    """Every page, one job at a time (so pages stop between another tenant's jobs)."""
    jobs, page_token = [], ""
    for _ in range(100):
        page = await stub.ListJobs(pb.ListJobsRequest(page_size=1, page_token=page_token,
                                                      **req), metadata=_md(token))
        assert len(page.jobs) <= 1
        jobs += [(j.job_id, j.client_id) for j in page.jobs]
        if not (page_token := page.next_page_token):
            return jobs
    raise AssertionError("ListJobs never reached its last page")


async def test_submit_rollout_jobs_are_their_owners_in_list_get_and_cancel(
        harness: ServerHarness) -> None:
    """Jobs a bound client submits with SubmitRollout live on private rpc: channels; their
    owner lists, reads and cancels them as its own, and nobody else sees them."""
    async with grpc.aio.insecure_channel(harness.address) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        # In submission order: a-rpc-1 (Alice, SubmitRollout), b-1 (Bob, his session),
        # a-stream (Alice, her session), b-rpc (Bob, SubmitRollout), a-rpc-2 (Alice, gated).
        assert (await _submit_rollout(stub, ALICE, _job("a-rpc-1")))[-1].finished.state == \
            job_pb2.Job.STATE_SUCCEEDED
        bob = Session(channel, BOB, "bob")
        bob.send(submit=pb.SubmitJobs(jobs=[_job("b-1")]))
        await bob.until(lambda f: _kind(f) == "finished")
        bob.close()
        alice = Session(channel, ALICE, "alice")
        alice.send(submit=pb.SubmitJobs(jobs=[_job("a-stream")]))
        await alice.until(lambda f: _kind(f) == "finished")
        alice.close()
        await _submit_rollout(stub, BOB, _job("b-rpc"))
        gated = stub.SubmitRollout(pb.SubmitRolloutRequest(job=_job("a-rpc-2", gate=["run"])),
                                   metadata=_md(ALICE), timeout=20)
        assert (await gated.read()).WhichOneof("kind") == "accepted"

        assert await _list_all(stub, ALICE) == [("a-rpc-1", "alice"), ("a-stream", "alice"),
                                                ("a-rpc-2", "alice")]
        assert await _list_all(stub, BOB) == [("b-1", "bob"), ("b-rpc", "bob")]
        # The operator filtering by client id sees the same; unfiltered, every job, each
        # under its owner's client id.
        assert await _list_all(stub, LEGACY, client_id="alice") == \
            await _list_all(stub, ALICE)
        assert {j for j, _ in await _list_all(stub, LEGACY)} == {
            "a-rpc-1", "b-1", "a-stream", "b-rpc", "a-rpc-2"}
        got = await stub.GetJob(pb.GetJobRequest(job_id="a-rpc-1"), metadata=_md(ALICE))
        assert got.job.client_id == "alice"
        # Filters still apply (the stored state may lag the live one a moment: wait for it,
        # bounded and scaled, since a loaded machine commits it later).
        async def running_jobs() -> list[str]:
            running = await stub.ListJobs(pb.ListJobsRequest(
                state=job_pb2.Job.STATE_RUNNING), metadata=_md(ALICE))
            return [j.job_id for j in running.jobs]

        assert await assert_eventually(running_jobs) == ["a-rpc-2"]
        for job_id in ("a-rpc-1", "a-rpc-2"):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetJob(pb.GetJobRequest(job_id=job_id), metadata=_md(BOB))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CancelJob(pb.CancelJobRequest(job_id="a-rpc-2"), metadata=_md(BOB))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        cancelled = await stub.CancelJob(pb.CancelJobRequest(job_id="a-rpc-2"),
                                         metadata=_md(ALICE))
        assert list(cancelled.cancelled_job_ids) == ["a-rpc-2"]
        while (last := await gated.read()) is not grpc.aio.EOF:
            rest = last
        assert rest.finished.state == job_pb2.Job.STATE_CANCELLED


async def test_the_rpc_prefix_is_reserved(harness: ServerHarness) -> None:
    from rollout.runtime.types import InvalidArgument
    from rollout.server.tenancy.auth import Authenticator

    with pytest.raises(InvalidArgument, match="reserved") as refused:
        Authenticator("", [{"client_id": "rpc:alice", "token": "x" * 20}])
    assert refused.value.reason == "BAD_CONFIG" and "server.clients[0]" in str(refused.value)
    async with grpc.aio.insecure_channel(harness.address) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        # Even the operator, who may open any client id, cannot open a channel's name: it
        # would receive (and could acknowledge) a SubmitRollout caller's trajectory.
        for client_id in ("rpc:a-1", "rpc:alice"):
            session = Session(channel, LEGACY, client_id)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await session.until(lambda f: True)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert _reason(info.value) == "RESERVED_CLIENT_ID"
            assert "reserved" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListJobs(pb.ListJobsRequest(client_id="rpc:a-1"), metadata=_md(LEGACY))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _reason(info.value) == "RESERVED_CLIENT_ID"


async def test_server_status_shows_a_tenant_its_own_jobs_and_an_admin_all(
        harness: ServerHarness) -> None:
    async with grpc.aio.insecure_channel(harness.address) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        alice = Session(channel, ALICE, "alice")
        alice.send(submit=pb.SubmitJobs(jobs=[_job("a-1"), _job("a-2", fail="eval"),
                                              _job("a-held", gate=["run"])]))
        ended: set[str] = set()  # a-1 and a-2 run side by side: either may end first
        await alice.until(lambda f: _kind(f) == "finished" and (ended.add(f.job_id) or ended)
                          >= {"a-1", "a-2"})
        await _submit_rollout(stub, ALICE, _job("a-rpc"))
        await _submit_rollout(stub, BOB, _job("b-rpc"))
        await _submit_rollout(stub, BOB, _job("b-rpc-2"))
        await assert_eventually_running(stub, "a-held")

        async def status(token: str) -> pb.GetServerStatusResponse:
            return await stub.GetServerStatus(pb.GetServerStatusRequest(), metadata=_md(token))

        # Counted by hand from what each submitted above.
        mine = await status(ALICE)
        assert dict(mine.jobs_by_state) == {"SUCCEEDED": 2, "FAILED": 1, "RUNNING": 1}
        assert mine.sessions == 1  # her open session, not Bob's or anyone else's
        assert dict(mine.jobs_by_termination) == {} and list(mine.nodes) == []
        assert [s.stage for s in mine.stages] == [job_pb2.STAGE_INIT, job_pb2.STAGE_RUN,
                                                   job_pb2.STAGE_EVAL]
        bobs = await status(BOB)
        assert dict(bobs.jobs_by_state) == {"SUCCEEDED": 2} and bobs.sessions == 0
        for token in (OPS, LEGACY):  # the admin role and the operator: server-wide
            everyone = await status(token)
            assert dict(everyone.jobs_by_state) == {"SUCCEEDED": 4, "FAILED": 1, "RUNNING": 1}
            assert everyone.sessions == 1
            # Four clean runs; a-2's EVAL failure is counted as ERROR.
            assert dict(everyone.jobs_by_termination) == {"NO_TOOL_CALL": 4, "ERROR": 1}
        harness.handler.open("a-held", "run")
        await alice.until(lambda f: _kind(f) == "finished" and f.job_id == "a-held")
        alice.close()
        assert dict((await status(ALICE)).jobs_by_state) == {"SUCCEEDED": 3, "FAILED": 1}


async def assert_eventually_running(stub: pb_grpc.RolloutServiceStub, job_id: str) -> None:
    async def running() -> bool:
        got = await stub.GetJob(pb.GetJobRequest(job_id=job_id), metadata=_md(LEGACY))
        return got.job.state == job_pb2.Job.STATE_RUNNING

    await assert_eventually(running, message=f"{job_id} never ran")


async def test_a_tenants_pages_stay_full_between_another_tenants_many_jobs(
        harness: ServerHarness) -> None:
    """Bob's 150 jobs lie between each two of Alice's: her pages still hold as many jobs as
    she asked for (the store reads by owner), and the last one says it is the last."""
    bobs = 150
    async with grpc.aio.insecure_channel(harness.address) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        bob = Session(channel, BOB, "bob")

        async def bob_submits(tag: str) -> None:
            bob.send(submit=pb.SubmitJobs(jobs=[_job(f"b-{tag}-{i}") for i in range(bobs)]))
            done: set[str] = set()
            await bob.until(lambda f: _kind(f) == "finished" and f.job_id.startswith(f"b-{tag}")
                            and (done.add(f.job_id) or len(done) == bobs))

        alice = Session(channel, ALICE, "alice")
        await _submit_rollout(stub, ALICE, _job("a-1"))
        await bob_submits("x")
        alice.send(submit=pb.SubmitJobs(jobs=[_job("a-2"), _job("a-3")]))
        await alice.until(lambda f: _kind(f) == "finished" and f.job_id == "a-3")
        await bob_submits("y")
        await _submit_rollout(stub, ALICE, _job("a-4"))
        await bob_submits("z")
        bob.close()
        alice.close()

        async def pages(token: str, size: int, **req: Any) -> list[list[str]]:
            out, page_token = [], ""
            while True:
                page = await stub.ListJobs(pb.ListJobsRequest(
                    page_size=size, page_token=page_token, **req), metadata=_md(token))
                out.append([j.job_id for j in page.jobs])
                if not (page_token := page.next_page_token):
                    return out

        assert await pages(ALICE, 1) == [["a-1"], ["a-2"], ["a-3"], ["a-4"]]
        assert await pages(ALICE, 3) == [["a-1", "a-2", "a-3"], ["a-4"]]
        assert await pages(LEGACY, 2, client_id="alice") == [["a-1", "a-2"], ["a-3", "a-4"]]
        assert await pages(ALICE, 2, state=job_pb2.Job.STATE_SUCCEEDED) == [
            ["a-1", "a-2"], ["a-3", "a-4"]]
        listed = [j for p in await pages(BOB, 1000) for j in p]
        assert listed == [f"b-{t}-{i}" for t in "xyz" for i in range(bobs)]
