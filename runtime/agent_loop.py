"""The multi-turn agent loop: model turn, tool calls, observations, repeat — all in token ids.

Every environment's RUN stage calls :func:`run_agent_loop`. The model sees the task and the
tools (rendered by the chat template itself when it supports tools, otherwise listed in the
system prompt in the tool-call format of the model's family), answers with tool calls in that
format (:mod:`rollout.runtime.toolcalls`), and the loop runs them and appends their results as
tokens (loss mask 0). Token accounting lives in :mod:`rollout.runtime.tokens`: the model's
output ids go into the trajectory untouched.

Chat settings, each from the job's ``spec.chat`` first, then the environment's arguments, then
the chat template: the tool-call format (detected from the template's text) and extra template
keyword arguments (e.g. ``enable_thinking``; the job's override the environment's). A template
with no ``tool`` role (Gemma style: it raises on, or silently drops, a tool message) gets each
turn's observations as one ``user`` message instead, one block per call.

Turns the engine could not finish cleanly:
- ``deadline``: the RUN deadline arrived mid-turn. Every generate call carries ``timeout_s`` =
  time left, so the engine returns what it generated; that partial turn is kept (tokens,
  logprobs, mask 1), no tool runs, and the episode ends with DEADLINE.
- ``preempted``: a weight swap cut the turn, so its tokens mix two policies. It is discarded
  and generated again from the same prompt with the same seed (the kept turn is what an
  uninterrupted run under the new weights samples), at most :data:`MAX_PREEMPTED_RETRIES`
  times; then :class:`rollout.runtime.llm.TurnPreempted` fails the job. ``Turn.
  preempted_retries`` counts the discarded attempts.
- ``abort``: the backend aborted the turn; the loop ends with CANCELLED, and the pipeline never
  scores such a RUN as a success.

Seeds: turn k is sampled with ``seed + k``; with no seed in the spec the loop draws one, so
every trajectory reports the seed that reproduces it (``ctx.state[SEED_KEY]``).

The loop never raises for the model's mistakes (bad JSON, unknown tools, tools that crash):
those become error observations the model can react to. It does raise
:class:`rollout.runtime.llm.LLMUnavailable` (no backend: the job fails, a partial trajectory
would be bad training data) and lets cancellation through. While it runs,
``ctx.state[TURNS_KEY]`` is the live list of finished turns, so a scheduler that cancels RUN can
still salvage them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rollout.runtime.handler import HandlerError, JobContext, RunOutcome
from rollout.runtime.llm import GenerateRequest, GenerateResult, LLMClient, TurnPreempted
from rollout.runtime.tokens import ChatLedger, ChatTokenizer
from rollout.runtime.toolcalls import (
    DEFAULT_FORMAT,
    THINK_OPEN,
    TOOL_CALL_FORMATS,
    ToolCallFormat,
    detect_format,
    parse_tool_calls,
)
from rollout.runtime.tools.base import Tool, ToolCall, ToolCallError, ToolResult, tool_schema
from rollout.runtime.tools.submit import SUBMITTED_ANSWER_KEY
from rollout.runtime.types import TerminationReason, Turn

log = logging.getLogger(__name__)

TURNS_KEY = "agent_loop.turns"
"""``ctx.state`` key of the live list of finished turns."""
SEED_KEY = "agent_loop.seed"
"""``ctx.state`` key of the seed turn 0 was sampled with (turn k: seed + k)."""

DEFAULT_INSTRUCTIONS = "You are a helpful assistant. Solve the task by calling the tools."

DEADLINE_MARGIN_S = 2.0
"""Default deadline = RUN timeout minus this, so the loop returns before the scheduler cancels."""

DEADLINE_GRACE_S = 1.0
"""How long after the deadline the loop still waits for a turn before cancelling it itself.
The engine stops at ``timeout_s`` and returns the partial turn; this grace (less than
``DEADLINE_MARGIN_S``) lets that reply arrive instead of racing it."""

MAX_PREEMPTED_RETRIES = 3
"""Attempts of one turn that weight swaps may cut before the job fails."""

MAX_DRAWN_SEED = 2**31 - 1
"""Drawn seeds stay in int32 range so every engine (torch, vLLM) takes ``seed + k`` as is."""

MAX_CONTEXT_HINT = 10_000_000
"""Tokenizers without a known limit report ~1e30 as ``model_max_length``; ignore those."""


def tools_block(tools: Sequence[Tool], fmt: str | ToolCallFormat = DEFAULT_FORMAT) -> str:
    """The tool section in format ``fmt``, for chat templates that do not render tools."""
    spec = fmt if isinstance(fmt, ToolCallFormat) else TOOL_CALL_FORMATS[fmt]
    return spec.instructions([tool_schema(t) for t in tools])


def build_system_prompt(tools: Sequence[Tool], instructions: str = DEFAULT_INSTRUCTIONS,
                        fmt: str | ToolCallFormat = DEFAULT_FORMAT) -> str:
    """System prompt text: the environment's instructions, then the tool section."""
    return f"{instructions}\n\n{tools_block(tools, fmt)}" if tools else instructions


