"""One job's side of the gateway: its requests become exact token ids, turns and segments.

The harness resends its whole conversation with every request. Rendering that again and
tokenizing it would re-tokenize the model's own output (BPE has many spellings of one string),
so the trainer would score tokens the policy never sampled. Instead, per job:

- the ids of the last prompt plus the model's output are kept exactly (a
  :class:`~rollout.runtime.tokens.ChatLedger` per segment), with the messages that produced
  them and the assistant message the gateway answered with;
- a request whose messages start with exactly those messages (compared by
  :meth:`Message.key`) extends the segment: only its new messages are rendered and appended
  (:meth:`ChatLedger.add_messages`, the same delta rule as the built-in agent loop);
- anything else (the harness summarised, dropped or edited a message, or changed its tools)
  starts a new segment from a fresh render, recorded as
  :attr:`~rollout.runtime.types.SegmentReason.HISTORY_REWRITTEN`;
- a request that repeats the messages of one whose generation failed (a client retry) reuses
  that prompt, so a transient failure does not split the trajectory.

Turns follow the house convention (``runtime.types.Turn``): a segment's first turn carries its
whole prompt, later turns the ids appended before them (the closing of the previous assistant
turn and the new messages go to the previous turn's ``observation_ids``, the generation prompt
to the turn's ``prompt_ids``), so each segment's ids are the concatenation of its turns'.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import random
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollout.runtime.agent_loop import MAX_DRAWN_SEED, MAX_PREEMPTED_RETRIES, context_length_of
from rollout.runtime.gateway import GatewayOptions, HarnessCapture
from rollout.runtime.llm import GenerateRequest, GenerateResult, LLMClient, LLMUnavailable
from rollout.runtime.tokens import ChatLedger, ChatTokenizer
from rollout.runtime.toolcalls import (
    MISTRAL_TAG,
    OPEN,
    PYTHON_TAG,
    THINK_OPEN,
    TOOL_CALL_FORMATS,
    detect_format,
    parse_tool_calls,
    strip_reasoning,
    write_tool_calls,
)
from rollout.runtime.tools.base import ToolCall
from rollout.runtime.types import JobSpec, Segment, SegmentReason, Turn
from rollout.server.gateway.messages import BadRequest, CallItem, ChatRequest, Message

log = logging.getLogger(__name__)

DEADLINE_MARGIN_S = 1.0
"""A turn is given the time to the job's RUN deadline minus this, so its partial output
reaches the harness (and the trajectory) before the scheduler cancels RUN."""

_LLAMA_CALL = re.compile(r'\{\s*"(name|function)"\s*:')


@dataclass
class ServedTurn:
    """What one served request produced, for the API layer to write in its own format."""

    content: str
    reasoning: str
    tool_calls: list[CallItem]
    finish_reason: str
    """``stop``, ``length`` (max tokens, or the job's deadline cut the turn) or
    ``tool_calls``."""
    prompt_tokens: int
    completion_tokens: int
    turn: Turn


@dataclass
class _Segment:
    ledger: ChatLedger
    expected: list[tuple[Any, ...]]
    """Keys of the messages a request must start with to extend this segment."""
    tools_key: str
    reasoning_opened: bool
    pending: list[tuple[Any, ...]] | None = None
    """Keys of a request whose prompt is in the ledger but whose generation failed."""
    pending_prompt: list[int] = dataclasses.field(default_factory=list)
    counted: bool = False
    """Whether the segment has a turn (and so an entry in the capture's segments)."""


class JobConversation:
    """The gateway's state for one job (one lease). Requests are served one at a time."""

    def __init__(self, spec: JobSpec, llm: LLMClient, *, deadline: float,
                 options: GatewayOptions | None = None) -> None:
        self.spec = spec
        self.options = options or GatewayOptions()
        self.llm = llm
        self.deadline = deadline
        """``time.monotonic()`` time the job's RUN ends."""
        self.capture = HarnessCapture()
        seed = spec.sampling.seed
        self._seed = seed if seed is not None else random.SystemRandom().randint(
            0, MAX_DRAWN_SEED)
        self._lock = asyncio.Lock()
        self._chat: ChatTokenizer | None = None
        self._fmt = ""
        self._observation_role = "tool"
        self._segment: _Segment | None = None
        self._context_length = context_length_of(llm)

    @property
    def model_name(self) -> str:
        name = getattr(self.llm, "model_name", "") or getattr(
            self.llm.tokenizer, "name_or_path", "")
        # The last path component only: a sandboxed harness learns nothing of the host's paths.
        return os.path.basename(str(name).rstrip("/")) or "rollout-policy"

    async def serve(self, request: ChatRequest) -> ServedTurn:
        async with self._lock:
            if self._chat is None:
                try:
                    await asyncio.to_thread(self._load_chat)
                except BadRequest:
                    raise
                except Exception as exc:  # a template unfit for token-exact rendering
                    raise BadRequest(f"the served model's chat template cannot be used: "
                                     f"{type(exc).__name__}: {exc}", status=500,
                                     code="template_error") from exc
            return await self._serve(request)

    def finish(self) -> None:
        """The lease is closing: drop the delta of a request that never got its turn (a
        failed or cut generation), so each segment ends with what the model produced."""
        self._drop_pending_delta()
        self._segment = None

    def _drop_pending_delta(self) -> None:
        seg = self._segment
        if seg is not None and seg.pending is not None and seg.counted and self.capture.turns:
            self.capture.turns[-1].observation_ids = []

    def _load_chat(self) -> None:
        chat = ChatTokenizer(self.llm.tokenizer,
                             template_kwargs=dict(self.spec.chat.template_kwargs))
        fmt = self.spec.chat.tool_call_format or detect_format(chat.template_source)
        if fmt not in TOOL_CALL_FORMATS:
            raise BadRequest(f"the job's tool-call format {fmt!r} is unknown", status=500,
                             code="bad_job")
        self._observation_role = chat.observation_role
        _ = chat.end_of_turn_ids
        self._chat, self._fmt = chat, fmt

    # ------------------------------------------------------------------ one request
    async def _serve(self, request: ChatRequest) -> ServedTurn:
        if len(self.capture.turns) >= self.spec.limits.max_turns:
            raise BadRequest(f"this job may make {self.spec.limits.max_turns} model requests "
                             "(its limits.max_turns); no more are served", code="max_turns")
        keys = [m.key() for m in request.messages]
        tools_key = request.tools_key()
        seg = self._segment
        new_segment = True
        prompt_ids: list[int] = []
        if seg is not None and seg.tools_key == tools_key:
            if seg.pending is not None and keys == seg.pending:
                new_segment, prompt_ids = False, seg.pending_prompt
            elif (seg.pending is None and len(keys) >= len(seg.expected)
                  and keys[:len(seg.expected)] == seg.expected):
                new_segment = False
                prompt_ids = await _rendering(asyncio.to_thread(
                    self._extend, seg, request, request.messages[len(seg.expected):]))
        if new_segment:
            self._drop_pending_delta()
            seg = await _rendering(asyncio.to_thread(self._fresh, request, tools_key))
            self._segment = seg
            prompt_ids = list(seg.ledger.token_ids)
        assert seg is not None
        seg.pending, seg.pending_prompt = keys, prompt_ids
        total = len(seg.ledger.token_ids)
        limit = self.spec.sampling.total_token_budget
        if self._context_length:
            limit = min(limit, self._context_length)
        room = limit - total
        if room <= 0:
            self._drop_pending_delta()
            self._segment = None  # nothing of this prompt can be generated from
            raise BadRequest(f"the prompt is {total} tokens; this job allows {limit} in one "
                             "sequence (its sampling.total_token_budget or the model's context)",
                             param="messages", code="context_length_exceeded")
        wanted = request.max_tokens or self.spec.sampling.max_tokens_per_turn
        max_tokens = max(1, min(wanted, self.spec.sampling.max_tokens_per_turn, room))
        started = time.monotonic()
        index = len(self.capture.turns)
        result, retries = await self._generate(seg.ledger.token_ids, request, max_tokens, index)
        turn = Turn(prompt_ids=list(prompt_ids), output_ids=list(result.output_ids),
                    output_logprobs=list(result.logprobs), policy_version=result.policy_version,
                    finish_reason=result.finish_reason, backend=result.backend,
                    latency_s=time.monotonic() - started, preempted_retries=retries,
                    logprobs_kind=result.logprobs_kind)
        text = await asyncio.to_thread(seg.ledger.add_output, turn.output_ids)
        answer = self._answer(text, request, result, seg, turn, total)
        if not seg.counted:
            reason = SegmentReason.FIRST if not self.capture.turns else \
                SegmentReason.HISTORY_REWRITTEN
            self.capture.segments.append(Segment(len(self.capture.turns), reason))
            seg.counted = True
        if self.capture.seed is None:
            self.capture.seed = self._seed
        self.capture.turns.append(turn)
        self.capture.requests += 1
        seg.pending, seg.pending_prompt = None, []
        seg.expected = [*keys, Message("assistant", answer.content,
                                       tuple(answer.tool_calls)).key()]
        return answer

    def _fresh(self, request: ChatRequest, tools_key: str) -> _Segment:
        chat = self._chat
        assert chat is not None
        messages, template_tools = self._template(request.messages, request, first=True)
        ledger = ChatLedger(chat, messages, template_tools)
        ledger.start()
        generation = chat.render(messages, add_generation_prompt=True, tools=template_tools)
        return _Segment(ledger, [], tools_key, generation.rstrip().endswith(THINK_OPEN))

    def _extend(self, seg: _Segment, request: ChatRequest,
                new_messages: Sequence[Message]) -> list[int]:
        converted, _ = self._template(new_messages, request, first=False)
        delta = seg.ledger.add_messages(converted)
        if self.capture.turns and seg.counted:
            self.capture.turns[-1].observation_ids = list(delta.observation_ids)
        return list(delta.prompt_ids)

    def _template(self, messages: Sequence[Message], request: ChatRequest, *, first: bool,
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The template's form of ``messages``: tools listed in the system prompt in the model
        family's format where the template cannot render them, earlier calls written the same
        way, tool results as ``user`` messages where the template has no tool role."""
        chat = self._chat
        assert chat is not None
        in_template = chat.supports_tools
        names = {c.id: c.name for m in request.messages for c in m.tool_calls}
        out: list[dict[str, Any]] = []
        for m in messages:
            if m.role == "assistant":
                entry: dict[str, Any] = {"role": "assistant", "content": m.content}
                if m.tool_calls and in_template:
                    entry["tool_calls"] = [
                        {"id": c.id, "type": "function",
                         "function": {"name": c.name, "arguments": c.parsed_arguments()}}
                        for c in m.tool_calls]
                elif m.tool_calls:
                    calls = write_tool_calls([(c.name, c.parsed_arguments())
                                              for c in m.tool_calls], self._fmt)
                    entry["content"] = f"{m.content}\n{calls}" if m.content else calls
                out.append(entry)
            elif m.role == "tool":
                name = m.name or names.get(m.tool_call_id, "")
                if self._observation_role == "tool":
                    entry = {"role": "tool", "content": m.content}
                    if name:
                        entry["name"] = name
                    if m.tool_call_id:
                        entry["tool_call_id"] = m.tool_call_id
                    out.append(entry)
                    continue
                block = f"[{name} result]\n{m.content}" if name else m.content
                if out and out[-1].get("_merged"):  # one user message per run of results
                    out[-1]["content"] += "\n\n" + block
                else:
                    out.append({"role": self._observation_role, "content": block,
                                "_merged": True})
            else:
                out.append({"role": m.role, "content": m.content})
        for entry in out:
            entry.pop("_merged", None)
        if not request.tools or in_template:
            return out, (list(request.tools) if request.tools and in_template else None)
        if first:
            block = TOOL_CALL_FORMATS[self._fmt].instructions(request.tools)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out, None

    async def _generate(self, prompt: Sequence[int], request: ChatRequest, max_tokens: int,
                        index: int) -> tuple[GenerateResult, int]:
        spec = self.spec
        stop = tuple(dict.fromkeys((*spec.sampling.stop, *request.stop)))
        sampling = dataclasses.replace(spec.sampling, stop=stop)
        retries = 0
        while True:
            left = self.deadline - DEADLINE_MARGIN_S - time.monotonic()
            if left <= 0:
                raise BadRequest("the job's RUN deadline has passed", status=504,
                                 code="deadline_exceeded")
            try:
                result = await self.llm.generate(GenerateRequest(
                    prompt_ids=list(prompt), sampling=sampling, max_tokens=max_tokens,
                    session_id=spec.job_id, group_id=spec.group_id,
                    min_policy_version=spec.min_policy_version, seed=self._seed + index,
                    timeout_s=left))
            except LLMUnavailable as exc:
                raise BadRequest(f"no model backend could serve the request: {exc}",
                                 status=503, code="backend_unavailable") from exc
            if result.finish_reason == "abort":
                raise BadRequest("the job's generation was aborted (the job is ending)",
                                 status=503, code="aborted")
            if result.finish_reason == "deadline" and not result.output_ids:
                raise BadRequest("the job's RUN deadline arrived before any token",
                                 status=504, code="deadline_exceeded")
            if result.finish_reason != "preempted":
                return result, retries
            retries += 1
            if retries > MAX_PREEMPTED_RETRIES:
                raise BadRequest(f"weight swaps cut this turn {retries} times; its tokens would "
                                 "mix policies", status=503, code="turn_preempted")

    def _answer(self, text: str, request: ChatRequest, result: GenerateResult, seg: _Segment,
                turn: Turn, prompt_tokens: int) -> ServedTurn:
        visible = strip_reasoning(text, opened=seg.reasoning_opened)
        reasoning = text[:len(text) - len(visible)] if text.endswith(visible) else ""
        calls: list[CallItem] = []
        if request.tools and request.tool_choice != "none":
            allowed = {t["function"]["name"] for t in request.tools}
            parsed = parse_tool_calls(visible, self._fmt, fence_tools=())
            calls = [CallItem(f"call_{uuid.uuid4().hex[:24]}", p.name, _json(p))
                     for p in parsed if isinstance(p, ToolCall) and p.name in allowed]
        content = _before_calls(visible, self._fmt) if calls else visible
        turn.tool_calls = [c.name for c in calls]
        finish = "tool_calls" if calls else (
            "length" if result.finish_reason in ("length", "deadline") else "stop")
        return ServedTurn(content=content.strip(), reasoning=reasoning, tool_calls=calls,
                      finish_reason=finish, prompt_tokens=prompt_tokens,
                      completion_tokens=len(result.output_ids), turn=turn)


async def _rendering(call: Any) -> Any:
    """Await a render; a template that rejects the messages is the request's fault (400)."""
    try:
        return await call
    except BadRequest:
        raise
    except Exception as exc:  # jinja2 errors, raise_exception(...) in templates, ChatTemplateError
        raise BadRequest(f"the model's chat template cannot render these messages: "
                         f"{type(exc).__name__}: {exc}", param="messages",
                         code="template_error") from exc


def _json(call: ToolCall) -> str:
    return json.dumps(dict(call.arguments), ensure_ascii=False)


def _before_calls(text: str, fmt: str) -> str:
    """The text the model wrote before its first call (the call markup goes to tool_calls)."""
    marks = {"hermes": [OPEN], "mistral": [MISTRAL_TAG], "llama3": [PYTHON_TAG]}[fmt]
    cut = [i for i in (text.find(m) for m in marks) if i != -1]
    if fmt == "llama3":
        m = _LLAMA_CALL.search(text)
        if m:
            cut.append(m.start())
    return text[:min(cut)] if cut else text
