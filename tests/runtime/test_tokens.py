"""Token accounting: deltas are appended after the model's raw ids, which are never re-tokenized."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.runtime.tokens import ChatLedger, ChatTemplateError, ChatTokenizer
from rollout.runtime.types import Turn
from tests.runtime.doubles import QWEN25_TEMPLATE, THINK_STRIPPING_TEMPLATE, smollm2_tokenizer

pytestmark = pytest.mark.timeout(60)

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}]


@pytest.fixture(scope="module")
def tok() -> Any:
    return smollm2_tokenizer()


def ids(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def run_turns(ledger: ChatLedger, outputs: list[list[int]],
              observations: list[list[dict[str, Any]]]) -> list[Turn]:
    """Drive a ledger the way the agent loop does, collecting Turns."""
    turns: list[Turn] = []
    prompt = ledger.start()
    for k, out in enumerate(outputs):
        turn = Turn(prompt_ids=prompt, output_ids=list(out), output_logprobs=[0.0] * len(out))
        ledger.add_output(out)
        turns.append(turn)
        if k < len(observations):
            delta = ledger.add_messages(observations[k])
            turn.observation_ids = delta.observation_ids
            prompt = delta.prompt_ids
    return turns


def concat(turns: list[Turn]) -> list[int]:
    out: list[int] = []
    for t in turns:
        out += t.prompt_ids + t.output_ids + t.observation_ids
    return out


def test_noncanonical_output_ids_survive_verbatim_over_turns(tok: Any) -> None:
    eot = tok.eos_token_id
    odd = tok.convert_tokens_to_ids(["h", "ello"])  # decodes to "hello", which encodes as 1 id
    assert ids(tok, tok.decode(odd)) != odd
    outputs = [[*odd, *ids(tok, " there"), eot],
               [*ids(tok, "second"), *odd, eot],
               [*ids(tok, "third turn"), eot]]
    obs = [[{"role": "tool", "content": "out 1"}], [{"role": "user", "content": "more please"}]]
    ledger = ChatLedger(ChatTokenizer(tok), [{"role": "system", "content": "S"},
                                             {"role": "user", "content": "task"}])
    turns = run_turns(ledger, outputs, obs)

    assert ledger.token_ids == concat(turns)
    offset = 0
    for turn, out in zip(turns, outputs, strict=True):
        offset += len(turn.prompt_ids)
        assert ledger.token_ids[offset:offset + len(out)] == out  # verbatim, in place
        offset += len(out) + len(turn.observation_ids)
    # The model stopped on <|im_end|>; only the template's "\n" after it is appended.
    assert turns[0].observation_ids[0] == ids(tok, "\n")[0]
    assert tok.decode(ledger.token_ids) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\ntask<|im_end|>\n"
        "<|im_start|>assistant\nhello there<|im_end|>\n<|im_start|>tool\nout 1<|im_end|>\n"
        "<|im_start|>assistant\nsecondhello<|im_end|>\n<|im_start|>user\nmore please<|im_end|>\n"
        "<|im_start|>assistant\nthird turn<|im_end|>")
    # A fresh re-tokenization would have changed the model's ids: the ledger did not.
    assert ids(tok, tok.decode(ledger.token_ids)) != ledger.token_ids
    mask = [m for t in turns for m in t.loss_mask]
    model_ids = [i for out in outputs for i in out]
    assert [i for i, m in zip(ledger.token_ids, mask, strict=True) if m] == model_ids


def test_canonical_outputs_match_a_fresh_render_of_the_whole_chat(tok: Any) -> None:
    """With canonical output ids the incremental ids equal the template's full rendering."""
    chat = ChatTokenizer(tok, chat_template=QWEN25_TEMPLATE)
    msgs = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "2+2?"}]
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    outputs = [[*ids(tok, call), tok.eos_token_id], [*ids(tok, "4"), tok.eos_token_id]]
    obs = [[{"role": "tool", "content": "a.txt"}, {"role": "tool", "content": "b.txt"}]]
    ledger = ChatLedger(chat, list(msgs), TOOLS)
    turns = run_turns(ledger, outputs, obs)
    full = [*msgs, {"role": "assistant", "content": call}, *obs[0],
            {"role": "assistant", "content": "4"}]
    rendered = chat.render(full, add_generation_prompt=False, tools=TOOLS)
    assert rendered.endswith("<|im_end|>\n")
    assert ledger.token_ids == ids(tok, rendered[:-1])  # the last "\n" comes with a next turn
    assert concat(turns) == ledger.token_ids
    assert "<tools>" in tok.decode(turns[0].prompt_ids)
    assert tok.decode(turns[0].observation_ids).startswith(
        "\n<|im_start|>user\n<tool_response>\na.txt\n</tool_response>\n<tool_response>")
    assert tok.decode(turns[1].prompt_ids) == "<|im_start|>assistant\n"
    assert ledger.append_only