def prepare_messages(chat: ChatTokenizer, tools: Sequence[Tool],
                     messages: Sequence[Mapping[str, Any]], *,
                     tools_in_template: bool | None = None,
                     fmt: str | ToolCallFormat = DEFAULT_FORMAT,
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages with the tool-listing system prompt, and the schemas for the template (if any).

    A leading system message in ``messages`` supplies the instructions.
    """
    msgs = [dict(m) for m in messages]
    instructions = DEFAULT_INSTRUCTIONS
    if msgs and msgs[0].get("role") == "system":
        instructions = str(msgs.pop(0).get("content", ""))
    use_template = chat.supports_tools if tools_in_template is None else tools_in_template
    if use_template and tools:
        return ([{"role": "system", "content": instructions}, *msgs],
                [tool_schema(t) for t in tools])
    return ([{"role": "system", "content": build_system_prompt(tools, instructions, fmt)},
             *msgs], None)


def resolve_format(ctx: JobContext, chat: ChatTokenizer, env_format: str | None) -> str:
    """The job's format, else the environment's, else the one the template teaches."""
    name = ctx.spec.chat.tool_call_format or env_format or detect_format(chat.template_source)
    if name not in TOOL_CALL_FORMATS:
        raise HandlerError(f"unknown tool-call format {name!r}; known: "
                           f"{', '.join(sorted(TOOL_CALL_FORMATS))}", "UNKNOWN_TOOL_CALL_FORMAT")
    return name


def context_length_of(llm: LLMClient) -> int | None:
    """The served model's context length, where the client or its tokenizer knows it."""
    for value in (getattr(llm, "context_length", None),
                  getattr(llm.tokenizer, "model_max_length", None)):
        if isinstance(value, int) and 0 < value < MAX_CONTEXT_HINT:
            return value
    return None


async def run_agent_loop(ctx: JobContext, tools: Sequence[Tool],
                         messages: Sequence[Mapping[str, Any]], *, max_turns: int | None = None,
                         deadline: float | None = None, context_length: int | None = None,
                         chat_template: str | None = None, tools_in_template: bool | None = None,
                         max_observation_chars: int = 16_000,
                         tool_call_format: str | None = None,
                         template_kwargs: Mapping[str, Any] | None = None,
                         turns: list[Turn] | None = None) -> RunOutcome:
    """Run the job's conversation until submit, no tool call, a limit, or the deadline.

    ``messages``: the task (optionally led by a system message with instructions).
    ``max_turns`` defaults to ``spec.limits.max_turns``; ``deadline`` (``time.monotonic()``
    time) to ``spec.limits.run_timeout_s - DEADLINE_MARGIN_S`` from now; ``context_length`` to
    what :func:`context_length_of` finds. ``tool_call_format`` and ``template_kwargs`` are the
    environment's chat settings (the job's ``spec.chat`` overrides them). The outcome's metadata
    carries ``final_text`` (the last assistant text, for answer extraction),
    ``submitted_answer`` when the submit tool ran, ``template_append_only``,
    ``tool_call_format``, ``observation_role`` and ``preempted_retries`` (all turns).
    ``turns``: the live list the turns are appended to (and ``ctx.state[TURNS_KEY]``; default a
    new one), so an environment that runs several conversations in one job (a multi-step
    task) keeps every one's turns in one trajectory; ``sampling.max_response_tokens`` counts
    them all, ``max_turns`` and the outcome's ``num_turns`` this conversation's.
    """
    if ctx.llm is None:
        raise HandlerError("this environment needs an LLM but the job has none", "NO_LLM")
    llm, spec = ctx.llm, ctx.spec
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise HandlerError(f"duplicate tool names: {names}", "DUPLICATE_TOOLS")
    by_name = {t.name: t for t in tools}
    max_turns = max_turns or spec.limits.max_turns
    if deadline is None:
        deadline = time.monotonic() + max(0.0, spec.limits.run_timeout_s - DEADLINE_MARGIN_S)
    limit_ctx = context_length or context_length_of(llm)
    budget = spec.sampling.total_token_budget
    chat = ChatTokenizer(llm.tokenizer, chat_template=chat_template,
                         template_kwargs={**(template_kwargs or {}), **spec.chat.template_kwargs})
    fmt = resolve_format(ctx, chat, tool_call_format)
    msgs, template_tools = prepare_messages(chat, tools, messages,
                                            tools_in_template=tools_in_template, fmt=fmt)
    ledger = ChatLedger(chat, msgs, template_tools)
    seed = spec.sampling.seed
    if seed is None:
        seed = random.SystemRandom().randint(0, MAX_DRAWN_SEED)
    ctx.state[SEED_KEY] = seed
    turns = [] if turns is None else turns
    earlier = len(turns)
    ctx.state[TURNS_KEY] = turns
    final_text = ""
    slowest_turn_s = 0.0
    termination = TerminationReason.MAX_TURNS
    observation_role = "tool"
    prompt_tokens = 0
    try:
        prompt_ids, reasoning_opened, observation_role = await asyncio.to_thread(
            _start, ledger, chat)
        prompt_tokens = len(ledger.token_ids)
        for index in range(max_turns):
            used = len(ledger.token_ids)
            room = min(budget, limit_ctx or budget) - used
            if room <= 0:
                termination = _limit_reason(budget, limit_ctx)
                break
            response_room = _response_room(spec.sampling.max_response_tokens, turns)
            if response_room <= 0:
                termination = TerminationReason.TOKEN_BUDGET
                break
            max_tokens = min(spec.sampling.max_tokens_per_turn, room, response_room)
            started = time.monotonic()
            if started + slowest_turn_s >= deadline:
                termination = TerminationReason.DEADLINE
                break
            request = GenerateRequest(
                prompt_ids=list(ledger.token_ids), sampling=spec.sampling, max_tokens=max_tokens,
                session_id=spec.job_id, group_id=spec.group_id,
                min_policy_version=spec.min_policy_version, seed=seed + index)
            result, retries = await _generate(llm, request, deadline, index)
            if result is None:
                termination = TerminationReason.DEADLINE
                break
            if result.finish_reason == "abort":
                termination = TerminationReason.CANCELLED
                break
            if result.finish_reason == "deadline" and not result.output_ids:
                termination = TerminationReason.DEADLINE
                break  # nothing generated: no turn to keep
            turn = Turn(prompt_ids=prompt_ids, output_ids=list(result.output_ids),
                        output_logprobs=list(result.logprobs),
                        policy_version=result.policy_version, finish_reason=result.finish_reason,
                        backend=result.backend, latency_s=time.monotonic() - started,
                        preempted_retries=retries, logprobs_kind=result.logprobs_kind,
                        routed_experts=list(result.routed_experts),
                        routed_expert_top_k=result.routed_expert_top_k,
                        routed_expert_layers=result.routed_expert_layers)
            final_text = await asyncio.to_thread(ledger.add_output, turn.output_ids)
            turns.append(turn)
            if result.finish_reason == "deadline":
                # The partial turn is kept as sampled (mask 1); no time is left to run tools.
                _report(ctx, turns, len(ledger.token_ids), 0.0)
                termination = TerminationReason.DEADLINE
                break
            calls = parse_tool_calls(final_text, fmt, reasoning_opened=reasoning_opened,
                                     fence_tools=by_name)
            tool_started = time.monotonic()
            observations, finished, timed_out = await _run_calls(
                calls, by_name, deadline, max_observation_chars, turn)
            _report(ctx, turns, len(ledger.token_ids), time.monotonic() - tool_started)
            slowest_turn_s = max(slowest_turn_s, time.monotonic() - started)
            if not calls:
                clipped = result.finish_reason == "length" and max_tokens < (
                    spec.sampling.max_tokens_per_turn)
                if clipped and max_tokens == response_room and max_tokens < room:
                    termination = TerminationReason.TOKEN_BUDGET  # the response budget cut it
                elif clipped:
                    termination = _limit_reason(budget, limit_ctx)
                else:
                    termination = TerminationReason.NO_TOOL_CALL
                break
            if finished:
                termination = TerminationReason.SUBMITTED
                break
            if timed_out:
                termination = TerminationReason.DEADLINE
                break
            if index == max_turns - 1:
                break  # MAX_TURNS; the last calls ran (their effects count), nothing follows
            if _response_room(spec.sampling.max_response_tokens, turns) <= 0:
                termination = TerminationReason.TOKEN_BUDGET
                break  # no reply may follow: the observation would be dead weight
            if observation_role != "tool":
                observations = _as_one_message(observations, observation_role)
            delta = await asyncio.to_thread(ledger.add_messages, observations)
            if len(ledger.token_ids) >= min(budget, limit_ctx or budget):
                termination = _limit_reason(budget, limit_ctx)
                break  # no room for a reply: the observation would be dead weight
            turn.observation_ids = delta.observation_ids
            prompt_ids = delta.prompt_ids
    finally:
        try:
            await llm.end_session(spec.job_id)
        except Exception:  # never mask the loop's own outcome or exception
            log.exception("end_session(%s) failed", spec.job_id)
    metadata = {"final_text": final_text, "num_turns": str(len(turns) - earlier),
                "template_append_only": str(ledger.append_only).lower(),
                "tool_call_format": fmt, "observation_role": observation_role,
                "preempted_retries": str(sum(t.preempted_retries for t in turns[earlier:])),
                # A trainer names this when the prompt alone filled the token budget (no turn).
                "prompt_tokens": str(prompt_tokens)}
    if SUBMITTED_ANSWER_KEY in ctx.state:
        metadata[SUBMITTED_ANSWER_KEY] = str(ctx.state[SUBMITTED_ANSWER_KEY])
    return RunOutcome(turns=list(turns), termination=termination, metadata=metadata)


def _start(ledger: ChatLedger, chat: ChatTokenizer) -> tuple[list[int], bool, str]:
    """Turn 0's prompt ids; whether its generation prompt opens reasoning (``<think>``, so
    the output starts inside it); the role observations are sent in."""
    ids = ledger.start()
    gen = chat.render(ledger.messages, add_generation_prompt=True, tools=ledger.tools)
    return ids, gen.rstrip().endswith(THINK_OPEN), chat.observation_role


async def _generate(llm: LLMClient, request: GenerateRequest, deadline: float,
                    index: int) -> tuple[GenerateResult | None, int]:
    """One turn, re-issued while weight swaps cut it; (result or None at the deadline, number
    of discarded attempts). Every attempt carries the time left as ``timeout_s``."""
    retries = 0
    while True:
        attempt = dataclasses.replace(request, timeout_s=max(0.0, deadline - time.monotonic()))
        result: GenerateResult | None = await _before(deadline + DEADLINE_GRACE_S,
                                                      llm.generate(attempt))
        if result is None or result.finish_reason != "preempted":
            return result, retries
        retries += 1
        log.info("turn %d of %s cut by a weight swap (attempt %d); re-issuing", index,
                 request.session_id, retries)
        if retries > MAX_PREEMPTED_RETRIES:
            raise TurnPreempted(
                f"turn {index} was cut by a weight swap {retries} times in a row (limit "
                f"{MAX_PREEMPTED_RETRIES} re-issues); its tokens would mix policies, so the job "
                "fails instead of training on them")


def _as_one_message(observations: Sequence[Mapping[str, Any]],
                    role: str) -> list[dict[str, Any]]:
    """A turn's tool results as one message in ``role``, for templates without a tool role
    (consecutive user messages would break templates that insist on alternating roles)."""
    parts = [f"[{o['name']} result]\n{o['content']}" if o.get("name") else str(o["content"])
             for o in observations]
    return [{"role": role, "content": "\n\n".join(parts)}] if parts else []


def _response_room(limit: int | None, turns: Sequence[Turn]) -> int:
    """Tokens the model may still generate under ``sampling.max_response_tokens``."""
    if limit is None:
        return 1 << 62
    return limit - sum(len(t.output_ids) for t in turns)


def _limit_reason(budget: int, limit_ctx: int | None) -> TerminationReason:
    if limit_ctx is not None and limit_ctx < budget:
        return TerminationReason.CONTEXT_LENGTH
    return TerminationReason.TOKEN_BUDGET


async def _before(deadline: float, call: Any) -> Any:
    """Await ``call`` unless the deadline passes first (then cancel it and return None).

    A ``TimeoutError`` raised by ``call`` itself (a tool's own timeout) is not the deadline
    and propagates.
    """
    try:
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())) as scope:
            return await call
    except TimeoutError:
        if scope.expired():
            return None
        raise


