"""Typed tasks (JobSpec.math / code / swe): every shipped task, written as its typed message,
becomes exactly the JSON object the environment documents; the environments accept them; and
through a real server a typed task is validated like a Struct task and stored as one."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from rollout.runtime.envs.code.handler import CodeHandler
from rollout.runtime.envs.math.handler import MathHandler
from rollout.runtime.envs.swe.handler import SweHandler
from rollout.runtime.types import InvalidArgument
from rollout.server.api import proto_convert, typed_tasks
from rollout.v1 import job_pb2, tasks_pb2
from rollout.v1 import rollout_service_pb2 as pb
from rollout.v1 import rollout_service_pb2_grpc as pb_grpc
from tests.client.conftest import ServerHarness

pytestmark = pytest.mark.timeout(60)
DATA = Path(__file__).resolve().parents[2] / "runtime" / "envs" / "data"


def shipped(env: str) -> list[dict[str, Any]]:
    return [json.loads(line)["task"] for line in (DATA / f"{env}.jsonl").read_text().splitlines()
            if line.strip()]


def as_typed(env: str, task: dict[str, Any]) -> Any:
    """The typed message a client would write for ``task`` (names and enums by hand)."""
    t = dict(task)
    if env == "code":
        if "mode" in t:
            t["mode"] = "MODE_" + t["mode"].upper()
        if "reward_mode" in t:
            t["reward_mode"] = "REWARD_MODE_" + t["reward_mode"].upper()
        return json_format.ParseDict(t, tasks_pb2.CodeTask())
    if env == "swe":
        t["fail_to_pass"] = t.pop("FAIL_TO_PASS")
        t["pass_to_pass"] = t.pop("PASS_TO_PASS")
        return json_format.ParseDict(t, tasks_pb2.SweTask())
    return json_format.ParseDict(t, tasks_pb2.MathTask())


HANDLERS: dict[str, Any] = {"math": MathHandler, "code": CodeHandler, "swe": SweHandler}


@pytest.mark.parametrize("env", ["math", "code", "swe"])
def test_every_shipped_task_round_trips_through_its_typed_message(env: str) -> None:
    tasks = shipped(env)
    assert tasks
    handler = HANDLERS[env]()
    for task in tasks:
        spec = job_pb2.JobSpec(job_id="t", **{env: as_typed(env, task)})
        got = proto_convert.spec_from_proto(spec)
        assert got.environment == env
        assert got.task == task, task.get("id") or task.get("instance_id")
        handler.validate_task(got.task)


def test_optional_fields_are_left_out_and_presence_is_kept() -> None:
    bare = proto_convert.spec_from_proto(job_pb2.JobSpec(
        job_id="m", math=tasks_pb2.MathTask(question="1+1?", answer="2")))
    assert bare.task == {"question": "1+1?", "answer": "2"}  # the environment's defaults apply
    full = proto_convert.spec_from_proto(job_pb2.JobSpec(job_id="m", math=tasks_pb2.MathTask(
        question="q", answer="0", no_tools=True, rel_tol=0.0)))
    assert full.task == {"question": "q", "answer": "0", "tools": [], "rel_tol": 0.0}
    fn = proto_convert.spec_from_proto(job_pb2.JobSpec(job_id="c", code=tasks_pb2.CodeTask(
        prompt="p", mode=tasks_pb2.CodeTask.MODE_FUNCTION, entry_point="f",
        tests=[tasks_pb2.CodeTest(code="assert f() == 1", input="ignored")],
        memory_limit_mb=64)))
    assert fn.task == {"prompt": "p", "mode": "function", "entry_point": "f",
                       "tests": [{"code": "assert f() == 1"}], "memory_limit_mb": 64}


def test_bad_combinations_are_refused_with_the_field_to_fix() -> None:
    math = tasks_pb2.MathTask(question="q", answer="a")
    cases = [
        (job_pb2.JobSpec(job_id="x", environment="code", math=math), "environment"),
        (job_pb2.JobSpec(job_id="x", math=math, task={"question": "q"}), "task"),
        (job_pb2.JobSpec(job_id="x", math=tasks_pb2.MathTask(
            question="q", answer="a", tools=["bash"], no_tools=True)), "math.tools"),
        (job_pb2.JobSpec(job_id="x", code=tasks_pb2.CodeTask(prompt="p", mode=7)), "code.mode"),
    ]
    for spec, field in cases:
        with pytest.raises(InvalidArgument) as info:
            proto_convert.spec_from_proto(spec)
        assert info.value.field == field
    # an environment's refusal names the typed field to fix
    refused = InvalidArgument("needs a test", "INVALID_TASK", "task.FAIL_TO_PASS")
    assert typed_tasks.error_for("swe", refused).field == "swe.fail_to_pass"  # type: ignore[attr-defined]
    assert typed_tasks.error_for(None, refused) is refused


IMAGE = "docker://swebench/sweb.eval.x86_64.acme_1776_calc-8:latest"


def image_instance(**change: Any) -> tasks_pb2.SweTask:
    fields: dict[str, Any] = dict(
        instance_id="acme__calc-8", repo="acme/calc", version="0.1", base_commit="abc1234",
        problem_statement="add() subtracts.", test_patch="diff --git a/t b/t\n",
        fail_to_pass=["tests/test_calc.py::test_add"], image=IMAGE,
        spec=tasks_pb2.SweEnvSpec(test_cmd="pytest -rA", log_parser="parse_log_pytest",
                                  eval_commands=["export X=1"], install="pip install -e ."))
    fields.update(change)
    return tasks_pb2.SweTask(**fields)


def test_a_typed_swe_task_can_name_its_image() -> None:
    got = proto_convert.spec_from_proto(job_pb2.JobSpec(job_id="i", swe=image_instance()))
    # Exactly the JSON image instance the environment documents: no repo_source, the image
    # and the harness's entry in spec.
    assert got.task == {
        "instance_id": "acme__calc-8", "repo": "acme/calc", "version": "0.1",
        "base_commit": "abc1234", "problem_statement": "add() subtracts.",
        "test_patch": "diff --git a/t b/t\n", "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
        "PASS_TO_PASS": [],
        "spec": {"image": IMAGE, "test_cmd": "pytest -rA", "log_parser": "parse_log_pytest",
                 "eval_commands": ["export X=1"], "install": "pip install -e ."}}
    SweHandler().validate_task(got.task)
    bare = proto_convert.spec_from_proto(job_pb2.JobSpec(job_id="i", swe=image_instance(
        spec=None)))
    assert bare.task["spec"] == {"image": IMAGE}
    SweHandler().validate_task(bare.task)


@pytest.mark.parametrize(("change", "field"), [
    ({"repo_source": "swe_repos/calc.bundle"}, "swe.image"),
    ({"image": "docker://"}, "swe.image"),
    ({"spec": tasks_pb2.SweEnvSpec(python="3.11")}, "swe.spec"),
    ({"spec": tasks_pb2.SweEnvSpec(test_cmd="pytest", log_parser="pytest")},
     "swe.spec.log_parser"),
])
def test_a_typed_image_instance_is_refused_naming_the_typed_field(change: dict[str, Any],
                                                                  field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        got = proto_convert.spec_from_proto(job_pb2.JobSpec(job_id="i",
                                                            swe=image_instance(**change)))
        try:
            SweHandler().validate_task(got.task)
        except InvalidArgument as e:
            raise typed_tasks.error_for("swe", e) from None
    assert info.value.field == field, str(info.value)


@pytest.fixture
async def stub(tmp_path: Path) -> AsyncIterator[pb_grpc.RolloutServiceStub]:
    h = ServerHarness(tmp_path / "state")
    h.registry.register("math", MathHandler())
    await h.start()
    async with grpc.aio.insecure_channel(h.address) as ch:
        yield pb_grpc.RolloutServiceStub(ch)
    await h.stop()


async def test_typed_task_through_a_real_server(stub: pb_grpc.RolloutServiceStub) -> None:
    good = job_pb2.JobSpec(job_id="typed-1", math=tasks_pb2.MathTask(
        id="m1", question="What is 6*7?", answer="42", no_tools=True))
    bad = job_pb2.JobSpec(job_id="typed-2", math=tasks_pb2.MathTask(question="no answer"))
    frames = [pb.StreamRolloutsRequest(open=pb.OpenSession(client_id="typed")),
              pb.StreamRolloutsRequest(submit=pb.SubmitJobs(jobs=[good, bad]))]
    call = stub.StreamRollouts(iter(frames))
    answers = {}
    async for f in call:
        if f.WhichOneof("kind") in ("accepted", "rejected"):
            answers[f.job_id] = f
        if len(answers) == 2:
            break
    call.cancel()
    assert answers["typed-1"].WhichOneof("kind") == "accepted"
    rej = answers["typed-2"].rejected
    # the environment's own validation, as for a Struct task
    assert (rej.code, rej.reason, rej.field) == (
        grpc.StatusCode.INVALID_ARGUMENT.value[0], "INVALID_TASK", "math.answer")
    got = await stub.GetJob(pb.GetJobRequest(job_id="typed-1"))
    assert got.job.spec.environment == "math"
    assert json_format.MessageToDict(got.job.spec.task) == {
        "id": "m1", "question": "What is 6*7?", "answer": "42", "tools": []}
    assert got.job.spec.WhichOneof("typed_task") is None
