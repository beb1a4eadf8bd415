"""Malformed requests, oversized messages and auth: the right status code and ErrorInfo
reason, on the unary RPC and as `rejected` frames on the stream; nothing accepted is lost."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout.client.aio import RolloutClient
from rollout.client.errors import RolloutError
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from tests.client.conftest import ServerHarness, task
from tests.client.test_stream import drain, kinds

pytestmark = pytest.mark.timeout(30)

# (spec, code, reason, field)
MALFORMED: list[tuple[dict[str, Any], str, str, str]] = [
    ({"job_id": "m-env", "task": {"a": 1}}, "INVALID_ARGUMENT", "MISSING_FIELD", "environment"),
    ({"job_id": "m-task", "environment": "scripted"}, "INVALID_ARGUMENT", "MISSING_FIELD",
     "task"),
    ({"job_id": "m-unknown", "environment": "nope", "task": {}}, "NOT_FOUND",
     "UNKNOWN_ENVIRONMENT", "environment"),
    ({"job_id": "m-temp", **task(), "sampling": {"temperature": 20}}, "INVALID_ARGUMENT",
     "INVALID_SAMPLING_PARAMS", "sampling.temperature"),
    ({"job_id": "m-topp", **task(), "sampling": {"top_p": 0}}, "INVALID_ARGUMENT",
     "INVALID_SAMPLING_PARAMS", "sampling.top_p"),
    ({"job_id": "m-maxtok", **task(), "sampling": {"max_tokens_per_turn": 0}},
     "INVALID_ARGUMENT", "INVALID_SAMPLING_PARAMS", "sampling.max_tokens_per_turn"),
    ({"job_id": "bad id!", **task()}, "INVALID_ARGUMENT", "INVALID_JOB_ID", "job_id"),
    ({**task()}, "INVALID_ARGUMENT", "MISSING_FIELD", "job_id"),
    ({"job_id": "m-big", "environment": "scripted", "task": {"blob": "x" * (1 << 20)}},
     "INVALID_ARGUMENT", "TASK_TOO_LARGE", "task"),
    ({"job_id": "m-turns", **task(), "limits": {"max_turns": 0}}, "INVALID_ARGUMENT",
     "INVALID_LIMITS", "limits.max_turns"),
    ({"job_id": "m-task-bad", **task(bad=True)}, "INVALID_ARGUMENT", "INVALID_TASK",
     "task.bad"),
]


@pytest.mark.parametrize(("spec", "code", "reason", "field"), MALFORMED,
                         ids=[m[2] + ":" + m[3] for m in MALFORMED])
async def test_unary_submit_rejects_with_reason(harness: ServerHarness, spec, code, reason,
                                                field) -> None:
    async with RolloutClient(harness.address) as client:
        with pytest.raises(RolloutError) as exc:
            async for _ in client.submit_rollout(spec):
                pass
        err = exc.value
        assert (err.code.name, err.reason, err.field) == (code, reason, field)
        if code == "INVALID_ARGUMENT":
            assert [f for f, _ in err.violations] == [field]
        # the server is fine afterwards
        frames = [f async for f in client.submit_rollout({"job_id": "ok-" + reason, **task()})]
        assert frames[-1].finished.state == job_pb2.Job.STATE_SUCCEEDED


async def test_stream_rejects_each_bad_job_and_keeps_going(harness: ServerHarness) -> None:
    async with RolloutClient(harness.address) as client, \
            client.session("bad", heartbeat_s=0.1) as s:
        await s.submit({"job_id": "before", **task(gate=["run"])})
        for spec, *_ in MALFORMED:
            await s.submit(spec)
        await s.submit([{"job_id": "after", **task()}, MALFORMED[0][0]])  # mixed batch
        harness.handler.open("before", "run")
        await s.close()
        frames = await drain(s)
    rejected = [(f.job_id, f.rejected) for f in kinds(frames, "rejected")]
    expected = [(str(spec.get("job_id", "")), code, reason, field)
                for spec, code, reason, field in MALFORMED]
    expected.append(expected[0])
    got = [(j, grpc.StatusCode(_code(r.code)).name, r.reason, r.field) for j, r in rejected]
    assert sorted(got) == sorted(expected)
    finished = {f.job_id: f.finished.state for f in kinds(frames, "finished")}
    assert finished == {"before": job_pb2.Job.STATE_SUCCEEDED,
                        "after": job_pb2.Job.STATE_SUCCEEDED}


def _code(value: int) -> tuple[int, str]:
    return next(c.value for c in grpc.StatusCode if c.value[0] == value)


async def test_bad_enum_and_page_values(harness: ServerHarness) -> None:
    async with RolloutClient(harness.address) as client:
        with pytest.raises(RolloutError) as err:
            async for _ in client.list_jobs(state=99):
                pass
        assert (err.value.code.name, err.value.reason, err.value.field) == (
            "INVALID_ARGUMENT", "INVALID_ENUM_VALUE", "state")
        with pytest.raises(RolloutError) as err:
            async for _ in client.list_jobs(page_size=-1):
                pass
        assert (err.value.code.name, err.value.field) == ("INVALID_ARGUMENT", "page_size")
        with pytest.raises(RolloutError) as err:  # neither target set (raw request)
            await client._unary(client.stub.CancelJob, pb.CancelJobRequest())
        assert (err.value.code.name, err.value.reason) == ("INVALID_ARGUMENT", "MISSING_FIELD")
        with pytest.raises(RolloutError) as err:
            await client.get_job("")
        assert err.value.reason == "MISSING_FIELD"
        with pytest.raises(ValueError):  # caught client-side
            await client.cancel()


async def test_bad_open_is_not_retried(harness: ServerHarness) -> None:
    async with RolloutClient(harness.address) as client:
        session = client.session("bad client id!")
        with pytest.raises(RolloutError) as exc:
            await session.start()
        assert (exc.value.code.name, exc.value.reason) == ("INVALID_ARGUMENT",
                                                           "INVALID_CLIENT_ID")
        assert session.reconnects == 0
        await session.aclose()


async def test_oversized_message(make_harness) -> None:
    h: ServerHarness = make_harness(max_message_bytes=64 << 10)
    await h.start()
    big = {"job_id": "huge", "environment": "scripted", "task": {"blob": "x" * (100 << 10)}}
    async with RolloutClient(h.address) as client:
        with pytest.raises(RolloutError) as exc:
            async for _ in client.submit_rollout(big):
                pass
        assert exc.value.code.name == "RESOURCE_EXHAUSTED"
        # on the stream: the oversized frame ends the stream (not retried), and the job
        # accepted before it still completes and is delivered to the next session
        async with client.session("big", heartbeat_s=0.1) as s:
            await s.submit({"job_id": "kept", **task(gate=["run"])})
            first = await anext(s.events())
            assert first.WhichOneof("kind") == "opened"
            acc = await anext(s.events())
            assert acc.WhichOneof("kind") == "accepted" and acc.job_id == "kept"
            await s.submit(big)
            with pytest.raises(RolloutError) as exc:
                async for _ in s.events():
                    pass
            assert exc.value.code.name == "RESOURCE_EXHAUSTED"
            assert s.reconnects == 0
        h.handler.open("kept", "run")
        async with client.session("big", auto_ack=True, heartbeat_s=0.1) as s:
            await s.close()
            frames = await drain(s, ack=False)
        assert [f.job_id for f in kinds(frames, "trajectory")] == ["kept"]
    # the client's own limit: refused before sending
    async with RolloutClient(h.address, max_message_bytes=32 << 10) as small:
        with pytest.raises(RolloutError) as exc:
            async for _ in small.submit_rollout(big):
                pass
        assert exc.value.code.name == "RESOURCE_EXHAUSTED"


async def test_auth(make_harness) -> None:
    h: ServerHarness = make_harness(auth_token="s3cret")
    await h.start()
    async with RolloutClient(h.address) as anon:
        with pytest.raises(RolloutError) as exc:
            await anon.status()
        assert (exc.value.code.name, exc.value.reason) == ("UNAUTHENTICATED", "MISSING_TOKEN")
        with pytest.raises(RolloutError) as exc:
            await anon.session("anon").start()
        assert exc.value.code.name == "UNAUTHENTICATED"
        health = health_pb2_grpc.HealthStub(anon._channel)
        resp = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    async with RolloutClient(h.address, token="wrong") as bad:
        with pytest.raises(RolloutError) as exc:
            await bad.status()
        assert exc.value.reason == "BAD_TOKEN"
    async with RolloutClient(h.address, token="s3cret") as good:
        assert "scripted" in (await good.status()).environments
        async with good.session("authed", auto_ack=True, heartbeat_s=0.1) as s:
            await s.submit({"job_id": "a1", **task()})
            await s.close()
            frames = await drain(s, ack=False)
        assert [f.job_id for f in kinds(frames, "trajectory")] == ["a1"]


def test_client_channel_options_match_the_server() -> None:
    """The client keeps its own copy (it may not import the server); keepalive settings that
    drift apart make the server answer GOAWAY too_many_pings."""
    from rollout.client.aio import channel_options as client_options
    from rollout.server.app import channel_options as server_options

    assert client_options(1 << 20) == server_options(1 << 20)
