"""Parallel calls of one job overlap; a client that goes away cancels its generation; a retry
never splits a rollout. Over a real gateway socket, with a gated policy double."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from rollout.runtime.gateway import GatewayOptions
from rollout.runtime.types import JobSpec, Limits, SamplingParams, SegmentReason
from rollout.server.gateway import Gateway
from tests.server.gateway.conftest import openai_client
from tests.server.gateway.policy_double import PromptPolicy
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def llm(tok: Any) -> PromptPolicy:
    return PromptPolicy(tok, tok.convert_tokens_to_ids("<|im_end|>"), gate=asyncio.Event())


@pytest.fixture
async def gateway(tmp_path: Any) -> Any:
    gw = await Gateway(tmp_path / "state").start()
    yield gw
    await gw.stop()


def spec(job_id: str) -> JobSpec:
    return JobSpec(job_id=job_id, environment="harness", task={},
                   sampling=SamplingParams(seed=1, max_tokens_per_turn=32),
                   limits=Limits(max_turns=16))


def conversation(k: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"You are sub-agent {k}."},
            {"role": "user", "content": f"Look at file {k}."}]


async def test_parallel_calls_of_one_job_generate_at_once(gateway: Gateway,
                                                          llm: PromptPolicy) -> None:
    """N sub-agents calling at once: the backend holds all N generations at the same time
    (so they finish in about the time of one), and each becomes a chain of its own."""
    n = 4
    lease = await gateway.open(spec("job-par"), llm, options=GatewayOptions(max_concurrent=n))
    client = openai_client(lease)
    calls = [asyncio.ensure_future(client.chat.completions.create(
        model="m", messages=conversation(k))) for k in range(n)]
    await assert_eventually(lambda: llm.in_flight == n)
    assert llm.gate is not None
    llm.gate.set()
    answers = await asyncio.gather(*calls)
    assert len({a.choices[0].message.content for a in answers}) == n
    capture = await gateway.close(lease)
    assert llm.peak == n
    assert [s.reason for s in capture.segments] == [
        SegmentReason.FIRST, *[SegmentReason.NEW_CONVERSATION] * (n - 1)]
    assert len(capture.turns) == n


async def test_a_jobs_generations_are_bounded(gateway: Gateway, llm: PromptPolicy) -> None:
    lease = await gateway.open(spec("job-bound"), llm, options=GatewayOptions(max_concurrent=2))
    client = openai_client(lease)
    calls = [asyncio.ensure_future(client.chat.completions.create(
        model="m", messages=conversation(k))) for k in range(4)]
    await assert_eventually(lambda: llm.in_flight == 2)
    await asyncio.sleep(0.2)  # the other two wait for a slot, not for the backend
    assert llm.in_flight == 2 and llm.started == 2
    assert llm.gate is not None
    llm.gate.set()
    await asyncio.gather(*calls)
    await gateway.close(lease)
    assert llm.peak == 2


async def test_a_client_that_disconnects_cancels_its_generation_and_leaves_no_turn(
        gateway: Gateway, llm: PromptPolicy) -> None:
    lease = await gateway.open(spec("job-gone"), llm)
    client = openai_client(lease)
    first = await _answered(client, llm, conversation(0))
    history = [*conversation(0), {"role": "assistant", "content": first},
               {"role": "user", "content": "And the next file?"}]
    assert llm.gate is not None
    llm.gate.clear()
    abandoned = asyncio.ensure_future(client.chat.completions.create(model="m",
                                                                      messages=history))
    await assert_eventually(lambda: llm.in_flight == 1)
    abandoned.cancel()  # the client gives up: its connection closes
    await assert_eventually(lambda: llm.cancelled == 1)
    assert len(gateway.capture(lease).turns) == 1
    # The harness retries the same request: it extends the chain, no spurious segment.
    llm.gate.set()
    again = await client.chat.completions.create(model="m", messages=history)
    assert again.choices[0].message.content
    capture = await gateway.close(lease)
    assert [s.reason for s in capture.segments] == [SegmentReason.FIRST]
    assert len(capture.turns) == 2 and len(llm.calls) == 2


async def test_a_retry_of_an_answered_request_gets_the_same_answer_and_no_turn(
        gateway: Gateway, llm: PromptPolicy) -> None:
    lease = await gateway.open(spec("job-retry"), llm)
    client = openai_client(lease)
    first = await _answered(client, llm, conversation(0))
    again = await client.chat.completions.create(model="m", messages=conversation(0))
    assert again.choices[0].message.content == first
    assert again.usage.completion_tokens == len(llm.calls[0][1])
    capture = await gateway.close(lease)
    assert len(capture.turns) == 1 and len(llm.calls) == 1 and capture.requests == 1


async def test_a_retry_while_the_first_try_still_generates_shares_it(
        gateway: Gateway, llm: PromptPolicy) -> None:
    """The client timed out and retried before the server noticed: both get the one
    generation's answer; the first going away does not cancel it while the retry waits."""
    lease = await gateway.open(spec("job-share"), llm)
    client = openai_client(lease)
    one = asyncio.ensure_future(client.chat.completions.create(model="m",
                                                                messages=conversation(0)))
    await assert_eventually(lambda: llm.in_flight == 1)
    two = asyncio.ensure_future(client.chat.completions.create(model="m",
                                                                messages=conversation(0)))
    await asyncio.sleep(0.1)
    one.cancel()
    await asyncio.sleep(0.1)
    assert llm.cancelled == 0 and llm.started == 1
    assert llm.gate is not None
    llm.gate.set()
    answer = await two
    assert answer.choices[0].message.content
    capture = await gateway.close(lease)
    assert len(capture.turns) == 1 and llm.started == 1


