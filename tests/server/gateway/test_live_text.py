"""A streamed answer's text grows with each piece without decoding the whole output again.

The engine streams one id at a time; decoding everything so far on every piece costs the
square of the answer's length on the gateway's event loop. These tests hold the streamed
text to the whole decode, piece by piece, for decoders whose text for an id depends on its
neighbours, and bound the decoding work."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rollout.runtime.tokens import ChatTokenizer
from rollout.server.gateway.conversation import _LiveText
from tests.runtime.chat_families import CHATML_SPECIALS, PLAIN_CHATML_TEMPLATE, llama31_tokenizer
from tests.runtime.doubles import smollm2_tokenizer

CORPUS = ["The answer is 42. Isn't it?", "def f(x):\n    return x + 1  # done!",
          "Ünïcödé → café, naïve 漢字 😀 text", "  leading spaces , and a comma .",
          "<tool_call>{\"name\": \"bash\"}</tool_call>", "tabs\tand\nnewlines\n\n end"] * 20


def _metaspace() -> Any:
    """A SentencePiece-style tokenizer: its decoder drops the first piece's leading space,
    so the text of an id depends on whether it comes first."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", *CHATML_SPECIALS]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=PLAIN_CHATML_TEMPLATE,
                                   eos_token="<|im_end|>", clean_up_tokenization_spaces=False)


def _cleaning() -> Any:
    """SmolLM2's tokenizer with the clean-up that removes a space before punctuation, so a
    piece can change the text that came before it."""
    tok = smollm2_tokenizer()
    tok.clean_up_tokenization_spaces = True
    return tok


def _metaspace_cleaning() -> Any:
    """Both: a space of its own before punctuation, cleaned away by the piece after it."""
    tok = _metaspace()
    tok.clean_up_tokenization_spaces = True
    return tok


TOKENIZERS = {"smollm2": smollm2_tokenizer, "llama31": llama31_tokenizer,
              "metaspace": _metaspace, "clean-up-spaces": _cleaning,
              "metaspace-clean-up": _metaspace_cleaning}
_chats: dict[str, ChatTokenizer] = {}


def _chat(name: str) -> ChatTokenizer:
    if name not in _chats:
        _chats[name] = ChatTokenizer(TOKENIZERS[name]())
    return _chats[name]


def _strip_ends(chat: ChatTokenizer) -> Any:
    ends = chat.end_of_turn_ids | chat.special_ids

    def strip(ids: Sequence[int]) -> list[int]:
        kept = list(ids)
        while kept and kept[-1] in ends:
            kept.pop()
        return kept
    return strip


class _Counting:
    """The chat tokenizer, counting the ids it is asked to decode."""

    def __init__(self, chat: ChatTokenizer) -> None:
        self.chat, self.decoded = chat, 0

    def decode(self, ids: Sequence[int]) -> str:
        self.decoded += len(ids)
        return self.chat.decode(ids)


def _stream(chat: ChatTokenizer, ids: list[int], cuts: list[int]) -> None:
    """Feed ``ids`` in pieces ending at ``cuts``; after each piece the text must be the
    whole decode of everything so far."""
    strip = _strip_ends(chat)
    live = _LiveText(chat, strip, ())
    done = 0
    for cut in [*sorted(set(cuts)), len(ids)]:
        if cut <= done:
            continue
        live.feed(ids[done:cut])
        done = cut
        assert live._text() == chat.decode(strip(ids[:done])), (ids[:done], done)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_streamed_text_is_the_whole_decode_after_every_piece(name: str, data: Any) -> None:
    chat = _chat(name)
    text = data.draw(st.lists(st.sampled_from(CORPUS[:6]), min_size=1, max_size=4).map("".join))
    ids = chat.encode(text)
    vocab = len(chat.tokenizer)
    # Ids no text would give (a split character, a special token in the middle) as well.
    extra = data.draw(st.lists(st.integers(0, vocab - 1), max_size=6))
    at = data.draw(st.integers(0, len(ids)))
    ids = ids[:at] + extra + ids[at:]
    cuts = data.draw(st.lists(st.integers(1, max(1, len(ids))), max_size=len(ids)))
    _stream(chat, ids, cuts)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_a_long_answer_streamed_one_id_at_a_time(name: str) -> None:
    chat = _chat(name)
    ids = chat.encode("".join(random.Random(7).sample(CORPUS, 30)))
    _stream(chat, ids, list(range(1, len(ids))))


def test_decoding_work_grows_with_the_answer_not_its_square() -> None:
    chat = _chat("smollm2")
    ids = chat.encode("".join(random.Random(3).sample(CORPUS, 80)))
    assert len(ids) > 1000
    counting = _Counting(chat)
    live = _LiveText(counting, _strip_ends(chat), ())  # type: ignore[arg-type]
    sent = "".join(live.feed([i]) for i in ids)
    assert sent and chat.decode(ids).startswith(sent)
    # One id at a time with its context: about (2 x context + 1) ids per piece. Decoding
    # everything so far on every piece would be len(ids)**2 / 2.
    assert counting.decoded < 20 * len(ids), counting.decoded
