"""The ``dapo`` task set: short single-turn questions with headroom for a 135M model.

SmolLM2-135M-Instruct cannot add single digits reliably, but it can pick between two numbers
or two animals and pick the member of a category part of the time; it often hedges by naming
every option. Those are the skills RL can move in a few dozen CPU steps, so the set is made of
them. Each line is a job line of the ``short`` environment (``runtime/envs/short/handler.py``:
a one-line instruction, one turn, no sandbox): a reply is right when it names the answer and
none of the other options (``distractors``).

The files are generated once by :func:`main` with a fixed seed and shipped; train and held-out
share no question (held-out numbers and words are drawn from the same families, never the same
instance).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"
TRAIN_FILE = DATA_DIR / "train.jsonl"
HELDOUT_FILE = DATA_DIR / "heldout.jsonl"
_SIZES = ["ant", "bee", "mouse", "frog", "rabbit", "cat", "dog", "sheep", "pig", "cow",
          "horse", "giraffe", "elephant", "whale"]
"""Animals from smallest to largest."""

_ANIMALS = ["dog", "cat", "horse", "cow", "lion", "tiger", "mouse", "rabbit", "sheep", "goat",
            "bear", "wolf", "fox", "duck", "frog", "eagle"]
_FRUITS = ["apple", "banana", "orange", "grape", "lemon", "cherry", "peach", "pear", "mango",
           "plum", "melon", "kiwi"]
_OBJECTS = ["chair", "table", "spoon", "lamp", "shoe", "phone", "pencil", "bottle", "window",
            "door", "clock", "book", "cup", "hammer", "bucket", "carpet"]
_COLORS = ["red", "blue", "green", "yellow", "black", "white", "purple", "pink", "brown", "gray"]
_CATEGORIES = {"an animal": _ANIMALS, "a fruit": _FRUITS, "a color": _COLORS}


Question = tuple[str, str, list[str]]
"""(question, answer, distractors)."""


def _larger(rng: random.Random) -> Question:
    a, b = rng.sample(range(10, 100), 2)
    return f"Which number is larger: {a} or {b}?", str(max(a, b)), [str(min(a, b))]


def _smaller(rng: random.Random) -> Question:
    a, b = rng.sample(range(10, 100), 2)
    return f"Which number is smaller: {a} or {b}?", str(min(a, b)), [str(max(a, b))]


def _bigger_animal(rng: random.Random) -> Question:
    i, j = rng.sample(range(len(_SIZES)), 2)
    return (f"Which animal is bigger: a {_SIZES[i]} or a {_SIZES[j]}?", _SIZES[max(i, j)],
            [_SIZES[min(i, j)]])


def _choice(rng: random.Random) -> Question:
    kind = rng.choice(sorted(_CATEGORIES))
    answer = rng.choice(_CATEGORIES[kind])
    others = rng.sample(_OBJECTS, 2)
    options = [answer, *others]
    rng.shuffle(options)
    return f"Which of these is {kind}: {', '.join(options)}?", answer, others


FAMILIES = {"larger": _larger, "smaller": _smaller, "animal": _bigger_animal,
            "choice": _choice}


def distinct_draws(families: Mapping[str, Callable[[random.Random], tuple[Any, ...]]], n: int,
                   seed: int, exclude: Iterable[str] = ()
                   ) -> Iterator[tuple[str, int, tuple[Any, ...]]]:
    """``(family, k, draw)`` for k = 1..n, cycling through the families in name order, each
    draw's question (its first item) distinct and not in ``exclude``."""
    rng = random.Random(seed)
    seen = set(exclude)
    names = sorted(families)
    made = tries = 0
    while made < n:
        tries += 1
        if tries > 100 * n:
            raise ValueError(f"cannot draw {n} distinct questions from the families")
        family = names[made % len(names)]
        draw = families[family](rng)
        if draw[0] in seen:
            continue
        seen.add(draw[0])
        made += 1
        yield family, made, draw


def write_split(generate: Callable[..., Iterator[dict[str, Any]]], train: int, heldout: int,
                seeds: tuple[int, int], files: tuple[Path, Path]) -> None:
    """Write a held-out file and a train file whose questions never repeat a held-out one."""
    held = list(generate(heldout, seed=seeds[0]))
    rows = list(generate(train, seed=seeds[1],
                         exclude=frozenset(r["task"]["question"] for r in held)))
    files[0].parent.mkdir(parents=True, exist_ok=True)
    for path, lines in zip(files, (rows, held), strict=True):
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))


def generate(n: int, seed: int, exclude: Iterable[str] = ()) -> Iterator[dict[str, Any]]:
    """``n`` distinct job lines, cycling through the families, none of whose question is in
    ``exclude``."""
    for family, k, (question, answer, distractors) in distinct_draws(FAMILIES, n, seed, exclude):
        yield {"environment": "short",
               "task": {"id": f"{family}-{seed}-{k:04d}", "question": question,
                        "answer": answer, "distractors": distractors},
               "metadata": {"family": family}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the dapo train / held-out task files.")
    parser.add_argument("--train", type=int, default=600)
    parser.add_argument("--heldout", type=int, default=96)
    args = parser.parse_args(argv)
    write_split(generate, args.train, args.heldout, (1, 2), (TRAIN_FILE, HELDOUT_FILE))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