@pytest.mark.parametrize("template", [None, QWEN25_TEMPLATE], ids=["smollm2", "qwen25"])
def test_turn_cut_by_max_tokens_gets_its_end_of_turn_as_prompt_tokens(tok: Any,
                                                                      template: str | None) -> None:
    chat = ChatTokenizer(tok, chat_template=template)
    ledger = ChatLedger(chat, [{"role": "system", "content": "S"},
                               {"role": "user", "content": "u"}])
    cut = ids(tok, "an unfinished sent")  # no <|im_end|>: max_tokens ran out
    turns = run_turns(ledger, [cut, [*ids(tok, "ok"), tok.eos_token_id]],
                      [[{"role": "user", "content": "go on"}]])
    closing = ids(tok, "<|im_end|>\n")
    assert turns[0].observation_ids[:len(closing)] == closing
    assert turns[0].loss_mask[-len(turns[0].observation_ids):] == [0] * len(
        turns[0].observation_ids)
    assert concat(turns) == ledger.token_ids
    assert "an unfinished sent<|im_end|>\n<|im_start|>user\ngo on" in tok.decode(ledger.token_ids)


def test_history_rewriting_template_is_detected_and_model_tokens_kept(tok: Any) -> None:
    chat = ChatTokenizer(tok, chat_template=THINK_STRIPPING_TEMPLATE)
    ledger = ChatLedger(chat, [{"role": "user", "content": "q"}])
    thought = [*ids(tok, "<think>\nlet me see\n</think>\nanswer"), tok.eos_token_id]
    turns = run_turns(ledger, [thought, [*ids(tok, "done"), tok.eos_token_id]],
                      [[{"role": "user", "content": "sure?"}]])
    assert not ledger.append_only  # reported, not silently re-rendered
    assert ledger.token_ids[len(turns[0].prompt_ids):][:len(thought)] == thought
    assert concat(turns) == ledger.token_ids
    fresh = chat.render(ledger.messages, add_generation_prompt=False)
    assert "let me see" not in fresh  # what re-rendering would have trained on instead


def test_template_that_rewrites_assistant_content_is_refused(tok: Any) -> None:
    upper = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content | upper"
             " + '<|im_end|>\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    ledger = ChatLedger(ChatTokenizer(tok, chat_template=upper), [{"role": "user", "content": "q"}])
    with pytest.raises(ChatTemplateError):  # before any model turn is wasted
        ledger.start()


def test_supports_tools_and_end_of_turn(tok: Any) -> None:
    assert not ChatTokenizer(tok).supports_tools  # SmolLM2's template ignores tools
    assert ChatTokenizer(tok, chat_template=QWEN25_TEMPLATE).supports_tools
    assert ChatTokenizer(tok).end_of_turn_ids == {tok.convert_tokens_to_ids("<|im_end|>")}


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(outputs=st.lists(st.lists(st.integers(3, 49151), max_size=12), min_size=1, max_size=4),
       stop_on_eot=st.lists(st.booleans(), min_size=4, max_size=4))
def test_any_output_ids_are_kept_and_the_sequence_is_the_concatenation(
        tok: Any, outputs: list[list[int]], stop_on_eot: list[bool]) -> None:
    outs = [[*o, tok.eos_token_id] if stop_on_eot[i] else o for i, o in enumerate(outputs)]
    obs = [[{"role": "tool", "content": f"observation {k}"}] for k in range(len(outs) - 1)]
    ledger = ChatLedger(ChatTokenizer(tok, chat_template=QWEN25_TEMPLATE),
                        [{"role": "user", "content": "t"}], TOOLS)
    turns = run_turns(ledger, outs, obs)
    assert concat(turns) == ledger.token_ids
    assert [t.output_ids for t in turns] == outs
    for k, turn in enumerate(turns[:-1]):
        text = tok.decode(turn.observation_ids)
        assert f"<tool_response>\nobservation {k}\n</tool_response>" in text
        # Exactly one end-of-turn between the model's tokens and the next message.
        closes = turn.output_ids[-1:] + turn.observation_ids[:1]
        assert closes.count(tok.eos_token_id) == 1


def test_final_text_drops_any_trailing_special_token(tok: Any) -> None:
    ledger = ChatLedger(ChatTokenizer(tok), [{"role": "user", "content": "q"}])
    ledger.start()
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    out = [*ids(tok, "the answer"), endoftext]
    assert ledger.add_output(out) == "the answer"
    delta = ledger.add_messages([{"role": "user", "content": "again"}])
    # Not the template's closing token, so the whole closing follows it.
    assert tok.decode(delta.observation_ids).startswith("<|im_end|>\n<|im_start|>user")
    assert ledger.token_ids[-len(delta.prompt_ids) - len(delta.observation_ids) - 1] == endoftext