async def _run_calls(calls: Sequence[ToolCall | ToolCallError], by_name: Mapping[str, Tool],
                     deadline: float, max_chars: int, turn: Turn,
                     ) -> tuple[list[dict[str, Any]], bool, bool]:
    """Run the turn's calls in order; returns (tool messages, finished, deadline hit).

    Calls after a finishing call are not run: the episode is over.
    """
    observations: list[dict[str, Any]] = []
    for call in calls:
        if isinstance(call, ToolCallError):
            observations.append(_tool_message("", f"Error: could not parse tool call: "
                                                  f"{call.message}", max_chars))
            continue
        turn.tool_calls.append(call.name)
        tool = by_name.get(call.name)
        if tool is None:
            known = ", ".join(sorted(by_name)) or "none"
            observations.append(_tool_message(call.name, f"Error: unknown tool {call.name!r}. "
                                                         f"Available tools: {known}.", max_chars))
            continue
        try:
            result: ToolResult | None = await _before(deadline, tool(call.arguments))
        except Exception as e:  # a crashing tool is an observation, not a crashed job
            result = ToolResult(f"Error: tool {call.name} failed: {type(e).__name__}: {e}",
                                is_error=True)
        if result is None:
            return observations, False, True
        observations.append(_tool_message(call.name, result.output, max_chars))
        if result.finish:
            return observations, True, False
    return observations, False, False


