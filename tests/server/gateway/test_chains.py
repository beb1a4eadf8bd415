"""Trajectories as trees: chains per line of conversation, one owner per sampled token.

Driven at the conversation level (``JobConversation`` with a prompt-determined policy double)
so hypothesis can try many interleavings of main-thread calls, sub-agent calls, compactions,
edits, retries and bursts of parallel calls.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.runtime.gateway import GatewayOptions, SideCallRule
from rollout.runtime.types import JobSpec, Limits, SamplingParams, SegmentReason, Trajectory
from rollout.server.gateway.conversation import JobConversation, ServedTurn
from rollout.server.gateway.messages import CallItem, ChatRequest, Message
from tests.runtime.doubles import smollm2_tokenizer
from tests.server.gateway.policy_double import PromptPolicy

pytestmark = pytest.mark.timeout(300)

_TOK: list[Any] = []


def tokenizer() -> Any:
    if not _TOK:
        _TOK.append(smollm2_tokenizer())
    return _TOK[0]


def policy() -> PromptPolicy:
    tok = tokenizer()
    return PromptPolicy(tok, tok.convert_tokens_to_ids("<|im_end|>"))


def conversation(llm: PromptPolicy, *, max_turns: int = 200,
                 options: GatewayOptions | None = None) -> JobConversation:
    spec = JobSpec(job_id="job", environment="harness", task={},
                   sampling=SamplingParams(seed=3, max_tokens_per_turn=64),
                   limits=Limits(max_turns=max_turns))
    return JobConversation(spec, llm, deadline=asyncio.get_running_loop().time() + 3600,
                           options=options)


def echo(answer: ServedTurn) -> Message:
    return Message("assistant", answer.content, tuple(answer.tool_calls))


# ----------------------------------------------------------------------------- invariants


def check_tree(conv: JobConversation, llm: PromptPolicy) -> None:
    """Every generation the backend ran is the output of exactly one trained turn; each turn
    was generated from exactly its segment's ids so far; segments are contiguous, parents
    come first."""
    capture = conv.capture
    traj = Trajectory(job_id="j", turns=capture.turns, segments=capture.segments)
    seen = {tuple(o): p for p, o in llm.calls}
    owners = Counter(tuple(t.output_ids) for t in capture.turns if t.trained)
    assert owners == Counter(tuple(o) for _, o in llm.calls)
    assert len(capture.turns) == len(llm.calls) == capture.requests
    starts = [s.first_turn for s in capture.segments]
    if not capture.turns:
        assert not starts
        return
    assert starts == sorted(set(starts)) and starts[0] == 0
    assert capture.segments[0].reason == SegmentReason.FIRST
    for n, (segment, turns) in enumerate(zip(capture.segments, traj.segment_turns(),
                                             strict=True)):
        if segment.parent is not None:
            assert 0 <= segment.parent < n
            parent_turns = traj.segment_turns()[segment.parent]
            assert 0 <= segment.branch_point <= len(parent_turns)
        ids: list[int] = []
        mask: list[int] = []
        for turn in turns:
            ids += turn.prompt_ids
            assert ids == seen[tuple(turn.output_ids)], "a turn's prompt is not its segment"
            ids += turn.output_ids + turn.observation_ids
            mask += turn.loss_mask
        # Loss mask 1 exactly on the outputs (observations and repeated context are 0).
        assert sum(mask) == sum(len(t.output_ids) for t in turns)


@dataclass
class Thread:
    messages: list[Message]
    last: list[Message] | None = None
    answer: ServedTurn | None = None
    rewritten: bool = False
    done: bool = False
    counter: itertools.count[int] = field(default_factory=itertools.count)


OPS = st.lists(st.tuples(st.sampled_from(
    ["main", "main", "sub_start", "sub_step", "sub_step", "sub_end", "compact", "edit",
     "retry", "burst", "fork"]), st.integers(0, 7), st.booleans()), min_size=1, max_size=14)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_every_interleaving_gives_one_chain_per_line_and_one_owner_per_token(
        ops: list[tuple[str, int, bool]]) -> None:
    asyncio.run(_interleaving(ops))


async def _interleaving(ops: list[tuple[str, int, bool]]) -> None:
    llm = policy()
    conv = conversation(llm)
    system = Message("system", "You are the main agent.")
    main = Thread([system, Message("user", "Fix the bug.")])
    subs: list[Thread] = []
    lines = 0  # chains the harness's behaviour calls for
    uid = itertools.count()

    async def send(thread: Thread) -> None:
        nonlocal lines
        if thread.last is None or thread.rewritten:
            lines += 1
            thread.rewritten = False
        request = list(thread.messages)
        answer = await conv.serve(ChatRequest(messages=request))
        thread.last, thread.answer = request, answer
        thread.messages += [echo(answer), Message("user", f"observation {next(uid)}")]

    for op, n, flag in ops:
        open_subs = [s for s in subs if not s.done]
        if op == "main":
            await send(main)
        elif op == "sub_start":
            # A sub-agent either has its own system prompt or shares the main one.
            head = system if flag else Message("system", f"You are sub-agent {next(uid)}.")
            sub = Thread([head, Message("user", f"Sub-task {next(uid)}.")])
            subs.append(sub)
            await send(sub)
        elif op == "sub_step" and open_subs:
            await send(open_subs[n % len(open_subs)])
        elif op == "sub_end" and open_subs:
            sub = open_subs[n % len(open_subs)]
            sub.done = True
            main.messages.append(Message("user", f"The sub-agent said: {sub.answer.content}"
                                         if sub.answer else "The sub-agent said nothing."))
        elif op == "compact" and main.last is not None:
            main.messages = [system, Message("user", f"Summary {next(uid)} of the work so far.")]
            main.rewritten = True
        elif op == "edit" and main.last is not None and min(len(main.last),
                                                            len(main.messages)) > 1:
            # A message the chain already holds (or the compacted history's).
            k = 1 + n % (min(len(main.last), len(main.messages)) - 1)
            old = main.messages[k]
            main.messages[k] = Message(old.role, old.content + f" (edited {next(uid)})",
                                       old.tool_calls, old.tool_call_id, old.name)
            main.rewritten = True
        elif op == "retry":
            threads = [t for t in [main, *subs] if t.last is not None]
            if threads:
                t = threads[n % len(threads)]
                before = len(llm.calls)
                again = await conv.serve(ChatRequest(messages=list(t.last or [])))
                # A retry of the chain's last answered request: the same answer, no turn.
                if t.answer is not None and _is_tip(conv, t.last or []):
                    assert again.content == t.answer.content
                    assert len(llm.calls) == before
                else:
                    lines += 1  # an older request resent: a branch of its own
        elif op == "burst":
            ready = [main, *open_subs]
            await asyncio.gather(*(send(t) for t in ready))
        elif op == "fork" and main.last is not None and not main.rewritten:
            # Two calls at once from the main history (say, two tools' follow-ups): one
            # extends the main chain, the other is a parallel chain; the main thread goes on
            # with the first, whichever chain it landed in.
            other = Thread([*main.messages, Message("user", f"Other branch {next(uid)}.")],
                           last=[])
            main.messages.append(Message("user", f"This branch {next(uid)}."))
            await asyncio.gather(send(main), send(other))
            lines += 1
    await conv.close()
    check_tree(conv, llm)
    assert len(conv.capture.segments) == lines


def _is_tip(conv: JobConversation, messages: list[Message]) -> bool:
    keys = tuple(m.key() for m in messages)
    return any(c.tip is not None and c.tip[0][2] == keys for c in conv._chains)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.permutations(list(range(9))), st.permutations(list(range(9))))
def test_the_trajectory_is_the_same_whatever_the_interleaving(
        first: list[int], second: list[int]) -> None:
    """Three threads of three calls each: any two schedules (each thread's own calls in
    order) give the same chains, token for token."""
    assert asyncio.run(_schedule(first)) == asyncio.run(_schedule(second))


async def _schedule(order: list[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    llm = policy()
    conv = conversation(llm)
    threads = [Thread([Message("system", f"Agent {k}."), Message("user", f"Task {k}.")])
               for k in range(3)]
    # Slot s of the permutation runs the next call of thread s % 3.
    for slot in order:
        thread = threads[slot % 3]
        answer = await conv.serve(ChatRequest(messages=list(thread.messages)))
        thread.messages += [echo(answer), Message("user", "go on")]
    await conv.close()
    check_tree(conv, llm)
    traj = Trajectory(job_id="j", turns=conv.capture.turns, segments=conv.capture.segments)
    out = []
    for turns in traj.segment_turns():
        ids = [i for t in turns for i in t.prompt_ids + t.output_ids + t.observation_ids]
        mask = [m for t in turns for m in t.loss_mask]
        out.append((tuple(ids), tuple(mask)))
    assert len(out) == 3
    return sorted(out)


# ----------------------------------------------------------------------------- the exact rule

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]


def call_text(name: str, **arguments: Any) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


async def _two_requests(change: Any, tools: list[Any] | None = None,
                        ) -> tuple[JobConversation, PromptPolicy]:
    """Answer a request with a tool call, then send the history with ``change`` applied to
    the echoed assistant message (or to the tools)."""
    llm = policy()
    llm.replies.extend(["Let me look.\n" + call_text("bash", command="ls"), "Done."])
    conv = conversation(llm)
    start = [Message("system", "You are an agent."), Message("user", "List the files.")]
    answer = await conv.serve(ChatRequest(messages=start, tools=TOOLS))
    assert answer.tool_calls
    said = echo(answer)
    history = [*start, change(said),
               Message("tool", "a.txt", tool_call_id=answer.tool_calls[0].id)]
    await conv.serve(ChatRequest(messages=history, tools=tools if tools is not None else TOOLS))
    await conv.close()
    check_tree(conv, llm)
    return conv, llm


def _reasons(conv: JobConversation) -> list[SegmentReason]:
    return [s.reason for s in conv.capture.segments]


async def test_an_echo_as_sent_extends_the_chain() -> None:
    conv, _ = await _two_requests(lambda m: m)
    assert _reasons(conv) == [SegmentReason.FIRST]


async def test_an_echo_respelled_extends_the_chain() -> None:
    """Whitespace around the text and the JSON spelling of arguments are not the model's
    tokens' meaning: a client that re-serialises still extends its chain."""
    def respell(m: Message) -> Message:
        calls = tuple(CallItem("other-id", c.name, json.dumps(json.loads(c.arguments),
                                                              indent=2)) for c in m.tool_calls)
        return Message("assistant", f"  {m.content}\n", calls)

    conv, _ = await _two_requests(respell)
    assert _reasons(conv) == [SegmentReason.FIRST]


