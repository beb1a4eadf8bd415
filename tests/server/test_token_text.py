"""Per-token text pieces (server/api/token_text.py) against the tokenizer's own decode of the whole
sequence: joining the pieces must give exactly the decoded text, whatever the ids."""

from __future__ import annotations

import random

from rollout.runtime.types import Trajectory, Turn
from rollout.server.api.token_text import token_pieces, trajectory_pieces
from tests.runtime.doubles import smollm2_tokenizer

TEXTS = ["<|im_start|>user\nHéllo wörld — 你好 🎉 def f(x):\n    return x<|im_end|>",
         "a 🎉🎉 b", "x", "  leading and trailing spaces  ", "नमस्ते, мир! 👩‍👩‍👧"]


def test_pieces_join_to_the_decoded_text() -> None:
    tok = smollm2_tokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        pieces = token_pieces(tok, ids)
        assert len(pieces) == len(ids)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=False)
    # A multi-byte character split over tokens shows with the token that completes it.
    ids = tok.encode("🎉")
    assert len(ids) > 1 and token_pieces(tok, ids)[-1] == "🎉"


def test_any_ids_even_invalid_utf8_join_to_the_decoded_text() -> None:
    tok = smollm2_tokenizer()
    rng = random.Random(7)
    for _ in range(20):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 200))]
        assert "".join(token_pieces(tok, ids)) == tok.decode(ids, skip_special_tokens=False)


def test_a_character_split_across_turns_is_shown_once() -> None:
    tok = smollm2_tokenizer()
    ids = tok.encode("answer: 🎉 done")
    cut = next(i for i in range(1, len(ids)) if "\ufffd" in tok.decode(ids[:i]))
    traj = Trajectory("j", turns=[Turn(ids[:cut], [], []), Turn([], ids[cut:], [0.0] * 9)])
    turns = trajectory_pieces(tok, traj)
    joined = "".join(turns[0].prompt) + "".join(turns[1].output)
    assert joined == tok.decode(ids) and joined.count("🎉") == 1
    assert len(turns[0].prompt) == cut and len(turns[1].output) == len(ids) - cut
