"""Where a request is rendered: small ones on the event loop (no thread hop); a chain's first
extension (it runs the template's probe) and large ones in a worker thread; the ids are the
same either way."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from rollout.runtime.tokens import ChatLedger, ChatTokenizer
from rollout.runtime.types import ChatOptions, JobSpec, Limits, SamplingParams
from rollout.server.gateway.conversation import INLINE_CHARS, JobConversation, RenderPlacement
from rollout.server.gateway.messages import ChatRequest, Message
from tests.runtime.doubles import smollm2_tokenizer
from tests.server.gateway.policy_double import PromptPolicy

pytestmark = pytest.mark.timeout(120)


class ThreadRecordingTokenizer:
    """TEST DOUBLE: the real tokenizer, noting which thread each render runs on."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.threads: list[int] = []

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.get_ident())
        return self._tok.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def test_the_placement_verdict() -> None:
    assert RenderPlacement(INLINE_CHARS, bounded=True).on_loop()
    assert not RenderPlacement(INLINE_CHARS + 1, bounded=True).on_loop()
    assert not RenderPlacement(10, bounded=False).on_loop()


async def test_small_extensions_render_on_the_loop_and_large_ones_in_a_thread() -> None:
    tok = ThreadRecordingTokenizer(smollm2_tokenizer())
    llm = PromptPolicy(tok, tok.convert_tokens_to_ids("<|im_end|>"))
    spec = JobSpec(job_id="job", environment="harness", task={},
                   sampling=SamplingParams(seed=3, max_tokens_per_turn=32),
                   limits=Limits(max_turns=8))
    conv = JobConversation(spec, llm, deadline=asyncio.get_running_loop().time() + 600)
    loop_thread = threading.get_ident()
    messages = [Message("system", "s"), Message("user", "task")]
    where: list[set[bool]] = []
    for observation in ("first", "small", "x " * INLINE_CHARS, "small again", ""):
        tok.threads.clear()
        answer = await conv.serve(ChatRequest(messages=list(messages)))
        where.append({t == loop_thread for t in tok.threads})
        messages += [Message("assistant", answer.content), Message("user", observation)]
    messages = messages[:-2]
    # 0: a small fresh chain (loop; loading the template for the job is threaded); 1: the
    # first extension probes the template (thread); 2: small (loop); 3: larger than
    # INLINE_CHARS (thread); 4: small (loop).
    assert True in where[0]
    assert where[1:] == [{False}, {True}, {False}, {True}]
    tok.threads.clear()  # a fresh chain of a large request: thread
    await conv.serve(ChatRequest(messages=[Message("user", "y " * INLINE_CHARS)]))
    assert tok.threads and loop_thread not in tok.threads
    # The chain's ids are those of a ledger that renders every delta from the whole chat.
    chat = ChatTokenizer(tok, incremental=False)
    ledger = ChatLedger(chat, [{"role": m.role, "content": m.content} for m in messages[:2]])
    ledger.start()
    for k, (prompt, output) in enumerate(llm.calls[:5]):
        assert prompt == ledger.token_ids
        ledger.add_output(output)
        if k < 4:
            new = messages[3 + 2 * k]
            ledger.add_messages([{"role": new.role, "content": new.content}])
    assert len(llm.calls) == 6


async def test_a_jobs_first_request_uses_the_template_an_earlier_job_probed() -> None:
    """The served tokenizer's template is loaded and probed in a thread by the first job; a
    later job with the same template arguments takes that result on the event loop (no
    thread, no probe renders); other template arguments get their own."""
    tok = ThreadRecordingTokenizer(smollm2_tokenizer())
    llm = PromptPolicy(tok, tok.convert_tokens_to_ids("<|im_end|>"))
    loop_thread = threading.get_ident()

    def job(name: str, **kwargs: Any) -> JobConversation:
        spec = JobSpec(job_id=name, environment="harness", task={},
                       sampling=SamplingParams(seed=3, max_tokens_per_turn=32),
                       limits=Limits(max_turns=8), chat=ChatOptions(template_kwargs=kwargs))
        return JobConversation(spec, llm, deadline=asyncio.get_running_loop().time() + 600)

    request = ChatRequest(messages=[Message("system", "s"), Message("user", "task")])
    first, second, other = job("a"), job("b"), job("c", probe_flag=True)
    await first.serve(request)
    assert tok.threads[0] != loop_thread  # the first job probed the template in a thread
    tok.threads.clear()
    answer = await second.serve(request)
    assert tok.threads and set(tok.threads) == {loop_thread}
    assert second._chat is first._chat
    assert answer.turn.prompt_ids == llm.calls[0][0]
    tok.threads.clear()
    await other.serve(request)
    assert tok.threads[0] != loop_thread and other._chat is not first._chat