@pytest.mark.parametrize("change", [
    pytest.param(lambda m: Message("assistant", m.content + " And more.", m.tool_calls),
                 id="assistant-text"),
    pytest.param(lambda m: Message("assistant", "", m.tool_calls), id="assistant-text-dropped"),
    pytest.param(lambda m: Message("assistant", m.content, tuple(
        CallItem(c.id, c.name, json.dumps({"command": "rm -rf /"})) for c in m.tool_calls)),
                 id="call-arguments"),
    pytest.param(lambda m: Message("assistant", m.content, tuple(
        CallItem(c.id, "sh", c.arguments) for c in m.tool_calls)), id="call-name"),
    pytest.param(lambda m: Message("assistant", m.content), id="call-dropped"),
    pytest.param(lambda m: Message("user", m.content, m.tool_calls), id="role"),
])
async def test_harness_written_text_is_never_trained_as_model_output(change: Any) -> None:
    """An echoed assistant message that is not what the model said (other text, other
    arguments, another tool) does not extend the chain: the request starts a new one where
    that text is prompt (mask 0), and the model's real output stays owned once."""
    conv, llm = await _two_requests(change)
    assert _reasons(conv) == [SegmentReason.FIRST, SegmentReason.HISTORY_REWRITTEN]
    second = conv.capture.segments[1]
    assert second.parent == 0 and second.branch_point == 0
    new_chain_first_turn = conv.capture.turns[second.first_turn]
    assert new_chain_first_turn.loss_mask == (
        [0] * len(new_chain_first_turn.prompt_ids) + [1] * len(llm.calls[1][1]))


