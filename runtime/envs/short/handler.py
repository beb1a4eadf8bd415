"""The ``short`` environment: one question, one short reply, no tools, no sandbox.

Made for small models under RL on a CPU (the DAPO task set in ``trainer_adapters/dapo/data``):
the whole prompt is a one-line instruction and the question, a few dozen tokens, where the
``math`` environment's tool-listing prompt costs about 260 tokens per sample in every forward
and backward pass.

Task format::

    {
      "id": "larger-1-0003",                  # optional
      "question": "Which number is larger: 67 or 70?",
      "answer": "70",                          # the gold answer (a number or a word)
      "distractors": ["67"]                    # optional: wrong options named in the question
    }

Scoring: the answer is the content of the last ``\\boxed{}`` when there is one, else the whole
reply. It is correct when it names the gold answer (as a whole word, case-insensitive; numbers
compared by value) and names none of the distractors: "The larger number is 70." counts,
"70 is larger than 67" does not, because a reply that lists every option would otherwise be
rewarded for hedging. The reward is 1 or 0; components say which part failed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from rollout.runtime.agent_loop import run_agent_loop
from rollout.runtime.envs.common import check_task_object, invalid, require_str
from rollout.runtime.envs.math.answers import extract_boxed
from rollout.runtime.handler import AgentHandler, JobContext, RunOutcome
from rollout.runtime.types import Reward

ENV = "short"
INSTRUCTIONS = "Answer the question with the answer only."
MAX_REPLY_CHARS = 2000
"""Longer replies are scored on their first part only (a runaway reply is wrong anyway)."""

_WORD = re.compile(r"[A-Za-z]+|\d+(?:\.\d+)?")


def _tokens(text: str) -> list[str]:
    return [t.lower() for t in _WORD.findall(text.replace(",", ""))]


def _same(token: str, target: str) -> bool:
    if token == target:
        return True
    try:
        return float(token) == float(target)
    except ValueError:
        return False


def names(text: str, option: str) -> bool:
    """Whether ``text`` contains ``option`` as a whole word or number (case-insensitive)."""
    wanted = _tokens(option)
    if not wanted:
        return False
    have = _tokens(text)
    n = len(wanted)
    return any(all(_same(have[i + k], wanted[k]) for k in range(n))
               for i in range(len(have) - n + 1))


def score(reply: str, answer: str, distractors: list[str]) -> dict[str, float]:
    boxed = extract_boxed(reply)
    text = (boxed if boxed is not None else reply)[:MAX_REPLY_CHARS]
    gold = names(text, answer)
    wrong = any(names(text, d) for d in distractors)
    return {"correct": float(gold and not wrong), "names_answer": float(gold),
            "names_distractor": float(wrong), "boxed": float(boxed is not None)}


class ShortAnswerHandler(AgentHandler):
    name = ENV

    def validate_task(self, task: Mapping[str, Any]) -> None:
        check_task_object(task, ENV)
        require_str(task, "question", env=ENV)
        require_str(task, "answer", env=ENV)
        distractors = task.get("distractors", [])
        if not isinstance(distractors, list) or not all(
                isinstance(d, str) and d.strip() for d in distractors):
            raise invalid("short task field 'distractors' must be a list of non-empty strings, "
                          f"got {distractors!r}", "distractors")
        if any(names(d, task["answer"]) for d in distractors):
            raise invalid("a distractor names the answer itself; the task could never be "
                          "solved", "distractors")

    async def init(self, ctx: JobContext) -> None:
        self.validate_task(ctx.spec.task)

    async def run(self, ctx: JobContext) -> RunOutcome:
        messages = [{"role": "system", "content": INSTRUCTIONS},
                    {"role": "user", "content": ctx.spec.task["question"]}]
        return await run_agent_loop(ctx, [], messages, max_turns=1)

    async def eval(self, ctx: JobContext) -> Reward:
        task = ctx.spec.task
        reply = ctx.outcome.metadata.get("final_text", "") if ctx.outcome is not None else ""
        parts = score(reply, task["answer"], list(task.get("distractors", [])))
        return Reward(value=parts["correct"], components=parts,
                      info={"reply": reply[:200], "gold": task["answer"]})