async def _answered(client: Any, llm: PromptPolicy, messages: list[dict[str, str]]) -> str:
    assert llm.gate is not None
    llm.gate.set()
    answer = await client.chat.completions.create(model="m", messages=messages)
    return str(answer.choices[0].message.content)


def budgeted(job_id: str, budget: int) -> JobSpec:
    return JobSpec(job_id=job_id, environment="harness", task={},
                   sampling=SamplingParams(seed=1, max_tokens_per_turn=10,
                                           max_response_tokens=budget),
                   limits=Limits(max_turns=16))


def awaiting_budget(gateway: Gateway, lease: Any) -> int:
    return gateway._leases[lease.api_key].conversation.awaiting_budget


async def _four_calls_one_waiting(gateway: Gateway, llm: PromptPolicy,
                                  job_id: str) -> tuple[Any, list[asyncio.Future[Any]]]:
    """Four calls at once under a budget of 24, 10 a turn: three hold 10, 10 and 4, the
    fourth waits for what they give back; then the backend is let go."""
    lease = await gateway.open(budgeted(job_id, 24), llm,
                               options=GatewayOptions(max_concurrent=4))
    client = openai_client(lease)
    calls = [asyncio.ensure_future(client.chat.completions.create(
        model="m", messages=conversation(k))) for k in range(4)]
    await assert_eventually(lambda: llm.in_flight == 3 and awaiting_budget(gateway, lease) == 1)
    assert sorted(llm.asked) == [4, 10, 10] and not any(c.done() for c in calls)
    assert llm.gate is not None
    llm.gate.set()
    return lease, calls


async def test_parallel_calls_reserve_the_response_budget_so_together_they_stay_within_it(
        gateway: Gateway, llm: PromptPolicy) -> None:
    """Four sub-agents call at once under a budget of 24 response tokens, 10 a turn: the
    first three hold 10, 10 and the 4 left; the fourth finds nothing free and waits for them;
    every reply runs long, so they spend it all, and only then is the fourth refused with the
    budget's answer: the job samples exactly 24 tokens."""
    import openai

    llm.replies.extend(["word " * 40] * 4)
    lease, calls = await _four_calls_one_waiting(gateway, llm, "job-reserve")
    results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 1 and isinstance(errors[0], openai.BadRequestError)
    assert errors[0].body["code"] == "context_length_exceeded"
    assert "max_response_tokens" in errors[0].body["message"]
    assert len(llm.asked) == 3
    capture = await gateway.close(lease)
    assert sum(len(t.output_ids) for t in capture.turns) == 24
    assert capture.refused == "token_budget"


