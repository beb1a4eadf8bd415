"""``limits.tool_timeout``: one tool call never outlives the job's cap, whatever timeout the
model asks for (the quickstart's slow job once spent three calls at the 60 s default)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from rollout.runtime.sandbox import Sandbox
from rollout.runtime.tools import make_tools
from rollout.runtime.types import InvalidArgument, Limits
from rollout.server.api.proto_convert import limits_from_proto, limits_to_proto
from rollout.v1 import job_pb2
from tests.runtime.sandbox_helpers import temp_sandbox

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def sb() -> AsyncIterator[Sandbox]:
    async with temp_sandbox("tt") as sandbox:
        yield sandbox


async def test_a_call_asking_for_longer_is_cut_at_the_cap(sb: Sandbox) -> None:
    bash, python = make_tools(sb, ["bash", "python"], tool_timeout_s=1.0)
    t0 = time.monotonic()
    res = await bash({"command": "sleep 30; echo never", "timeout": 3600})
    assert "timed out after 1 s" in res.output and "never" not in res.output
    cell = await python({"code": "import time; time.sleep(30); print('ne' + 'ver')",
                         "timeout": 3600})
    assert "timed out after 1 s" in cell.output and "\nnever" not in cell.output
    # Far below the 30 s the commands wanted, however loaded the machine is.
    assert time.monotonic() - t0 < 29


async def test_without_a_cap_the_model_may_ask_for_more_than_the_default(sb: Sandbox) -> None:
    (bash,) = make_tools(sb, ["bash"], bash_timeout=0.5)
    res = await bash({"command": "sleep 1.5; echo done", "timeout": 20})
    assert res.output.strip().endswith("done")


def test_the_limit_travels_through_the_proto() -> None:
    got = limits_from_proto(job_pb2.Limits(tool_timeout={"seconds": 7}))
    assert got.tool_timeout_s == 7.0
    assert limits_from_proto(job_pb2.Limits()).tool_timeout_s == Limits().tool_timeout_s == 60
    assert limits_to_proto(got).tool_timeout.seconds == 7
    with pytest.raises(InvalidArgument, match="tool_timeout"):
        limits_from_proto(job_pb2.Limits(tool_timeout={"seconds": -1}))