def _tool_message(name: str, content: str, max_chars: int) -> dict[str, Any]:
    if len(content) > max_chars:
        half = max_chars // 2
        content = (f"{content[:half]}\n[... {len(content) - 2 * half} characters cut ...]\n"
                   f"{content[-half:]}")
    message: dict[str, Any] = {"role": "tool", "content": content}
    if name:
        message["name"] = name
    return message


def _report(ctx: JobContext, turns: Sequence[Turn], total_tokens: int, tool_s: float) -> None:
    """One ``turn`` progress event for the last of ``turns``, with running totals of the
    attempt (``turns_done``, ``generated_tokens``, ``tool_calls_total``) so a display can move
    with the model's output without keeping per-job state."""
    turn = turns[-1]
    ctx.progress("turn", {
        "turn": len(turns) - 1, "turns_done": len(turns),
        "generated_tokens": sum(len(t.output_ids) for t in turns),
        "tool_calls_total": sum(len(t.tool_calls) for t in turns),
        "output_tokens": len(turn.output_ids), "total_tokens": total_tokens,
        "finish_reason": turn.finish_reason, "tool_calls": list(turn.tool_calls),
        "preempted_retries": turn.preempted_retries,
        "latency_s": round(turn.latency_s, 4), "tool_s": round(tool_s, 4),
        "policy_version": turn.policy_version, "backend": turn.backend})