async def test_a_call_that_finds_the_budget_only_held_is_served_with_what_comes_back(
        gateway: Gateway, llm: PromptPolicy) -> None:
    """The three holders reply briefly and give back what they did not use: the fourth,
    which found all 24 tokens held, is served from that (not refused), and the job's limit
    is never recorded as reached."""
    llm.replies.extend(["ok"] * 4)
    lease, calls = await _four_calls_one_waiting(gateway, llm, "job-held")
    answers = await asyncio.gather(*calls)
    assert all(a.choices[0].message.content == "ok" for a in answers)
    first_three = sum(len(out) for _, out in llm.calls[:3])
    assert llm.asked[3] == min(10, 24 - first_three)
    capture = await gateway.close(lease)
    assert len(capture.turns) == 4 and not capture.refused
    assert sum(len(t.output_ids) for t in capture.turns) <= 24


async def test_a_call_waiting_for_held_budget_leaves_when_its_client_does(
        gateway: Gateway, llm: PromptPolicy) -> None:
    """A waiting call whose client goes away stops waiting and leaves nothing behind."""
    lease = await gateway.open(budgeted("job-held-gone", 10), llm,
                               options=GatewayOptions(max_concurrent=4))
    client = openai_client(lease)
    holder = asyncio.ensure_future(client.chat.completions.create(
        model="m", messages=conversation(0)))
    await assert_eventually(lambda: llm.in_flight == 1)
    waiter = asyncio.ensure_future(client.chat.completions.create(
        model="m", messages=conversation(1)))
    await assert_eventually(lambda: awaiting_budget(gateway, lease) == 1)
    waiter.cancel()
    await assert_eventually(lambda: awaiting_budget(gateway, lease) == 0)
    assert llm.gate is not None
    llm.gate.set()
    await holder
    capture = await gateway.close(lease)
    assert len(capture.turns) == 1 and llm.started == 1


async def test_a_call_gives_back_the_budget_it_did_not_use(gateway: Gateway,
                                                           llm: PromptPolicy) -> None:
    """What a finished call did not sample, and all a cancelled call held, is free again."""
    llm.replies.extend(["ok", "ok"])
    lease = await gateway.open(budgeted("job-refund", 12), llm,
                               options=GatewayOptions(max_concurrent=4))
    client = openai_client(lease)
    calls = [asyncio.ensure_future(client.chat.completions.create(
        model="m", messages=conversation(k))) for k in range(2)]
    await assert_eventually(lambda: llm.in_flight == 2)
    assert sorted(llm.asked) == [2, 10]
    assert llm.gate is not None
    llm.gate.set()
    await asyncio.gather(*calls)
    used = sum(len(out) for _, out in llm.calls)
    assert used < 12
    llm.gate.clear()
    gone = asyncio.ensure_future(client.chat.completions.create(
        model="m", messages=conversation(2)))
    await assert_eventually(lambda: llm.in_flight == 1)
    assert llm.asked[-1] == min(10, 12 - used)
    gone.cancel()  # the client goes away: its reservation is released with its chain
    await assert_eventually(lambda: llm.cancelled == 1)
    llm.gate.set()
    await client.chat.completions.create(model="m", messages=conversation(3))
    assert llm.asked[-1] == min(10, 12 - used)
    capture = await gateway.close(lease)
    assert sum(len(t.output_ids) for t in capture.turns) <= 12