def test_a_rolled_back_turn_leaves_the_ledger_as_it_was(tok: Any) -> None:
    """A turn whose generation never happened (cancelled, failed) is undone exactly, and the
    same messages appended again give the same ids."""
    ledger = ChatLedger(ChatTokenizer(tok), [{"role": "user", "content": "task"}])
    ledger.start()
    ledger.add_output([*ids(tok, "first"), tok.convert_tokens_to_ids("<|im_end|>")])
    before = (list(ledger.token_ids), list(ledger.messages))
    mark = ledger.mark()
    delta = ledger.add_messages([{"role": "user", "content": "next"}])
    grown = list(ledger.token_ids)
    ledger.rollback(mark)
    assert (ledger.token_ids, ledger.messages) == before
    again = ledger.add_messages([{"role": "user", "content": "next"}])
    assert ledger.token_ids == grown and again.prompt_ids == delta.prompt_ids
    with pytest.raises(RuntimeError):  # awaiting output again, as after the first append
        ledger.add_messages([{"role": "user", "content": "more"}])



_fragments = st.lists(st.sampled_from(
    [*"ab \n<|>_imstartendolu", "<|im_end|>", "<|im_start|>", "<|im_start|>assistant\n"]),
    max_size=12).map("".join)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(_fragments, min_size=1, max_size=12),
       contents=st.lists(st.from_regex(r"([ab]+( [ab]+)*)?", fullmatch=True),
                               min_size=2, max_size=4))
def test_memoized_encodes_and_deltas_equal_the_full_render(
        tok: Any, texts: list[str], contents: list[str]) -> None:
    """A warm ChatTokenizer (its fragment memo filled by earlier examples) gives the ids the
    tokenizer itself gives, and a ledger on it the ids of a full render of the whole chat."""
    chat = _shared_chat(tok)
    anchor = tok.eos_token
    for text in [*texts, *texts]:  # the second pass reads the memo
        want = ids(tok, anchor + text)[1:] if text else []
        assert chat.encode(text) == want
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": contents[0]}]
    outputs = [[*ids(tok, c), tok.eos_token_id] for c in contents[1:]]
    obs = [[{"role": "user", "content": c}] for c in contents[2:]]
    ledger = ChatLedger(chat, list(msgs))
    run_turns(ledger, outputs, obs)
    full: list[dict[str, Any]] = list(msgs)
    for k, c in enumerate(contents[1:]):
        full.append({"role": "assistant", "content": c})
        full.extend(obs[k] if k < len(obs) else [])
    rendered = chat.render(full, add_generation_prompt=False)
    assert rendered.endswith("<|im_end|>\n")
    assert ledger.token_ids == ids(tok, rendered[:-1])


_chats: dict[int, ChatTokenizer] = {}


def _shared_chat(tok: Any) -> ChatTokenizer:
    return _chats.setdefault(id(tok), ChatTokenizer(tok))


def test_the_backend_encoder_is_used_only_while_it_does_what_encode_does(tok: Any) -> None:
    """The Rust tokenizer is called directly for the generic fast tokenizer, but not while its
    state differs from what the tokenizer's ``encode`` would set (here: truncation on)."""
    chat = ChatTokenizer(tok)
    assert chat._backend is not None
    text = "a long observation line\n" * 12  # longer than the fragment memo keeps
    backend = tok._tokenizer
    backend.enable_truncation(max_length=5)
    try:
        got = chat.encode(text)
    finally:
        backend.no_truncation()
    assert got == ids(tok, tok.eos_token + text)[1:] and len(got) > 5
    assert chat.encode(text * 2) == ids(tok, tok.eos_token + text * 2)[1:]


def test_decode_calls_the_backend_only_while_the_wrapper_cleans_up_no_spaces(
        tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Text of ids from the Rust tokenizer directly is the wrapper's text; once the wrapper
    would clean up spaces, decoding goes through it again."""
    chat = ChatTokenizer(tok)
    assert chat._backend is not None and not tok.clean_up_tokenization_spaces
    some = [*ids(tok, "Hello , world ! héllo 日本 🙂<|im_end|>\n"), 0, 1, 2]
    wrapper = type(tok).decode
    calls: list[int] = []

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return wrapper(self, *args, **kwargs)

    monkeypatch.setattr(type(tok), "decode", spy)
    assert chat.decode(some) == wrapper(tok, some, skip_special_tokens=False)
    assert chat.decode(some[3:]) == wrapper(tok, some[3:], skip_special_tokens=False)
    assert not calls
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces", True)
    chat.decode(some)
    assert calls
