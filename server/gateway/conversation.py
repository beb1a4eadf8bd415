"""One job's side of the gateway: its requests become exact token ids, turns and chains.

The harness resends its whole conversation with every request. Rendering that again and
tokenizing it would re-tokenize the model's own output (BPE has many spellings of one string),
so the trainer would score tokens the policy never sampled. Instead, per job, the gateway keeps
several **chains**, each an exact token sequence (a :class:`~rollout.runtime.tokens.ChatLedger`)
with the messages that produced it and the assistant messages it answered with:

- a request whose messages start with exactly a chain's recorded messages (compared by
  :meth:`Message.key`: role, text, tool calls by name and arguments) and whose tools list is
  the chain's extends that chain: only its new messages are rendered and appended (the same
  delta rule as the built-in agent loop), so a main thread that resumes after a sub-agent
  continues its own chain;
- a request that extends none (a rewritten history, a sub-agent's own conversation, a side
  call, a second call from a history another call is generating on) starts a new chain from a
  fresh render, recording the chain it shares the most leading messages with (its parent) and
  after which of the parent's turns it branched;
- a request identical to the last one answered on a chain is a retry whose answer never
  reached the harness: it gets that answer again, and no new turn; an identical request whose
  generation is still running waits for it rather than generating twice;
- a generation that fails or is cancelled (the client disconnected, the lease closed) rolls
  its chain back: it leaves no turn and no tokens.

Only preparation (matching and rendering) is serialised by the job's lock; generations of one
job overlap, up to ``GatewayOptions.max_concurrent``; a commit runs without awaiting, so it is
atomic. Each chain is one :class:`~rollout.runtime.types.Segment`; the capture's turns are kept
grouped by chain (chains in the order they began), so every segment is a contiguous run of
turns whatever the order requests arrived in. Every sampled token is the output of exactly one
turn, the only place it carries loss mask 1: context a chain repeats from another one is
prompt there.

Turns follow the house convention (``runtime.types.Turn``): a chain's first turn carries its
whole prompt, later turns the ids appended before them (the closing of the previous assistant
turn and the new messages go to the previous turn's ``observation_ids``, the generation prompt
to the turn's ``prompt_ids``), so each chain's ids are the concatenation of its turns'.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import random
import re
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout.runtime.agent_loop import MAX_DRAWN_SEED, MAX_PREEMPTED_RETRIES, context_length_of
from rollout.runtime.gateway import GatewayOptions, HarnessCapture
from rollout.runtime.llm import (
    GenerateRequest,
    GenerateResult,
    LLMClient,
    LLMUnavailable,
    stream_generate,
)
from rollout.runtime.tokens import ChatLedger, ChatTokenizer, LedgerMark
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
from rollout.server.gateway import budget
from rollout.server.gateway.messages import BadRequest, CallItem, ChatRequest, Message

log = logging.getLogger(__name__)

DEADLINE_MARGIN_S = 1.0
"""A turn is given the time to the job's RUN deadline minus this, so its partial output
reaches the harness (and the trajectory) before the scheduler cancels RUN."""

_LLAMA_CALL = re.compile(r'\{\s*"(name|function)"\s*:')

_SHARED_CHATS: weakref.WeakKeyDictionary[Any, dict[tuple[str, str], ChatTokenizer]] = (
    weakref.WeakKeyDictionary())
"""Per served tokenizer, its :class:`ChatTokenizer` by template and template arguments: made
and probed (tool role, end-of-turn ids) once, then used by every job (it holds no
conversation's state), so a job's first request neither probes again nor waits for a
thread to do it."""

Key = tuple[Any, ...]
Ident = tuple[str, bool, tuple[Key, ...]]
"""What makes two requests the same request: tools, side-call flag, messages."""


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
    """The whole prompt the model saw (the chain's ids before this turn's output)."""
    completion_tokens: int
    turn: Turn
    alternatives: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per output token, the most likely tokens ``(id, logprob)`` best first, as many as the
    request that generated it asked for (``top_logprobs``); kept with the answer, not in the
    trajectory, so a retry is answered with them too."""
    sampled: list[SampledToken] = field(default_factory=list)
    """Each output token's text, logprob and alternatives, end-of-turn tokens left out; filled
    only for a request that asks for ``logprobs``."""


@dataclass(frozen=True)
class SampledToken:
    """One output token as an API's ``logprobs`` shows it: its text (the tokenizer's decoding
    of its one id, never a re-tokenization of the answer), its logprob, and the most likely
    tokens of its step as ``(text, logprob)`` best first."""

    text: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class TextDelta:
    """A piece of a streamed answer's text, sent before the turn ends."""

    text: str
    prompt_tokens: int
    """The prompt's length (a stream's opening event reports it)."""


Piece = TextDelta | ServedTurn
"""What a dialect's stream is made from: text pieces as they come, then the answer."""

Listener = Callable[[TextDelta], None]
"""Takes each piece of an answer's text as it is generated (``serve_streaming``)."""

_CALL_MARKS = {"hermes": (OPEN,), "mistral": (MISTRAL_TAG,), "llama3": (PYTHON_TAG, "{")}


_LIVE_CONTEXT = 8
"""Ids decoded again before a streamed piece's new ids, so a decoder's dependence on an
id's neighbours shows up (see :meth:`_LiveText._text`)."""


class _LiveText:
    """The part of a generating answer's text that is certainly the start of its final
    ``content``, so it can be sent before the turn ends without ever taking text back.

    The final content is the decoded output with leading reasoning removed, cut before the
    first tool call and stripped; so this holds back leading text that may still become a
    ``<think>`` block, everything from a possible call's first mark on (where the request
    has tools), trailing whitespace, and a trailing partial UTF-8 character. The text is
    decoded from the exact sampled ids, as the committed turn's is."""

    def __init__(self, chat: ChatTokenizer, strip: Callable[[list[int]], list[int]],
                 marks: Sequence[str]) -> None:
        self._chat = chat
        self._strip = strip
        self._marks = marks
        self._ids: list[int] = []
        self.sent = ""
        # A checkpoint: the text of ids[:_upto], decoded whole or grown from an earlier one.
        self._upto = 0
        self._upto_text = ""

    def feed(self, ids: Sequence[int]) -> str:
        """Take newly sampled ids; return the text that became safe to send (maybe "")."""
        self._ids.extend(ids)
        safe = self._safe(self._text())
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def _text(self) -> str:
        """The decoded output so far, without decoding it all again on every piece.

        An engine streams one token at a time, so decoding the whole output per piece costs
        the square of its length, on the event loop. Instead the new ids are decoded with a
        few ids of context before them, and the context's own text is cut off the front, so
        decoders whose text for an id depends on its neighbours (a leading space dropped,
        spaces cleaned before punctuation, a UTF-8 character split across ids) give the
        whole decode's text. A decoder that reaches further shows it as context text that
        does not match; that falls back to one whole decode, which restarts the checkpoint."""
        ids = self._ids
        start = max(0, self._upto - _LIVE_CONTEXT)
        tail = self._strip(ids[start:])
        whole: str | None = None
        if self._upto and len(tail) >= self._upto - start:
            before = self._chat.decode(ids[start:self._upto])
            text = self._chat.decode(tail)
            if text.startswith(before) and not before.endswith("\ufffd"):
                whole = self._upto_text + text[len(before):]
        if whole is None:
            tail = self._strip(ids)
            start = 0
            whole = self._chat.decode(tail)
        if not whole.endswith("\ufffd"):  # a split character is never a checkpoint
            self._upto, self._upto_text = start + len(tail), whole
        return whole

    def rest(self, content: str) -> str:
        """What of the final ``content`` is still to send."""
        if content.startswith(self.sent):
            return content[len(self.sent):]
        log.warning("streamed text is not a prefix of the answer's content (a re-issued "
                    "turn?); the rest is not sent")
        return ""

    def _safe(self, text: str) -> str:
        body = text.lstrip()
        if THINK_OPEN.startswith(body[:len(THINK_OPEN)]):
            return ""  # may still open a reasoning block (or is empty)
        cut = len(body)
        for mark in self._marks:
            found = body.find(mark)
            if found != -1:
                cut = min(cut, found)
            for k in range(min(len(mark) - 1, len(body)), 0, -1):
                if body.endswith(mark[:k]):  # the mark may be being written
                    cut = min(cut, len(body) - k)
                    break
        return body[:cut].rstrip().rstrip("\ufffd").rstrip()


INLINE_CHARS = 2048
"""A render whose text (new messages, tool schemas) is at most this many characters runs
on the event loop (see :class:`RenderPlacement`)."""


@dataclass(frozen=True)
class RenderPlacement:
    """Where a request's render runs: on the event loop or in a worker thread.

    A worker thread keeps the loop free while a render runs, but the hop there and back, and
    the wait for a turn in :func:`budget.fair_turn`, cost more than a small render itself. So
    a render runs on the loop when its cost is known to be small: it is ``bounded`` by its
    text (a fresh chain renders only the request; an extension renders a window of the
    history only once the template's :class:`~rollout.runtime.tokens.RenderPlan` is probed,
    a probe being a few dozen renders) and that text is short. Anything else takes the
    thread and its fair turn."""

    chars: int
    """Characters the render writes and tokenizes that grow with the request: message text
    (the new messages of an extension) and tool schemas."""
    bounded: bool
    """The render's cost follows ``chars`` (not the length of the chain's history, nor a
    probe still to run)."""

    def on_loop(self) -> bool:
        return self.bounded and self.chars <= INLINE_CHARS


@dataclass(eq=False)
class _Chain:
    order: int
    """Creation number: segments are in this order."""
    ledger: ChatLedger
    tools_key: str
    side_call: bool
    reasoning_opened: bool
    reason: SegmentReason
    parent: _Chain | None
    branch_point: int
    expected: list[Key] = field(default_factory=list)
    """Keys of the messages a request must start with to extend this chain: every request
    and answer it has committed."""
    turns: list[Turn] = field(default_factory=list)
    requests: list[list[Key]] = field(default_factory=list)
    """Each turn's request keys."""
    busy: bool = False
    """A generation is running on it (its ledger awaits that output)."""
    tip: tuple[Ident, ServedTurn] | None = None
    """The last request answered on it and the answer, for a retry of that request."""


@dataclass(eq=False)
class _Prepared:
    chain: _Chain
    ident: Ident
    keys: list[Key]
    prompt_ids: list[int]
    total: int
    max_tokens: int
    index: int
    """The request's number in the job (its seed is the job's seed plus this)."""
    mark: LedgerMark | None
    """Where to roll the chain back to; None for a new chain (dropped instead)."""
    previous_observation: list[int]
    settled: bool = False
    """Committed or abandoned (each happens once)."""
    reserved: int = 0
    """Response tokens this request holds of ``sampling.max_response_tokens`` while it
    generates (its ``max_tokens``); given back when it settles."""


@dataclass(frozen=True)
class ResponseRoom:
    """Where the job's ``sampling.max_response_tokens`` stands when a request arrives: the
    one decision of whether it is served now, waits, or is refused."""

    limit: int | None
    """The budget; None: no budget."""
    committed: int
    """Output tokens of the turns recorded so far (spent: never given back)."""
    reserved: int
    """Tokens held by generations still running (each may give back what it does not use)."""

    @property
    def left(self) -> int:
        return (1 << 62) if self.limit is None else self.limit - self.committed - self.reserved

    def verdict(self) -> str:
        """``"serve"``: tokens are free now. ``"wait"``: none are free, but running requests
        hold some, and whatever they do not use comes back. ``"spent"``: the recorded turns
        used it all; nothing can come back (a turn's output never exceeds what it held)."""
        if self.left > 0:
            return "serve"
        assert self.limit is not None
        return "spent" if self.committed >= self.limit else "wait"


@dataclass(eq=False)
class _Flight:
    task: asyncio.Task[ServedTurn]
    waiters: int = 0


class JobConversation:
    """The gateway's state for one job (one lease)."""

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
        self._slots = asyncio.Semaphore(self.options.max_concurrent)
        self._chat: ChatTokenizer | None = None
        self._fmt = ""
        self._observation_role = "tool"
        self._chains: list[_Chain] = []
        self._flights: dict[Ident, _Flight] = {}
        self._requests = 0
        """Requests given a generation so far (failed ones included: seeds never repeat)."""
        self._context_length = context_length_of(llm)
        self.generating = 0
        """Generations of this job running now (what the concurrency test watches)."""
        self._reserved = 0
        """Response tokens held by generations still running (see :meth:`_response_room`)."""
        self._budget_queue: deque[asyncio.Event] = deque()
        """Requests waiting for response tokens, in arrival order: only the first is woken
        when room comes back, and a request arriving while any waits queues behind them."""
        self.awaiting_budget = 0
        """Requests waiting now for running ones to give back response tokens."""

    @property
    def model_name(self) -> str:
        name = getattr(self.llm, "model_name", "") or getattr(
            self.llm.tokenizer, "name_or_path", "")
        # The last path component only: a sandboxed harness learns nothing of the host's paths.
        return os.path.basename(str(name).rstrip("/")) or "rollout-policy"

    async def serve(self, request: ChatRequest) -> ServedTurn:
        """Answer one request: from a retry's earlier answer, from a generation already
        running for the same request, or from a new generation on the chain it extends."""
        answer, _ = await self.serve_streaming(request, None)
        return answer

    async def serve_streaming(self, request: ChatRequest, listener: Listener | None,
                              ) -> tuple[ServedTurn, str]:
        """:meth:`serve`, giving ``listener`` the answer's text as it is generated where it
        is a new generation that can stream (see :class:`_LiveText`). Returns the answer and
        the part of its ``content`` the listener was not given."""
        keys = [m.key() for m in request.messages]
        side = self.options.is_side_call(request.model, request.system_text(),
                                         request.metadata, request.last_user_text())
        ident: Ident = (request.tools_key(), side, tuple(keys))
        live: list[_LiveText] = []
        answer = await self._answer_for(request, ident, keys, listener, live)
        rest = live[0].rest(answer.content) if live else answer.content
        if request.logprobs is not None:
            answer = self._with_logprobs(answer, request.logprobs)
        return answer, rest

    async def _answer_for(self, request: ChatRequest, ident: Ident, keys: list[Key],
                          listener: Listener | None = None,
                          live: list[_LiveText] | None = None) -> ServedTurn:
        ticket: asyncio.Event | None = None  # this request's place among the waiters
        try:
            while True:
                async with self._lock:
                    await self._ensure_chat()
                    await self._admit(request)  # before anything is tokenized
                    for chain in self._chains:
                        if chain.tip is not None and chain.tip[0] == ident:
                            return chain.tip[1]
                    flight = self._flights.get(ident)
                    if flight is None and self._must_wait(ticket):
                        # A request the job's turn limit refuses is refused now, not after
                        # its wait.
                        self._check_max_turns()
                        if ticket is None:
                            ticket = asyncio.Event()
                            self._budget_queue.append(ticket)
                        ticket.clear()
                    elif flight is None:
                        prepared = await self._prepare(request, ident, keys)
                        feed = None
                        if listener is not None and live is not None:
                            text = self._live_text(prepared.chain, request)
                            if text is not None:
                                live.append(text)
                                feed = _feeder(text, listener, prepared.total)
                        flight = _Flight(asyncio.ensure_future(
                            self._run(prepared, request, feed)))
                        flight.task.add_done_callback(functools.partial(self._settle, prepared))
                        self._flights[ident] = flight
                if flight is not None:
                    break
                # Outside the lock, so the holders settle and other requests are answered
                # meanwhile; then everything is decided again, as for a request just arrived.
                assert ticket is not None
                await self._await_freed(ticket)
        finally:
            if ticket is not None:
                self._leave_queue(ticket)
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.task)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if flight.task.cancelled() and task is not None and not task.cancelling():
                raise BadRequest("the job's generation was cancelled (the job is ending)",
                                 status=503, code="aborted") from None
            raise
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():
                # Nobody waits for this answer any more (the client went away): stop
                # generating it; the chain rolls back and no turn is recorded.
                flight.task.cancel()

    async def count_tokens(self, request: ChatRequest) -> int:
        """How many tokens ``request``'s prompt is when rendered on its own."""
        async with self._lock:
            await self._ensure_chat()
            await self._admit(request)
        ledger, _ = await _rendering(asyncio.to_thread(self._fresh, request))
        return len(ledger.token_ids)

    async def close(self) -> None:
        """The lease is closing: stop every generation still running (each rolls its chain
        back, so every chain ends with what the model produced)."""
        flights = [f.task for f in self._flights.values() if not f.task.done()]
        for task in flights:
            task.cancel()
        if flights:
            await asyncio.wait(flights, timeout=5.0)

    async def _admit(self, request: ChatRequest) -> None:
        """The cheap size check of :mod:`budget`; a refusal counts as the job's limit like the
        exact check after rendering (the harness's exit then reads as that limit, and the
        workspace is graded)."""
        try:
            await budget.admit(self.spec, self.llm, request)
        except BadRequest:
            self.capture.refused = (
                "token_budget" if budget.room_of(self.spec, self.llm)
                == self.spec.sampling.total_token_budget else "context_length")
            raise

    async def _ensure_chat(self) -> None:
        if self._chat is not None:
            return
        try:
            if self._shared_chat() is not None:
                self._load_chat()  # probed already: nothing left that is worth a thread
            else:
                await asyncio.to_thread(self._load_chat)
        except BadRequest:
            raise
        except Exception as exc:  # a template unfit for token-exact rendering
            raise BadRequest(f"the served model's chat template cannot be used: "
                             f"{type(exc).__name__}: {exc}", status=500,
                             code="template_error") from exc

    def _load_chat(self) -> None:
        chat = self._shared_chat() or ChatTokenizer(
            self.llm.tokenizer, template_kwargs=dict(self.spec.chat.template_kwargs))
        fmt = self.spec.chat.tool_call_format or detect_format(chat.template_source)
        if fmt not in TOOL_CALL_FORMATS:
            raise BadRequest(f"the job's tool-call format {fmt!r} is unknown", status=500,
                             code="bad_job")
        self._observation_role = chat.observation_role
        _ = chat.end_of_turn_ids
        self._chat, self._fmt = chat, fmt
        with contextlib.suppress(TypeError):  # a tokenizer without weak references: not shared
            _SHARED_CHATS.setdefault(self.llm.tokenizer, {})[self._chat_key()] = chat

    def _chat_key(self) -> tuple[str, str]:
        return (str(getattr(self.llm.tokenizer, "chat_template", "") or ""),
                json.dumps(dict(self.spec.chat.template_kwargs), sort_keys=True, default=repr))

    def _shared_chat(self) -> ChatTokenizer | None:
        """The served tokenizer's :class:`ChatTokenizer` for this job's template arguments,
        if an earlier job made it (and probed its template)."""
        try:
            known = _SHARED_CHATS.get(self.llm.tokenizer)
        except TypeError:
            return None
        return known.get(self._chat_key()) if known else None

    # ------------------------------------------------------------------ one request
    def _check_max_turns(self) -> None:
        """Refuse a request past ``limits.max_turns`` (recorded turns and running ones)."""
        if self.capture.requests + len(self._flights) >= self.spec.limits.max_turns:
            self.capture.refused = "max_turns"
            raise BadRequest(f"this job may make {self.spec.limits.max_turns} model requests "
                             "(its limits.max_turns); no more are served", code="max_turns")

    async def _prepare(self, request: ChatRequest, ident: Ident, keys: list[Key]) -> _Prepared:
        """Choose the request's chain and render its prompt there (under the job's lock)."""
        self._check_max_turns()
        tools_key, side, _ = ident
        extends = [c for c in self._chains if c.turns and c.tools_key == tools_key
                   and c.side_call == side and len(keys) > len(c.expected)
                   and keys[:len(c.expected)] == c.expected]
        joined = max(extends, key=lambda c: len(c.expected), default=None)
        mark: LedgerMark | None = None
        previous: list[int] = []
        if joined is not None and not joined.busy:
            chain = joined
            mark, previous = chain.ledger.mark(), chain.turns[-1].observation_ids
            chain.busy = True
            new_messages = request.messages[len(chain.expected):]
            try:
                if self._placement(chain, tools_key, new_messages).on_loop():
                    with _template_errors():
                        prompt_ids = self._extend(chain, request, new_messages)
                else:
                    prompt_ids = await _rendering(asyncio.to_thread(
                        self._extend, chain, request, new_messages))
            except BaseException:
                chain.ledger.rollback(mark)
                chain.turns[-1].observation_ids = previous
                chain.busy = False
                raise
        else:
            if joined is not None:
                parent: _Chain | None = joined
                reason, branch = SegmentReason.PARALLEL, len(joined.turns)
            else:
                parent, reason, branch = self._branch_of(keys)
            if self._fresh_placement(request, tools_key).on_loop():
                with _template_errors():
                    ledger, opened = self._fresh(request)
            else:
                ledger, opened = await _rendering(asyncio.to_thread(self._fresh, request))
            chain = _Chain(order=max((c.order for c in self._chains), default=-1) + 1,
                           ledger=ledger, tools_key=tools_key, side_call=side,
                           reasoning_opened=opened, reason=reason, parent=parent,
                           branch_point=branch, busy=True)
            self._chains.append(chain)
            prompt_ids = list(ledger.token_ids)
        total = len(chain.ledger.token_ids)
        limit = self.spec.sampling.total_token_budget
        if self._context_length:
            limit = min(limit, self._context_length)
        prepared = _Prepared(chain, ident, keys, prompt_ids, total, 0, self._requests, mark,
                             previous)
        if limit - total <= 0:
            self._abandon(prepared)
            self.capture.refused = ("token_budget" if limit == self.spec.sampling.total_token_budget
                                    else "context_length")
            raise BadRequest(f"the prompt is {total} tokens; this job allows {limit} in one "
                             "sequence (its sampling.total_token_budget or the model's context)",
                             param="messages", code="context_length_exceeded")
        room = self._response_room()
        # Under the lock since the caller saw "serve" or "spent": only releases (which add
        # room) ran meanwhile, so "wait" cannot come back here.
        if room.verdict() != "serve":
            self._abandon(prepared)
            self.capture.refused = "token_budget"
            raise BadRequest(f"this job's model has generated its "
                             f"{self.spec.sampling.max_response_tokens} tokens "
                             "(its sampling.max_response_tokens); no more are served",
                             code="context_length_exceeded")
        wanted = request.max_tokens or self.spec.sampling.max_tokens_per_turn
        prepared.max_tokens = max(1, min(wanted, self.spec.sampling.max_tokens_per_turn,
                                         limit - total, room.left))
        if self.spec.sampling.max_response_tokens is not None:
            # Reserved here, under the job's lock, before any await: a request generating in
            # parallel sees only what is left after this one's cap, so together they can never
            # sample more than the budget.
            prepared.reserved = prepared.max_tokens
            self._reserved += prepared.reserved
        self._requests += 1
        return prepared

    def _response_room(self) -> ResponseRoom:
        """Where ``sampling.max_response_tokens`` stands: the committed turns' output and what
        running requests hold (each holds its ``max_tokens`` until it settles, then gives back
        what it did not use)."""
        limit = self.spec.sampling.max_response_tokens
        committed = 0 if limit is None else sum(
            len(t.output_ids) for c in self._chains for t in c.turns)
        return ResponseRoom(limit, committed, self._reserved)

    def _release(self, prepared: _Prepared) -> None:
        """Give back ``prepared``'s reservation (its committed turn, if any, now counts) and
        wake the requests waiting for room."""
        if prepared.reserved:
            self._reserved -= prepared.reserved
            prepared.reserved = 0
            if self._budget_queue:
                self._budget_queue[0].set()

    def _must_wait(self, ticket: asyncio.Event | None) -> bool:
        """Whether a request (``ticket``: its place among the waiters, if it has one) waits
        for response tokens: none are free but some are held, or some are free and requests
        that came before it are waiting for them (they are served in arrival order)."""
        verdict = self._response_room().verdict()
        if verdict != "serve":
            return verdict == "wait"  # spent: refused by _prepare, whatever the order
        return bool(self._budget_queue) and self._budget_queue[0] is not ticket

    def _leave_queue(self, ticket: asyncio.Event) -> None:
        """``ticket``'s request stops waiting (served, refused, answered otherwise, or gone):
        the next in line is woken if there is room (or none will come) for it to see."""
        with contextlib.suppress(ValueError):
            self._budget_queue.remove(ticket)
        if self._budget_queue and self._response_room().verdict() != "wait":
            self._budget_queue[0].set()

    async def _await_freed(self, ticket: asyncio.Event) -> None:
        """Wait until this request is first in line and a running request has given tokens
        back. The wait ends with the job's run at the latest; the client going away (or the
        lease closing) cancels it."""
        self.awaiting_budget += 1
        try:
            await asyncio.wait_for(ticket.wait(), max(
                0.0, self.deadline - DEADLINE_MARGIN_S - time.monotonic()))
        except TimeoutError:
            raise BadRequest("the job's RUN deadline has passed while this request waited for "
                             "response tokens its running requests hold "
                             "(sampling.max_response_tokens)", status=504,
                             code="deadline_exceeded") from None
        finally:
            self.awaiting_budget -= 1

    def _branch_of(self, keys: list[Key]) -> tuple[_Chain | None, SegmentReason, int]:
        """The chain a new one branches from: the one sharing the most leading messages, and
        how many of its turns the shared part covers."""
        best, shared = None, 0
        for chain in self._chains:
            if not chain.turns:
                continue
            n = _common_prefix(keys, chain.expected)
            if n > shared:
                best, shared = chain, n
        if best is None:
            return None, SegmentReason.NEW_CONVERSATION, 0
        # Turn t's context ends with its answer: request t's messages plus one.
        covered = sum(1 for r in best.requests if len(r) + 1 <= shared)
        return best, SegmentReason.HISTORY_REWRITTEN, covered

    def _placement(self, chain: _Chain, tools_key: str,
                   new_messages: Sequence[Message]) -> RenderPlacement:
        """An extension renders the history's window (when its plan is probed) and the new
        messages, and tokenizes the new messages."""
        plan = chain.ledger.known_plan()
        return RenderPlacement(
            chars=budget.request_chars(new_messages) + len(tools_key),
            bounded=plan is not None and plan.window)

    def _fresh_placement(self, request: ChatRequest, tools_key: str) -> RenderPlacement:
        """A fresh chain renders and tokenizes every message of the request."""
        return RenderPlacement(chars=budget.request_chars(request.messages) + len(tools_key),
                               bounded=True)

    def _live_text(self, chain: _Chain, request: ChatRequest) -> _LiveText | None:
        """How a streamed answer on ``chain`` is sent as it comes; None: at the end (the
        template opened reasoning, or the request wants each token's logprob with its text)."""
        chat = self._chat
        if chat is None or chain.reasoning_opened or request.logprobs is not None:
            return None
        marks = _CALL_MARKS[self._fmt] if request.tools and request.tool_choice != "none" \
            else ()
        return _LiveText(chat, chain.ledger.strip_end_of_turn, marks)

    async def _run(self, prepared: _Prepared, request: ChatRequest,
                   feed: Callable[[Sequence[int]], None] | None = None) -> ServedTurn:
        try:
            async with self._slots:
                self.generating += 1
                started = time.monotonic()
                try:
                    result, retries = await self._generate(
                        prepared.chain.ledger.token_ids, request, prepared.max_tokens,
                        prepared.index, feed)
                finally:
                    self.generating -= 1
        except BaseException:
            self._abandon(prepared)
            raise
        finally:
            self._flights.pop(prepared.ident, None)
        return self._commit(prepared, request, result, retries, time.monotonic() - started)

    def _settle(self, prepared: _Prepared, _: asyncio.Task[ServedTurn]) -> None:
        self._abandon(prepared)

    def _abandon(self, prepared: _Prepared) -> None:
        """The request gets no turn: undo what preparing it appended. Also the task's done
        callback, for a task cancelled before it ran (then no ``finally`` of it runs)."""
        if prepared.settled:
            return
        prepared.settled = True
        self._release(prepared)
        if self._flights.get(prepared.ident) is not None and (
                self._flights[prepared.ident].task.done()):
            self._flights.pop(prepared.ident, None)
        chain = prepared.chain
        chain.busy = False
        if prepared.mark is None:
            self._chains.remove(chain)
            return
        chain.ledger.rollback(prepared.mark)
        chain.turns[-1].observation_ids = prepared.previous_observation

    def _commit(self, prepared: _Prepared, request: ChatRequest, result: GenerateResult,
                retries: int, latency_s: float) -> ServedTurn:
        """Record the turn; no await inside, so a commit is never interleaved."""
        prepared.settled = True
        self._release(prepared)
        chain = prepared.chain
        turn = Turn(prompt_ids=list(prepared.prompt_ids), output_ids=list(result.output_ids),
                    output_logprobs=list(result.logprobs), policy_version=result.policy_version,
                    finish_reason=result.finish_reason, backend=result.backend,
                    latency_s=latency_s, preempted_retries=retries,
                    logprobs_kind=result.logprobs_kind, trained=not chain.side_call,
                    routed_experts=list(result.routed_experts),
                    routed_expert_top_k=result.routed_expert_top_k,
                    routed_expert_layers=result.routed_expert_layers)
        text = chain.ledger.add_output(turn.output_ids)
        answer = self._answer(text, request, result, chain, turn, prepared.total)
        chain.turns.append(turn)
        chain.requests.append(prepared.keys)
        chain.expected = [*prepared.keys, Message("assistant", answer.content,
                                                  tuple(answer.tool_calls)).key()]
        chain.tip = (prepared.ident, answer)
        chain.busy = False
        if self.capture.seed is None:
            self.capture.seed = self._seed
        self.capture.requests += 1
        self._publish()
        return answer

    def _publish(self) -> None:
        """Lay the chains out in the capture's lists (in place: a handler holds them live):
        each chain's turns together, chains in creation order."""
        chains = sorted((c for c in self._chains if c.turns), key=lambda c: c.order)
        number = {id(c): i for i, c in enumerate(chains)}
        turns: list[Turn] = []
        segments: list[Segment] = []
        for chain in chains:
            parent = number.get(id(chain.parent)) if chain.parent is not None else None
            segments.append(Segment(
                len(turns), SegmentReason.FIRST if not segments else chain.reason,
                parent=parent, branch_point=chain.branch_point if parent is not None else 0,
                side_call=chain.side_call))
            turns.extend(chain.turns)
        self.capture.turns[:] = turns
        self.capture.segments[:] = segments

    def _fresh(self, request: ChatRequest) -> tuple[ChatLedger, bool]:
        chat = self._chat
        assert chat is not None
        messages, template_tools = self._template(request.messages, request, first=True)
        ledger = ChatLedger(chat, messages, template_tools, check_append_only=False)
        generation = chat.render(messages, add_generation_prompt=True, tools=template_tools)
        ledger.start(rendered=generation)
        return ledger, generation.rstrip().endswith(THINK_OPEN)

    def _extend(self, chain: _Chain, request: ChatRequest,
                new_messages: Sequence[Message]) -> list[int]:
        converted, _ = self._template(new_messages, request, first=False)
        delta = chain.ledger.add_messages(converted)
        chain.turns[-1].observation_ids = list(delta.observation_ids)
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
            elif m.role == "system" and (out or not first):
                # A system message inside the conversation (Claude Code's reminders): many
                # templates refuse a system turn that is not first, so it is said as a user
                # turn; an empty one (a directive without text) says nothing.
                if m.content:
                    out.append({"role": "user", "content": m.content})
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
                        index: int, feed: Callable[[Sequence[int]], None] | None = None,
                        ) -> tuple[GenerateResult, int]:
        spec = self.spec
        stop = tuple(dict.fromkeys((*spec.sampling.stop, *request.stop)))
        sampling = spec.sampling if stop == spec.sampling.stop else dataclasses.replace(
            spec.sampling, stop=stop)
        retries = 0
        while True:
            left = self.deadline - DEADLINE_MARGIN_S - time.monotonic()
            if left <= 0:
                raise BadRequest("the job's RUN deadline has passed", status=504,
                                 code="deadline_exceeded")
            turn = GenerateRequest(
                prompt_ids=list(prompt), sampling=sampling, max_tokens=max_tokens,
                session_id=spec.job_id, group_id=spec.group_id,
                min_policy_version=spec.min_policy_version, seed=self._seed + index,
                timeout_s=left, top_logprobs=request.logprobs or 0)
            try:
                result = await (self.llm.generate(turn) if feed is None
                                else _streamed(self.llm, turn, feed))
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

    def _answer(self, text: str, request: ChatRequest, result: GenerateResult, chain: _Chain,
                turn: Turn, prompt_tokens: int) -> ServedTurn:
        visible = strip_reasoning(text, opened=chain.reasoning_opened)
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
        return ServedTurn(content=content.strip(), reasoning=reasoning.strip(), tool_calls=calls,
                          finish_reason=finish, prompt_tokens=prompt_tokens,
                          completion_tokens=len(result.output_ids), turn=turn,
                          alternatives=list(result.top_logprobs))

    def _with_logprobs(self, answer: ServedTurn, top: int) -> ServedTurn:
        """``answer`` with each sampled token's text and logprob (the end-of-turn tokens left
        out) and up to ``top`` alternatives, for a request that asks for ``logprobs``. Texts
        are the tokenizer's decoding of each id."""
        chat = self._chat
        if answer.sampled or chat is None:
            return answer
        ends = chat.end_of_turn_ids | chat.special_ids
        kept = list(answer.turn.output_ids)
        while kept and kept[-1] in ends:
            kept.pop()
        alternatives = answer.alternatives or [[] for _ in kept]
        return dataclasses.replace(answer, sampled=[
            SampledToken(chat.decode([i]), lp, tuple((chat.decode([o]), v)
                                                     for o, v in options[:top]))
            for i, lp, options in zip(kept, answer.turn.output_logprobs, alternatives,
                                      strict=False)])