async def test_a_call_waiting_for_held_budget_ends_with_the_jobs_run(
        gateway: Gateway, llm: PromptPolicy) -> None:
    """The holder outlives the job's RUN deadline: the waiting call is answered 504 then,
    not kept waiting, and is not counted as the job's token budget."""
    import openai

    lease = await gateway.open(budgeted("job-held-late", 10), llm,
                               options=GatewayOptions(max_concurrent=4),
                               deadline=time.monotonic() + 6.0)
    client = openai_client(lease)
    holder = asyncio.ensure_future(client.chat.completions.create(
        model="m", messages=conversation(0)))
    await assert_eventually(lambda: llm.in_flight == 1)
    waiter = asyncio.ensure_future(client.chat.completions.create(
        model="m", messages=conversation(1)))
    await assert_eventually(lambda: awaiting_budget(gateway, lease) == 1)
    with pytest.raises(openai.APIStatusError) as raised:
        await waiter
    assert raised.value.status_code == 504
    assert raised.value.body["code"] == "deadline_exceeded"
    assert llm.started == 1 and not gateway.capture(lease).refused
    assert llm.gate is not None
    llm.gate.set()
    await holder
    await gateway.close(lease)


async def test_calls_waiting_for_budget_are_served_in_arrival_order(
        gateway: Gateway, llm: PromptPolicy) -> None:
    """Room comes back while the job's lock is busy (as while another of its requests is
    admitted) and a call that arrived after the waiting one is first to get the lock: it
    queues behind the waiting call instead of taking the room, so generations start in the
    calls' arrival order."""
    llm.replies.extend(["ok"] * 3)
    lease = await gateway.open(budgeted("job-fifo", 10), llm,
                               options=GatewayOptions(max_concurrent=4))
    conv = gateway._leases[lease.api_key].conversation
    client = openai_client(lease)

    def lock_waiters() -> int:
        return len(conv._lock._waiters or ())

    def call(k: int) -> asyncio.Future[Any]:
        return asyncio.ensure_future(client.chat.completions.create(
            model="m", messages=conversation(k)))

    holder = call(0)
    await assert_eventually(lambda: llm.in_flight == 1)  # it holds all 10 tokens
    first = call(1)
    await assert_eventually(lambda: awaiting_budget(gateway, lease) == 1)
    async with conv._lock:
        later = call(2)
        await assert_eventually(lambda: lock_waiters() == 1)
        assert llm.gate is not None
        llm.gate.set()  # the holder answers "ok" and gives back what it did not use
        await holder
        await assert_eventually(lambda: lock_waiters() == 2)  # the waiter, woken, behind
    await asyncio.gather(first, later)
    texts = [llm.tok.decode(p) for p in llm.prompts]
    assert [next(k for k in range(3) if f"sub-agent {k}." in t) for t in texts] == [0, 1, 2]
    capture = await gateway.close(lease)
    assert len(capture.turns) == 3 and not capture.refused


async def test_a_call_past_max_turns_is_refused_before_it_waits_for_budget(
        gateway: Gateway, llm: PromptPolicy) -> None:
    """The job may make one request and it is running, holding the whole budget: a second
    call is refused at once with the turn limit, not kept waiting for tokens it could never
    use."""
    import openai

    job = budgeted("job-turns", 10)
    job = JobSpec(job_id=job.job_id, environment="harness", task={}, sampling=job.sampling,
                  limits=Limits(max_turns=1))
    lease = await gateway.open(job, llm, options=GatewayOptions(max_concurrent=4))
    client = openai_client(lease)
    holder = asyncio.ensure_future(client.chat.completions.create(
        model="m", messages=conversation(0)))
    await assert_eventually(lambda: llm.in_flight == 1)
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(model="m", messages=conversation(1))
    assert raised.value.body["code"] == "max_turns"
    assert awaiting_budget(gateway, lease) == 0 and llm.in_flight == 1 and not holder.done()
    assert gateway.capture(lease).refused == "max_turns"
    assert llm.gate is not None
    llm.gate.set()
    await holder
    await gateway.close(lease)
