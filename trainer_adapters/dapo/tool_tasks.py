"""The ``tools`` task set: arithmetic a 135M model cannot do in its head, but can with Python.

Each line is a job of the ``math`` environment (``runtime/envs/math/handler.py``): the model sees
the
question after two worked examples of the tool-integrated style (a ```python block, the tool's
output, a boxed answer), runs code with the sandboxed ``python`` tool, reads the output in the
next turn and answers. Without the tool none of these is within SmolLM2-135M's reach (5- and
6-digit products, remainders, cubes); with it, an episode is right only when the model (1) turns
the question into code, (2) calls the tool, and (3) copies the tool's output into the box in a
later turn. Greedy SmolLM2-135M-Instruct solves few of them at the start: it often answers a
word problem in prose, writes code that computes something else, or miscopies the output
(``54872`` boxed as ``54873``). Those are the skills a few dozen DAPO steps can move.

The families differ in how close they are to the worked examples ("What is 31 + 45?"): plain
expressions (``product``, ``cubed``) are near them; word problems (``crates``, ``tank``) and
``remainder`` / ``total`` phrasing are further away, so a group's rewards differ and dynamic
sampling keeps it.

The files are generated once by :func:`main` with fixed seeds and shipped; train and held-out
share no question.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from rollout.trainer_adapters.dapo.task_set import distinct_draws, write_split

DATA_DIR = Path(__file__).resolve().parent / "data"
TRAIN_FILE = DATA_DIR / "tools_train.jsonl"
HELDOUT_FILE = DATA_DIR / "tools_heldout.jsonl"

Question = tuple[str, int]
"""(question, answer)."""


def _product(rng: random.Random) -> Question:
    a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(12, 99)
    return f"What is {a} * {b} * {c}?", a * b * c


def _cubed(rng: random.Random) -> Question:
    a = rng.randint(21, 199)
    return f"What is {a} cubed?", a ** 3


def _remainder(rng: random.Random) -> Question:
    a, b = rng.randint(1000, 9999), rng.randint(7, 49)
    return f"What is the remainder when {a} is divided by {b}?", a % b


def _total(rng: random.Random) -> Question:
    xs = [rng.randint(100, 999) for _ in range(4)]
    return f"Add up {xs[0]}, {xs[1]}, {xs[2]} and {xs[3]}.", sum(xs)


def _crates(rng: random.Random) -> Question:
    a, b = rng.randint(12, 99), rng.randint(12, 99)
    return (f"A crate holds {a} boxes and each box holds {b} pens. How many pens are in the "
            f"crate?", a * b)


def _tank(rng: random.Random) -> Question:
    a, b, c = rng.randint(500, 999), rng.randint(50, 200), rng.randint(50, 200)
    return (f"A tank holds {a} litres. {b} litres leak out, then {c} more. How many litres are "
            f"left?", a - b - c)


FAMILIES: dict[str, Callable[[random.Random], Question]] = {
    "product": _product, "cubed": _cubed, "remainder": _remainder, "total": _total,
    "crates": _crates, "tank": _tank}


def generate(n: int, seed: int, exclude: Iterable[str] = ()) -> Iterator[dict[str, Any]]:
    """``n`` distinct job lines, cycling through the families, none of whose question is in
    ``exclude``."""
    for family, k, (question, answer) in distinct_draws(FAMILIES, n, seed, exclude):
        yield {"environment": "math",
               "task": {"id": f"{family}-{seed}-{k:04d}", "question": question,
                        "answer": str(answer), "tools": ["python"]},
               "metadata": {"family": family}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the tools train / held-out task files.")
    parser.add_argument("--train", type=int, default=480)
    parser.add_argument("--heldout", type=int, default=96)
    args = parser.parse_args(argv)
    write_split(generate, args.train, args.heldout, (11, 12), (TRAIN_FILE, HELDOUT_FILE))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
