"""History rewrites start segments; oversize requests are refused; closing aborts turns."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollout.runtime.types import JobSpec, Limits, SamplingParams, SegmentReason, Trajectory
from rollout.server.gateway import Gateway
from rollout.server.gateway.messages import RequestLimits
from tests.server.gateway.conftest import Rig, openai_client
from tests.server.gateway.test_chat_completions import TASK, TOOLS, assistant_echo, call
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(60)

R1 = "Step one.\n" + call("bash", command="echo 1")
R2 = "Step two.\n" + call("bash", command="echo 2")
R3 = "All done."


async def test_a_harness_that_drops_an_earlier_message_gets_two_exact_segments(
        rig: Rig) -> None:
    lease = await rig.open("job-drop", [R1, R2, R3])
    client = openai_client(lease)
    a1 = (await client.chat.completions.create(model="m", messages=TASK, tools=TOOLS)
          ).choices[0].message
    h1 = [*TASK, assistant_echo(a1),
          {"role": "tool", "tool_call_id": a1.tool_calls[0].id, "content": "1"}]
    a2 = (await client.chat.completions.create(model="m", messages=h1, tools=TOOLS)
          ).choices[0].message
    # The harness compacts its context: it drops the first exchange and keeps the last one.
    h2 = [TASK[0], TASK[1], assistant_echo(a2),
          {"role": "tool", "tool_call_id": a2.tool_calls[0].id, "content": "2"}]
    a3 = (await client.chat.completions.create(model="m", messages=h2, tools=TOOLS)
          ).choices[0].message
    assert a3.content == R3
    capture = await rig.gateway.close(lease)
    assert [(s.first_turn, s.reason) for s in capture.segments] == [
        (0, SegmentReason.FIRST), (2, SegmentReason.HISTORY_REWRITTEN)]
    traj = Trajectory(job_id="d", turns=capture.turns, segments=capture.segments)
    first, second = traj.segment_turns()
    prompts = [list(r.prompt_ids) for r in rig.engine.requests]
    # Segment 1: one merged sequence whose model tokens are the scripted ids, exactly.
    seq1 = [i for t in first for i in t.prompt_ids + t.output_ids + t.observation_ids]
    assert seq1 == prompts[1] + first[1].output_ids
    assert [t.output_ids for t in first] == [rig.scripted_ids(R1), rig.scripted_ids(R2)]
    # Segment 2: a fresh render of the rewritten history (its earlier assistant message is
    # re-rendered text, mask 0), then the scripted reply's ids with mask 1.
    assert second[0].prompt_ids == prompts[2]
    assert second[0].output_ids == rig.scripted_ids(R3)
    assert second[0].loss_mask == [0] * len(prompts[2]) + [1] * len(rig.scripted_ids(R3))
    # The rewritten prompt is not an extension of segment 1 (why a new segment was needed).
    assert prompts[2][:len(seq1)] != seq1


async def test_a_retry_of_a_failed_request_reuses_its_prompt(rig: Rig) -> None:
    lease = await rig.open("job-retry", [R1, R2])
    client = openai_client(lease)
    a1 = (await client.chat.completions.create(model="m", messages=TASK, tools=TOOLS)
          ).choices[0].message
    history = [*TASK, assistant_echo(a1),
               {"role": "tool", "tool_call_id": a1.tool_calls[0].id, "content": "1"}]
    rig.engine.latency_s = 30.0
    task = asyncio.ensure_future(client.chat.completions.create(
        model="m", messages=history, tools=TOOLS))
    await assert_eventually(lambda: rig.engine.in_flight("job-retry"))
    await rig.engine.abort("job-retry")  # the backend aborts the turn: the client sees 503
    import openai

    with pytest.raises(openai.APIStatusError) as info:
        await task
    assert info.value.status_code == 503
    rig.engine.latency_s = 0.0
    rig.engine._turns["job-retry"] = 1  # the aborted attempt does not consume a script entry
    again = await client.chat.completions.create(model="m", messages=history, tools=TOOLS)
    assert "Step two." in again.choices[0].message.content
    capture = await rig.gateway.close(lease)
    assert len(capture.segments) == 1 and len(capture.turns) == 2
    assert list(rig.engine.requests[1].prompt_ids) == list(rig.engine.requests[2].prompt_ids)


async def test_oversize_requests_are_refused_with_openai_errors(rig: Rig, tmp_path) -> None:
    import openai

    small = await Gateway(tmp_path / "small", limits=RequestLimits(
        max_body_bytes=4096, max_messages=8, max_tools=2)).start()
    try:
        rig.scripts["job-big"] = ["ok"] * 4
        lease = await small.open(JobSpec("job-big", "harness", {}, sampling=SamplingParams(
            max_tokens_per_turn=5, total_token_budget=400)), rig.pool)
        client = openai_client(lease)
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x" * 5000}])
        assert info.value.status_code == 413 and info.value.body["code"] == "request_too_large"
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}] * 9)
        assert info.value.status_code == 413 and info.value.body["code"] == "too_many_messages"
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="m", messages=TASK, n=2)
        assert info.value.body["param"] == "n"
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="m", messages=TASK, temperature=7)
        assert info.value.body["param"] == "temperature"
        with pytest.raises(openai.BadRequestError) as info:  # over the job's token budget
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "word " * 600}])
        assert info.value.body["code"] == "context_length_exceeded"
        # max_tokens is clipped to the job's max_tokens_per_turn (5): "ok" + end fits,
        # and the backend was asked for 5 at most, not 1000.
        done = await client.chat.completions.create(model="m", messages=TASK, max_tokens=1000)
        assert done.choices[0].message.content == "ok"
        assert rig.engine.requests[-1].max_tokens == 5
        assert len(rig.engine.requests) == 1  # nothing refused reached the model
    finally:
        await small.stop()


async def test_the_jobs_response_budget_clips_then_refuses(rig: Rig) -> None:
    import openai

    first = rig.scripted_ids("the first answer")
    lease = await rig.open("job-response", ["the first answer", "a second answer runs long"],
                           sampling=SamplingParams(seed=7, max_response_tokens=len(first) + 2))
    client = openai_client(lease)
    await client.chat.completions.create(model="m", messages=TASK)
    await client.chat.completions.create(
        model="m", messages=[*TASK, {"role": "assistant", "content": "the first answer"},
                             {"role": "user", "content": "go on"}])
    # The prompt does not count; the second turn gets what the first left.
    assert [r.max_tokens for r in rig.engine.requests] == [len(first) + 2, 2]
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model="m", messages=[*TASK, {"role": "user", "content": "and again"}])
    assert info.value.body["code"] == "context_length_exceeded"
    assert "max_response_tokens" in info.value.body["message"]
    capture = await rig.gateway.close(lease)
    assert capture.refused == "token_budget"
    assert sum(len(t.output_ids) for t in capture.turns) == len(first) + 2
    assert len(rig.engine.requests) == 2


async def test_the_jobs_request_limit_is_max_turns(rig: Rig) -> None:
    import openai

    lease = await rig.open("job-turns", ["a", "b", "c"], limits=Limits(max_turns=2))
    client = openai_client(lease)
    # Distinct requests (an identical one would be a retry, answered again without a turn).
    for n in range(2):
        await client.chat.completions.create(
            model="m", messages=[*TASK, {"role": "user", "content": f"try {n}"}])
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model="m", messages=[*TASK, {"role": "user", "content": "try 2"}])
    assert info.value.body["code"] == "max_turns"


async def test_closing_the_lease_aborts_the_in_flight_generation(rig: Rig) -> None:
    lease = await rig.open("job-cancel", ["slow answer"])
    rig.engine.latency_s = 60.0
    client = openai_client(lease)
    task: asyncio.Task[Any] = asyncio.ensure_future(
        client.chat.completions.create(model="m", messages=TASK))
    await assert_eventually(lambda: rig.engine.in_flight("job-cancel"))
    capture = await asyncio.wait_for(rig.gateway.close(lease), 10)
    await assert_eventually(lambda: not rig.engine.in_flight("job-cancel"))
    assert capture.turns == []
    with pytest.raises(Exception):  # noqa: B017 - the connection is cut, whatever the error
        await asyncio.wait_for(task, 10)


async def test_release_job_closes_a_lease_its_handler_left_open(rig: Rig) -> None:
    import openai

    lease = await rig.open("job-left", ["x"])
    await rig.gateway.release_job("job-left")
    with pytest.raises((openai.APIConnectionError, openai.AuthenticationError)):
        await openai_client(lease).chat.completions.create(model="m", messages=TASK)


async def test_tcp_listener_takes_every_open_key_and_nothing_else(rig: Rig, tmp_path) -> None:
    import openai

    gw = await Gateway(tmp_path / "tcp", tcp_port=0).start()
    try:
        rig.scripts["job-tcp"] = ["over tcp"]
        lease = await gw.open(JobSpec("job-tcp", "harness", {}), rig.pool)
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=lease.api_key, max_retries=0)
        out = await client.chat.completions.create(model="m", messages=TASK)
        assert out.choices[0].message.content == "over tcp"
        bad = openai.AsyncOpenAI(base_url=gw.base_url, api_key="rk-nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model="m", messages=TASK)
        await gw.close(lease)
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="m", messages=TASK)
    finally:
        await gw.stop()


async def test_socket_files_are_private(rig: Rig) -> None:
    import os
    import stat

    lease = await rig.open("job-perm", ["x"])
    assert stat.S_IMODE(os.stat(lease.socket_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(lease.socket_path)).st_mode) == 0o700


async def test_a_job_cannot_pile_up_requests(rig: Rig, tmp_path) -> None:
    import openai

    gw = await Gateway(tmp_path / "pending", limits=RequestLimits(max_pending=2)).start()
    try:
        rig.scripts["job-pile"] = ["a", "b", "c"]
        rig.engine.latency_s = 60.0
        lease = await gw.open(JobSpec("job-pile", "harness", {}), rig.pool)
        client = openai_client(lease)
        held = [asyncio.ensure_future(client.chat.completions.create(model="m", messages=TASK))
                for _ in range(2)]
        await assert_eventually(lambda: rig.engine.in_flight("job-pile"))
        await asyncio.sleep(0.2)  # the second one waits behind the first, inside the gateway
        with pytest.raises(openai.RateLimitError) as info:
            await client.chat.completions.create(model="m", messages=TASK)
        assert info.value.body["code"] == "too_many_requests"
        await gw.close(lease)
        for task in held:
            with pytest.raises(Exception):  # noqa: B017 - cut by the close
                await asyncio.wait_for(task, 10)
    finally:
        await gw.stop()


async def test_a_turn_cut_by_the_close_leaves_the_sequence_ending_on_model_tokens(
        rig: Rig) -> None:
    lease = await rig.open("job-cut", [R1, R2])
    client = openai_client(lease)
    a1 = (await client.chat.completions.create(model="m", messages=TASK, tools=TOOLS)
          ).choices[0].message
    rig.engine.latency_s = 60.0
    history = [*TASK, assistant_echo(a1),
               {"role": "tool", "tool_call_id": a1.tool_calls[0].id, "content": "1"}]
    task = asyncio.ensure_future(client.chat.completions.create(
        model="m", messages=history, tools=TOOLS))
    await assert_eventually(lambda: rig.engine.in_flight("job-cut"))
    capture = await rig.gateway.close(lease)
    assert len(capture.turns) == 1
    # The observation was appended for a turn that never came: not part of the sequence.
    assert capture.turns[0].observation_ids == []
    assert Trajectory(job_id="c", turns=capture.turns).token_ids == [
        *rig.engine.requests[0].prompt_ids, *rig.scripted_ids(R1)]
    with pytest.raises(Exception):  # noqa: B017 - the connection is cut, whatever the error
        await asyncio.wait_for(task, 10)
