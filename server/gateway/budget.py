"""A gateway request costs what its tokens may cost, not what its bytes would.

Why: a harness may send a body up to ``RequestLimits.max_body_bytes`` (8 MiB). Rendered with
the chat template and tokenized whole, such a prompt is a million and a half token ids (about
a gigabyte of Python objects and seconds of CPU) only for the context check to refuse it
afterwards; four jobs doing so at once took the server's memory, and one job resending large
prompts slowed every other job's turns several-fold. So, before anything is rendered:

- **a lower bound**: no token of the served tokenizer decodes to more than
  :func:`max_chars_per_token` characters, so a request whose message text is longer than that
  many characters per token of the job's room (``sampling.total_token_budget``, or the model's
  context when smaller) cannot fit, and is refused (``context_length_exceeded``) without
  tokenizing a byte of it;
- **counted, then stopped**: text that passes the bound but is long enough that it may still
  not fit is tokenized message by message, in chunks, and the count stops as soon as it passes
  the room; only a request that can fit goes on to be rendered;
- **a fair share**: renders and counts of every job go through one :class:`FairShare`, a few
  at a time, and when jobs wait, the one that has used the least rendering time goes first; a
  job with giant prompts then waits behind the others instead of in front of them.

``admit`` is the one call in the request path (``JobConversation.serve``); the renders
themselves take their turn through :func:`fair_turn`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import heapq
import itertools
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any

from rollout.runtime.agent_loop import context_length_of
from rollout.server.gateway.messages import BadRequest, ChatRequest, Message

COUNT_ABOVE = 4
"""Text longer than this many characters per token of room is counted before rendering
(ordinary prompts average 3-4 characters per token, so they are rendered directly)."""
CHUNK_CHARS = 32_768
"""Characters tokenized per step of a count (what one step holds in memory)."""
USAGE_KEPT = 4096
"""Jobs whose rendering time :class:`FairShare` remembers (the least recent are forgotten)."""

current_job: contextvars.ContextVar[str] = contextvars.ContextVar("gateway_job", default="")
"""The job a render belongs to (set by :func:`admit`, read by :func:`fair_turn`)."""

_CHARS_PER_TOKEN: dict[int, tuple[Any, int]] = {}


def max_chars_per_token(tokenizer: Any) -> int:
    """The longest text one token can stand for: the longest vocabulary entry (byte-level
    and SentencePiece vocabularies spell each entry with at least one character per decoded
    character). Cached per tokenizer."""
    cached = _CHARS_PER_TOKEN.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    try:
        vocab = tokenizer.get_vocab()
        longest = max((len(str(t)) for t in vocab), default=0)
    except Exception:  # a tokenizer without a vocabulary to read: no bound from it
        longest = 0
    value = max(longest, 1) if longest else 0
    _CHARS_PER_TOKEN[id(tokenizer)] = (tokenizer, value)
    return value


def request_chars(messages: Sequence[Message]) -> int:
    """Characters of text the messages carry (content, tool calls' names and arguments)."""
    return sum(len(m.content) + len(m.name) + sum(len(c.name) + len(c.arguments)
                                                   for c in m.tool_calls) for m in messages)


def room_of(spec: Any, llm: Any) -> int:
    """Tokens one sequence of the job may hold (what ``JobConversation`` checks after
    rendering)."""
    limit = int(spec.sampling.total_token_budget)
    context = context_length_of(llm)
    return min(limit, context) if context else limit


def too_long(tokens: int, room: int, exact: bool) -> BadRequest:
    at_least = "" if exact else "at least "
    return BadRequest(f"the prompt is {at_least}{tokens} tokens; this job allows {room} in one "
                      "sequence (its sampling.total_token_budget or the model's context)",
                      param="messages", code="context_length_exceeded")


async def admit(spec: Any, llm: Any, request: ChatRequest) -> None:
    """Refuse a request that cannot fit the job's room, as cheaply as that can be known."""
    current_job.set(spec.job_id)
    tokenizer = getattr(llm, "tokenizer", None)
    room = room_of(spec, llm)
    chars = request_chars(request.messages)
    per_token = max_chars_per_token(tokenizer) if tokenizer is not None else 0
    if per_token and chars > per_token * room:
        raise too_long(-(-chars // per_token), room, exact=False)
    if tokenizer is None or chars <= COUNT_ABOVE * room:
        return
    async with fair_turn():
        counted = await asyncio.to_thread(count_tokens, tokenizer, request.messages, room)
    if counted > room:
        raise too_long(counted, room, exact=False)


def count_tokens(tokenizer: Any, messages: Sequence[Message], room: int) -> int:
    """Tokens of the messages' text, counted chunk by chunk and stopped once past ``room``
    (each chunk boundary may split one token in two, so one token per chunk is taken off)."""
    total = 0
    for m in messages:
        for text in (m.content, *(c.arguments for c in m.tool_calls)):
            for at in range(0, len(text), CHUNK_CHARS):
                piece = text[at:at + CHUNK_CHARS]
                total += max(0, len(tokenizer.encode(piece, add_special_tokens=False)) - 1)
                if total > room:
                    return total
    return total


class FairShare:
    """At most ``slots`` renders at once; a waiting job with less rendering time used goes
    first (ties: first come), so one job's giant prompts cannot starve another's turns."""

    def __init__(self, slots: int) -> None:
        self.slots = max(1, slots)
        self.busy = 0
        self._used: OrderedDict[str, float] = OrderedDict()
        self._waiting: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def used(self, job: str) -> float:
        return self._used.get(job, 0.0)

    @contextlib.asynccontextmanager
    async def turn(self, job: str) -> AsyncIterator[None]:
        if self.busy < self.slots and not self._waiting:
            self.busy += 1
        else:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (self.used(job), next(self._order), fut))
            try:
                await fut  # the slot is handed over already counted in ``busy``
            except BaseException:
                if fut.done() and not fut.cancelled():
                    self._release()  # granted and cancelled in the same instant: pass it on
                else:
                    fut.cancel()
                raise
        started = time.monotonic()
        try:
            yield
        finally:
            self._used[job] = self.used(job) + time.monotonic() - started
            self._used.move_to_end(job)
            while len(self._used) > USAGE_KEPT:
                self._used.popitem(last=False)
            self._release()

    def _release(self) -> None:
        while self._waiting:
            _, _, fut = heapq.heappop(self._waiting)
            if not fut.done():
                fut.set_result(None)
                return
        self.busy -= 1


SHARE = FairShare(max(1, (os.cpu_count() or 2) // 2))
"""The process's one share: rendering is mostly Python (the GIL), so more slots than about
half the cores only make every render slower."""


def fair_turn() -> contextlib.AbstractAsyncContextManager[None]:
    """Wait for the current job's turn to render or tokenize (see :class:`FairShare`)."""
    return SHARE.turn(current_job.get())