async def test_a_changed_tools_list_starts_a_chain() -> None:
    other = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": "Run it."}}]
    conv, _ = await _two_requests(lambda m: m, tools=other)
    assert _reasons(conv) == [SegmentReason.FIRST, SegmentReason.HISTORY_REWRITTEN]
    assert conv.capture.segments[1].branch_point == 1  # the whole first exchange is shared


# ----------------------------------------------------------------------------- sub-agents


async def test_a_main_thread_and_a_sub_agent_alternating_give_two_chains() -> None:
    """Six requests, main and sub-agent alternating: two chains of three turns (before,
    one segment per request)."""
    llm = policy()
    conv = conversation(llm)
    main = [Message("system", "Main agent."), Message("user", "Fix it.")]
    sub = [Message("system", "Explorer sub-agent."), Message("user", "Find the file.")]
    for step in range(3):
        for thread in (main, sub):
            answer = await conv.serve(ChatRequest(messages=list(thread)))
            thread += [echo(answer), Message("user", f"result {step}")]
    await conv.close()
    check_tree(conv, llm)
    assert [(s.first_turn, s.reason, s.parent) for s in conv.capture.segments] == [
        (0, SegmentReason.FIRST, None), (3, SegmentReason.NEW_CONVERSATION, None)]


async def test_a_side_call_is_its_own_untrained_chain() -> None:
    llm = policy()
    options = GatewayOptions(side_calls=(SideCallRule(system="(?i)title"),))
    conv = conversation(llm, options=options)
    main = [Message("system", "Main agent."), Message("user", "Fix it.")]
    answer = await conv.serve(ChatRequest(messages=list(main)))
    await conv.serve(ChatRequest(messages=[Message("system", "Write a TITLE for this chat."),
                                           Message("user", "Fix it.")]))
    main += [echo(answer), Message("user", "next")]
    await conv.serve(ChatRequest(messages=main))
    await conv.close()
    segments = conv.capture.segments
    assert [(s.first_turn, s.side_call) for s in segments] == [(0, False), (2, True)]
    main_turns, side_turns = Trajectory(job_id="j", turns=conv.capture.turns,
                                        segments=segments).segment_turns()
    assert all(t.trained for t in main_turns) and not any(t.trained for t in side_turns)
    assert sum(side_turns[0].loss_mask) == 0 and side_turns[0].output_ids


