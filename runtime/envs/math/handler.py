"""The ``math`` environment: a question with one final answer, a Python tool to work with.

Task format (JSON object; ``data/math.jsonl`` follows it)::

    {
      "id": "math-002",                          # optional, for logs and results
      "question": "Compute 3/4 + 1/6 ...",       # what the agent sees
      "answer": "\\frac{11}{12}",                # gold answer: number, fraction, simple LaTeX
      "tools": ["python"],                       # optional sandbox tools (default: python)
      "rel_tol": 1e-9                            # optional tolerance for numeric answers
    }

The agent computes with ``python`` (a tagged tool call or a fenced ```python block) and answers
by calling ``submit(answer)`` or, without a submit call, by ending its last message with
``\\boxed{...}`` or a line stating it ("The answer is 43."); a submitted answer wins over
boxed text, a box over a stated line. EVAL compares with
:func:`rollout.runtime.envs.math.answers.answers_equivalent` (``0.75 == 3/4 == \\frac{3}{4}``,
``1,048,576 == 1048576``, ``\\frac{\\sqrt{3}}{2} == sqrt(3)/2``) on the host: scoring needs no
sandbox. A task with ``"tools": []`` never opens a sandbox at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from rollout.runtime.agent_loop import run_agent_loop
from rollout.runtime.envs.common import (
    SANDBOX_KEY,
    check_task_object,
    invalid,
    require_str,
    sandbox_of,
    sandbox_tools,
)
from rollout.runtime.envs.math.answers import (
    answers_equivalent,
    extract_boxed,
    extract_stated_answer,
)
from rollout.runtime.handler import AgentHandler, JobContext, RunOutcome
from rollout.runtime.tools.submit import SUBMITTED_ANSWER_KEY, SubmitTool
from rollout.runtime.types import Reward

ENV = "math"
ALLOWED_TOOLS = ("python", "bash")

INSTRUCTIONS = (
    "You are a careful mathematician. To calculate, write Python code in a ```python block (or "
    "call the `python` tool); it runs in a sandbox and you see its output. Then give the final "
    "answer as \\boxed{answer} (a number or a simple expression such as 3/4 or \\sqrt{2}), or "
    "call `submit` with it.")

# Worked examples as real turns of the conversation, because a small model copies a
# demonstration far better than it follows a description. They use the tool-integrated-reasoning
# style of math agents (ToRA, Qwen-Math TIR): a ```python block that the loop runs with the
# `python` tool (runtime/toolcalls.py: fenced blocks), then a boxed answer. A 135M model given
# only a description of a tagged <tool_call> almost never calls a tool; given these turns it runs
# code on most questions (docs/writing-an-environment.md, "Small models need a worked example").
# Models trained on tagged calls still make them (the tagged format is parsed first). The
# examples' numbers appear in no shipped task, so copying an answer earns nothing.
EXAMPLE = (
    {"role": "user", "content": "What is 31 + 45?"},
    {"role": "assistant", "content": "```python\nprint(31 + 45)\n```"},
    {"role": "tool", "name": "python", "content": "76"},
    {"role": "assistant", "content": "The answer is \\boxed{76}."},
    {"role": "user", "content": "What is 9 * 6 - 4?"},
    {"role": "assistant", "content": "```python\nprint(9 * 6 - 4)\n```"},
    {"role": "tool", "name": "python", "content": "50"},
    {"role": "assistant", "content": "The answer is \\boxed{50}."},
)
"""Shown before the task when the task has the python tool (a task without it,
``"tools": []``, gets no example of a tool it cannot call)."""


class MathHandler(AgentHandler):
    name = ENV

    def validate_task(self, task: Mapping[str, Any]) -> None:
        check_task_object(task, ENV)
        require_str(task, "question", env=ENV)
        require_str(task, "answer", env=ENV)
        tools = task.get("tools", ["python"])
        if not isinstance(tools, list) or not all(t in ALLOWED_TOOLS for t in tools):
            raise invalid(f"math task field 'tools' must be a list drawn from "
                          f"{list(ALLOWED_TOOLS)}, got {tools!r}", "tools")
        rel_tol = task.get("rel_tol", 1e-9)
        if isinstance(rel_tol, bool) or not isinstance(rel_tol, int | float) or rel_tol < 0:
            raise invalid(f"math task field 'rel_tol' must be a number >= 0, got {rel_tol!r}",
                          "rel_tol")

    async def init(self, ctx: JobContext) -> None:
        self.validate_task(ctx.spec.task)
        if ctx.spec.task.get("tools", ["python"]):
            ctx.state[SANDBOX_KEY] = await ctx.open_sandbox()

    async def run(self, ctx: JobContext) -> RunOutcome:
        names = list(ctx.spec.task.get("tools", ["python"]))
        tools: list[Any] = sandbox_tools(sandbox_of(ctx), names, ctx) if names else []
        tools.append(SubmitTool(ctx.state, answer_description="The final answer only."))
        example = list(EXAMPLE) if "python" in names else []
        messages = [{"role": "system", "content": INSTRUCTIONS}, *example,
                    {"role": "user", "content": ctx.spec.task["question"]}]
        return await run_agent_loop(ctx, tools, messages)

    async def eval(self, ctx: JobContext) -> Reward:
        task = ctx.spec.task
        predicted, source = final_answer(ctx)
        correct = await asyncio.to_thread(answers_equivalent, predicted, task["answer"],
                                          rel_tol=float(task.get("rel_tol", 1e-9)))
        return Reward(value=1.0 if correct else 0.0,
                      components={"correct": 1.0 if correct else 0.0,
                                  "answered": 0.0 if predicted is None else 1.0},
                      info={"predicted": (predicted or "")[:200], "answer_source": source,
                            "gold": str(task["answer"])})

    async def cleanup(self, ctx: JobContext) -> None:
        ctx.state.pop(SANDBOX_KEY, None)


def final_answer(ctx: JobContext) -> tuple[str | None, str]:
    """(answer, where it came from): the submit tool's answer, else the last ``\\boxed{}`` of
    the final message, else its last line stating an answer ("The answer is 43.")."""
    if SUBMITTED_ANSWER_KEY in ctx.state:
        return str(ctx.state[SUBMITTED_ANSWER_KEY]), "submit"
    metadata = ctx.outcome.metadata if ctx.outcome is not None else {}
    if SUBMITTED_ANSWER_KEY in metadata:
        return metadata[SUBMITTED_ANSWER_KEY], "submit"
    text = metadata.get("final_text", "")
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    stated = extract_stated_answer(text)
    return (stated, "stated") if stated is not None else (None, "none")