def _feeder(text: _LiveText, listener: Listener,
            prompt_tokens: int) -> Callable[[Sequence[int]], None]:
    def feed(ids: Sequence[int]) -> None:
        delta = text.feed(ids)
        if delta:
            listener(TextDelta(delta, prompt_tokens))
    return feed


async def _streamed(llm: LLMClient, request: GenerateRequest,
                    feed: Callable[[Sequence[int]], None]) -> GenerateResult:
    """One turn through ``stream_generate``, each piece's ids fed on as they come; the
    result is the pieces joined (the same turn ``generate`` returns)."""
    ids: list[int] = []
    logprobs: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    routed: list[int] = []
    top_k = layers = 0
    last: GenerateResult | None = None
    async with contextlib.aclosing(stream_generate(llm, request)) as pieces:
        async for piece in pieces:
            ids.extend(piece.output_ids)
            logprobs.extend(piece.logprobs)
            tops.extend(piece.top_logprobs)
            routed.extend(piece.routed_experts)
            if piece.routed_experts:
                top_k, layers = piece.routed_expert_top_k, piece.routed_expert_layers
            last = piece
            if piece.output_ids and piece.finish_reason not in ("preempted", "abort"):
                feed(piece.output_ids)
            if piece.finish_reason:
                break
    if last is None or not last.finish_reason:
        raise LLMUnavailable("the backend's stream ended without a finish reason")
    if routed and len(routed) != len(ids) * top_k * layers:
        routed, top_k, layers = [], 0, 0  # a piece without its routing: none rather than wrong
    return GenerateResult(ids, logprobs, last.finish_reason, last.policy_version, last.backend,
                          last.logprobs_kind, top_logprobs=tops, routed_experts=routed,
                          routed_expert_top_k=top_k, routed_expert_layers=layers)


async def _rendering(call: Any) -> Any:
    """Await a render in its fair turn (:mod:`budget`)."""
    with _template_errors():
        async with budget.fair_turn():
            return await call


@contextlib.contextmanager
def _template_errors() -> Iterator[None]:
    """A template that rejects the messages is the request's fault (400)."""
    try:
        yield
    except BadRequest:
        raise
    except Exception as exc:  # jinja2 errors, raise_exception(...) in templates, ChatTemplateError
        raise BadRequest(f"the model's chat template cannot render these messages: "
                         f"{type(exc).__name__}: {exc}", param="messages",
                         code="template_error") from exc


def _common_prefix(a: Sequence[Key], b: Sequence[Key]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


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
