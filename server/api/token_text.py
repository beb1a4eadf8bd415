"""A trajectory's token ids decoded to text, one piece per id, for people to read.

Used by ``GetJob(include_text)`` (so ``rollout jobs show --text`` works on a trainer's machine
that has no model) and by the web dashboard. The ids stay authoritative; this is a view.

Why one piece per id rather than one string per segment: the views shade each generated token
by its logprob and show the loss mask token by token, so each id needs the text it adds. A token
cannot be decoded alone: byte-level BPE splits one character over several tokens, and
SentencePiece drops a word's leading space at the start of a sequence. A token that ends inside
a multi-byte character gets an empty piece and the character appears with the token that
completes it, so joining the pieces gives the decoded text. The whole trajectory is decoded as
one sequence, so a character split across a turn boundary is shown once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollout.runtime.types import Trajectory

MAX_HELD = 8
"""Tokens held back waiting for a character to complete; past that they are invalid bytes and
shown as U+FFFD (a character needs at most four bytes)."""
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class TurnPieces:
    """One turn's tokens as text pieces, aligned with its id lists."""

    prompt: list[str]
    output: list[str]
    observation: list[str]


def token_pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The text each of ``ids`` adds, in order (``"".join`` of it decodes ``ids``).

    Incremental detokenization as vLLM does it: each token's text is what decoding from a
    ``prefix`` offset gains over the text already shown from there. ``prefix`` trails the shown
    position by one token, so a leading space or a merged character is decoded in context.
    """
    ids = list(ids)
    kwargs = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
    pieces: list[str] = []
    prefix = shown = 0
    for i in range(len(ids)):
        before = tokenizer.decode(ids[prefix:shown], **kwargs)
        now = tokenizer.decode(ids[prefix:i + 1], **kwargs)
        grew = len(now) > len(before) and not now.endswith(_REPLACEMENT)
        if grew or i == len(ids) - 1 or i + 1 - shown >= MAX_HELD:
            pieces.append(now[len(before):])
            prefix, shown = shown, i + 1
        else:
            pieces.append("")
    return pieces


def trajectory_pieces(tokenizer: Any, traj: Trajectory) -> list[TurnPieces]:
    """Every turn's pieces; CPU work (run it off the event loop)."""
    flat: list[int] = []
    for t in traj.turns:
        flat += t.prompt_ids + t.output_ids + t.observation_ids
    pieces = token_pieces(tokenizer, flat)
    out, at = [], 0
    for t in traj.turns:
        a, b, c = len(t.prompt_ids), len(t.output_ids), len(t.observation_ids)
        out.append(TurnPieces(pieces[at:at + a], pieces[at + a:at + a + b],
                              pieces[at + a + b:at + a + b + c]))
        at += a + b + c
    return out