def test_a_side_call_rule_checks_every_field_it_has() -> None:
    rule = SideCallRule(model=r"claude-.*haiku.*", metadata=(("purpose", "title"),))
    assert rule.matches("claude-3-5-haiku-2024", "", {"purpose": "title"})
    assert not rule.matches("claude-3-5-haiku-2024", "", {"purpose": "work"})
    assert not rule.matches("claude-sonnet-4-5", "", {"purpose": "title"})
    with pytest.raises(ValueError, match="needs model, system, metadata or last_user"):
        SideCallRule()
    with pytest.raises(ValueError, match="not a regular expression"):
        SideCallRule(system="(")
    with pytest.raises(ValueError, match="not a regular expression"):
        SideCallRule(last_user="[")
    last = SideCallRule(model="policy", last_user=r"(?m)^Recap")
    assert last.matches("policy", "", {}, "Recap in 40 words")
    assert not last.matches("policy", "", {}, "Please say: Recap in 40 words")
    assert not last.matches("other", "", {}, "Recap in 40 words")
    assert not last.matches("policy", "", {}, "")


def test_the_final_user_message_is_read_past_system_messages_but_not_past_a_tool_result(
        ) -> None:
    """What a ``last_user`` rule is searched in: Claude Code follows a fork's instruction with
    a system message of its own (its agent types), which is passed over; a tool result or an
    answer after the user's message means the request does not end with one."""
    def last(*messages: Message) -> str:
        return ChatRequest(messages=list(messages)).last_user_text()

    task, note = Message("user", "Recap now."), Message("system", "Agent types: ...")
    tool = Message("tool", "Recap now.", tool_call_id="t1")
    assert last(Message("system", "Main."), task) == "Recap now."
    assert last(Message("system", "Main."), task, note, note) == "Recap now."
    assert last(task, tool) == last(task, tool, note) == ""
    assert last(task, Message("assistant", "Done."), note) == ""
    assert last(note) == last() == ""
