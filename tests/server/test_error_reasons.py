"""ErrorReason (proto/rollout/v1/error_reason.proto) documents every reason the server sends,
and one check answers with one reason in every RPC."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_status import rpc_status

from rollout.v1 import error_reason_pb2, job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from rollout.v1 import rollout_service_pb2_grpc as pb_grpc
from tests.client.conftest import ServerHarness

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]
PREFIX = "ERROR_REASON_"
DOCUMENTED = {n[len(PREFIX):] for n in error_reason_pb2.ErrorReason.keys()
              if n != "ERROR_REASON_UNSPECIFIED"}
NOT_REASONS = {
    # environment variables, sysconf names, capabilities, constants and SWE-bench fields that
    # the source spells in UPPER_SNAKE too
    "CAP_SETGID", "CAP_SETUID", "DEFAULT_TOOLS", "FAIL_TO_PASS", "PASS_TO_PASS", "LC_ALL",
    "GIT_CONFIG_GLOBAL", "GIT_CONFIG_NOSYSTEM", "GIT_PAGER", "GIT_TERMINAL_PROMPT",
    "PROMPT_COMMAND", "PYTEST_DISABLE_PLUGIN_AUTOLOAD", "SC_CLK_TCK", "SC_PAGE_SIZE",
    "SC_PHYS_PAGES", "STATE_DIR", "VIRTUAL_ENV", "VLLM_SERVER_DEV_MODE", "SEGMENTS_KEY",
    # what a harness's sandbox is given to reach the model gateway
    "OPENAI_BASE_URL", "OPENAI_API_BASE", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL",
    "ANTHROPIC_API_KEY", "NO_PROXY", "XDG_CACHE_HOME",
    # what an image sandbox's uid keeps, and where skopeo's registries.conf is named
    "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_CHOWN", "CONTAINERS_REGISTRIES_CONF",
    # git configuration through the environment, the SWE-bench harness's resolution values,
    # and the variable Harbor's verifiers read
    "GIT_CONFIG_COUNT", "GIT_CONFIG_KEY_0", "GIT_CONFIG_VALUE_0", "RESOLVED_FULL",
    "RESOLVED_NO", "TEST_DIR",
    # the generic defaults of server/api/errors.py's classes, always overridden where raised
    "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED",
    "PERMISSION_DENIED", "ALREADY_EXISTS", "INVALID_ID",
    # bytecode opcode names the SymPy recorder's trace hook reads a test's return by
    "RETURN_VALUE", "RETURN_CONST",
    # the proxy variables a confined Dockerfile build hands its RUN steps
    "HTTP_PROXY", "HTTPS_PROXY",
    # the site module's attributes the isolated runner start reads
    "USER_SITE", "ENABLE_USER_SITE",
}
STRING = re.compile(r'"([A-Z][A-Z0-9]+(?:_[A-Z0-9]+)+)"')


def test_every_reason_in_the_source_is_documented() -> None:
    found: dict[str, str] = {}
    for folder in ("server", "runtime"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in STRING.findall(path.read_text()):
                if not name.startswith(("ROLLOUT_", "RAY_", "PIP_")):  # environment variables
                    found.setdefault(name, str(path.relative_to(ROOT)))
    missing = {n: where for n, where in found.items()
               if n not in DOCUMENTED and n not in NOT_REASONS}
    assert not missing, f"add these reasons to ErrorReason: {missing}"
    # stage timeouts are built as f"{stage.name}_TIMEOUT"
    assert {"INIT_TIMEOUT", "RUN_TIMEOUT", "EVAL_TIMEOUT"} <= DOCUMENTED


@pytest.fixture
async def stub(tmp_path: Path) -> AsyncIterator[pb_grpc.RolloutServiceStub]:
    h = ServerHarness(tmp_path / "state")
    await h.start()
    async with grpc.aio.insecure_channel(h.address) as ch:
        yield pb_grpc.RolloutServiceStub(ch)
    await h.stop()


def _reason(err: grpc.aio.AioRpcError) -> str:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    from google.rpc import error_details_pb2

    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert info.domain == "rollout.v1"
    return str(info.reason)


async def _unary_reason(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value.code(), _reason(info.value)


async def test_one_check_one_reason_in_every_rpc(stub: pb_grpc.RolloutServiceStub) -> None:
    bad = "bad id!"
    bad_job = (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_JOB_ID")
    bad_group = (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_GROUP_ID")
    assert await _unary_reason(stub.GetJob(pb.GetJobRequest(job_id=bad))) == bad_job
    assert await _unary_reason(stub.CancelJob(pb.CancelJobRequest(job_id=bad))) == bad_job
    assert await _unary_reason(stub.CancelJob(pb.CancelJobRequest(group_id=bad))) == bad_group
    assert await _unary_reason(stub.ListJobs(pb.ListJobsRequest(group_id=bad))) == bad_group
    assert await _unary_reason(stub.ListJobs(pb.ListJobsRequest(client_id=bad))) == (
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_CLIENT_ID")
    assert await _unary_reason(stub.ListJobs(pb.ListJobsRequest(page_size=-1))) == (
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_PAGE_SIZE")
    spec = job_pb2.JobSpec(job_id=bad, environment="scripted")
    spec.task.update({"reward": 1.0})
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.SubmitRollout(pb.SubmitRolloutRequest(job=spec)):
            pass
    assert (info.value.code(), _reason(info.value)) == bad_job

    # the same checks inside the stream answer with the same reasons
    grouped = job_pb2.JobSpec(job_id="ok-1", environment="scripted",
                              group=job_pb2.GroupSpec(group_id=bad))
    grouped.task.update({"reward": 1.0})
    frames = [pb.StreamRolloutsRequest(open=pb.OpenSession(client_id="reasons")),
              pb.StreamRolloutsRequest(submit=pb.SubmitJobs(jobs=[spec, grouped])),
              pb.StreamRolloutsRequest(cancel=pb.CancelJobs(job_ids=[bad], group_ids=[bad]))]
    call = stub.StreamRollouts(iter(frames))
    rejected = []
    async for f in call:
        if f.WhichOneof("kind") == "rejected":
            rejected.append((f.rejected.code, f.rejected.reason))
        if len(rejected) == 4:
            break
    call.cancel()
    codes = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert sorted(rejected) == sorted([(codes, "INVALID_JOB_ID"), (codes, "INVALID_GROUP_ID"),
                                       (codes, "INVALID_JOB_ID"), (codes, "INVALID_GROUP_ID")])
    assert {r for _, r in rejected} <= DOCUMENTED
