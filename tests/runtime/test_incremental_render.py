"""Incremental rendering: a delta rendered from a probed window of the history (with a fixed
generation prompt and closing) has exactly the ids of the delta rendered from the whole
conversation, and a template that breaks a shortcut's property is rendered whole."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.runtime.tokens import ChatLedger, ChatTokenizer, Delta, RenderPlan
from tests.runtime import chat_families
from tests.runtime.doubles import QWEN25_TEMPLATE, THINK_STRIPPING_TEMPLATE, smollm2_tokenizer

pytestmark = pytest.mark.timeout(120)

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}]

HEAD_AND_PARITY = (  # what follows depends on the first message and on positions' parity
    # only: a window keeps both, and a window that kept neither would be caught here
    "{%- for message in messages %}{{- '<|im_start|>' + message.role }}"
    "{%- if messages[0].role == 'system' %}{{- ' [s]' }}{%- endif %}"
    "{{- loop.cycle(' even', ' odd') + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# name -> (tokenizer factory, template or None for the tokenizer's own, tools)
TEMPLATES: dict[str, tuple[Any, str | None, list[dict[str, Any]] | None]] = {
    "smollm2": (smollm2_tokenizer, None, None),
    "qwen25-tools": (smollm2_tokenizer, QWEN25_TEMPLATE, TOOLS),
    "think-stripping": (smollm2_tokenizer, THINK_STRIPPING_TEMPLATE, None),
    "tiny-chatml": (chat_families.chatml_tokenizer, None, None),
    "tiny-llama31-tools": (chat_families.llama31_tokenizer, None, TOOLS),
    "tiny-gemma": (chat_families.gemma_tokenizer, None, None),
    "tiny-head-and-parity": (chat_families.chatml_tokenizer, HEAD_AND_PARITY, None),
}

# Templates that break one shortcut's property each (ChatML otherwise).
_ROLE = "'<|im_start|>' + message.role + '\\n'"
NUMBERED = (  # every message says its position: what follows depends on all the history
    "{%- for message in messages %}{{- " + _ROLE + " + loop.index0|string + ': ' + "
    "message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LAST_MESSAGE_ASKS = (  # the last message is written differently when an answer is asked for
    "{%- for message in messages %}{{- " + _ROLE + " + message.content }}"
    "{%- if loop.last and add_generation_prompt %}{{- ' (answer now)' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CLOSING_COUNTS = (  # an assistant turn's closing says how many user turns came before it
    "{%- set ns = namespace(users=0) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- set ns.users = ns.users + 1 %}{%- endif %}"
    "{{- " + _ROLE + " + message.content + '<|im_end|>' }}"
    "{%- if message.role == 'assistant' %}{{- '[' + ns.users|string + ']' }}{%- endif %}"
    "{{- '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LAST_USER_MARKED = (  # earlier messages render differently once later ones follow (Qwen3's
    # last-query rule): the last user message is marked, so it loses its mark when another
    # user message comes
    "{%- set ns = namespace(last=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if loop.index0 == ns.last %}{{- '<|im_start|>user (last)\\n' }}"
    "{%- else %}{{- " + _ROLE + " }}{%- endif %}"
    "{{- message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

_FIRST_ID = 16  # past every family's special and template tokens in these vocabularies


def _chats(name: str) -> tuple[ChatTokenizer, ChatTokenizer, list[dict[str, Any]] | None]:
    factory, template, tools = TEMPLATES[name]
    tok = factory()
    return (ChatTokenizer(tok, chat_template=template),
            ChatTokenizer(tok, chat_template=template, incremental=False), tools)


def _drive(chat: ChatTokenizer, first: list[dict[str, Any]], tools: Any,
           turns: list[tuple[list[int], list[dict[str, Any]]]]) -> tuple[list[int], list[Delta]]:
    ledger = ChatLedger(chat, [dict(m) for m in first], tools)
    ledger.start()
    deltas = []
    for output, new in turns:
        ledger.add_output(output)
        deltas.append(ledger.add_messages(new))
    return ledger.token_ids, deltas


_texts = st.lists(st.sampled_from([*"ab \n{}:\"<>/", "</think>", "echo"]),
                  max_size=8).map("".join)


@st.composite
def _conversation(draw: st.DrawFn, observation_role: str, eos: int, vocab: int,
                  ) -> tuple[list[dict[str, Any]], list[tuple[list[int], list[dict[str, Any]]]]]:
    first: list[dict[str, Any]] = []
    if draw(st.booleans()):
        first.append({"role": "system", "content": draw(_texts)})
    first.append({"role": "user", "content": draw(_texts)})
    turns = []
    for _ in range(draw(st.integers(1, 9))):
        output = draw(st.lists(st.integers(_FIRST_ID, vocab - 1), max_size=6))
        if draw(st.booleans()):
            output.append(eos)
        if observation_role == "tool" and draw(st.booleans()):
            new = [{"role": "tool", "name": "bash", "content": draw(_texts)}
                   for _ in range(draw(st.integers(1, 3)))]
        else:
            new = [{"role": "user", "content": draw(_texts)}]
        turns.append((output, new))
    return first, turns


@pytest.mark.parametrize("name", list(TEMPLATES))
@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_incremental_deltas_equal_the_full_render(name: str, data: st.DataObject) -> None:
    """Over random chats (long enough that the window leaves history out), every delta and
    the whole sequence are the ids of deltas rendered from the whole conversation."""
    chat, reference, tools = _chats(name)
    plan = chat.render_plan(tools)
    # The shortcuts are taken for these templates (else this would compare full with full).
    assert plan.window and plan.generation_prompt and plan.closing, plan.refused
    first, turns = data.draw(_conversation(chat.observation_role, chat.tokenizer.eos_token_id,
                                           len(chat.tokenizer)))
    ids, deltas = _drive(chat, first, tools, turns)
    want_ids, want = _drive(reference, first, tools, turns)
    assert deltas == want
    assert ids == want_ids


@pytest.mark.parametrize(("template", "refused"), [
    (NUMBERED, {"window"}),
    (LAST_MESSAGE_ASKS, {"generation_prompt"}),
    (CLOSING_COUNTS, {"window", "closing"}),
    (LAST_USER_MARKED, set()),
], ids=["numbered", "last-message-asks", "closing-counts", "last-user-marked"])
def test_a_template_the_probe_refuses_is_rendered_whole_and_exact(
        template: str, refused: set[str]) -> None:
    """The probe refuses exactly the shortcut whose property the template breaks, and the
    ledger's ids equal those of deltas rendered from the whole conversation. (Marking the
    last user message changes earlier text once more messages follow, which no shortcut
    relies on: the delta is still the full render's, and the ledger reports it is not
    append-only, as before.)"""
    tok = chat_families.chatml_tokenizer()
    chat = ChatTokenizer(tok, chat_template=template)
    reference = ChatTokenizer(tok, chat_template=template, incremental=False)
    plan = chat.render_plan()
    taken = {"window": plan.window, "generation_prompt": plan.generation_prompt is not None,
             "closing": plan.closing is not None}
    assert {k for k, v in taken.items() if not v} == refused, plan
    assert len(plan.refused) == len(refused)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    turns = [([*tok.encode(f"answer {k}"), eot], [{"role": "user", "content": f"more {k}"}])
             for k in range(7)]
    ids, deltas = _drive(chat, first, None, turns)
    want_ids, want = _drive(reference, first, None, turns)
    assert deltas == want and ids == want_ids
    ledger = ChatLedger(chat, [dict(m) for m in first])
    ledger.start()
    ledger.add_output(turns[0][0])
    ledger.add_messages(turns[0][1])
    assert ledger.append_only == (template != LAST_USER_MARKED)


def test_the_window_keeps_the_head_the_tail_and_the_parity_of_positions() -> None:
    history = [{"role": "user", "content": str(k)} for k in range(11)]
    kept = [int(m["content"]) for m in RenderPlan(window=True).context(history)]
    assert kept[:2] == [0, 1] and kept[-2:] == [9, 10] and len(kept) < len(history)
    assert all((a - b) % 2 == (i - j) % 2 for i, a in enumerate(kept)
               for j, b in enumerate(kept))
    assert RenderPlan().context(history) == history


def test_plans_are_probed_once_per_template_and_tools() -> None:
    tok = chat_families.chatml_tokenizer()
    chat = ChatTokenizer(tok, chat_template=NUMBERED + " ")
    assert chat.known_render_plan() is None
    plan = chat.render_plan()
    again = ChatTokenizer(tok, chat_template=NUMBERED + " ")
    assert again.known_render_plan() is plan  # another job's tokenizer object, same template
    assert again.known_render_plan(TOOLS) is None  # another tools list is probed on its own
    assert ChatTokenizer(tok, incremental=False).known_render_plan() == RenderPlan(
        refused=("incremental rendering is off",))
