"""The ``math`` environment: a question with one final answer, a Python tool to work with.

Task format (JSON object; ``data/math.jsonl`` follows it)::

    {
      "id": "math-002",                          # optional, for logs and results
      "question": "Compute 3/4 + 1/6 ...",       # what the agent sees
      "answer": "\\frac{11}{12}",                # gold answer: number, fraction, simple LaTeX
      "tools": ["python"],                       # optional sandbox tools (default: python)
      "rel_tol": 1e-9                            # optional tolerance for numeric answers
    }

The agent answers by calling ``submit(answer)`` or, without a submit call, by ending its last
message with ``\\boxed{...}``; a submitted answer wins over any boxed text. EVAL compares with
:func:`rollout.runtime.envs.answers.answers_equivalent` (``0.75 == 3/4 == \\frac{3}{4}``,
``1,048,576 == 1048576``, ``\\frac{\\sqrt{3}}{2} == sqrt(3)/2``) on the host: scoring needs no
sandbox. A task with ``"tools": []`` never opens a sandbox at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from rollout.runtime.agent_loop import run_agent_loop
from rollout.runtime.envs.answers import answers_equivalent, extract_boxed
from rollout.runtime.envs.common import (
    SANDBOX_KEY,
    check_task_object,
    invalid,
    require_str,
    sandbox_of,
    sandbox_tools,
)
from rollout.runtime.handler import AgentHandler, JobContext, RunOutcome
from rollout.runtime.tools.submit import SUBMITTED_ANSWER_KEY, SubmitTool
from rollout.runtime.types import Reward

ENV = "math"
ALLOWED_TOOLS = ("python", "bash")

INSTRUCTIONS = (
    "You are a careful mathematician. Use the `python` tool to calculate, then call `submit` "
    "with only the final answer (a number or a simple expression such as 3/4 or \\sqrt{2}).")

# A worked example as real turns of the conversation, because a small model copies a
# demonstration far better than it follows a description (SmolLM2-135M-Instruct called no tool
# in any quickstart job under the description alone). The example's numbers appear in no
# shipped task, so copying its answer earns nothing.
EXAMPLE = (
    {"role": "user", "content": "What is 31 + 45?"},
    {"role": "assistant",
     "content": '<tool_call>\n{"name": "python", "arguments": {"code": "print(31 + 45)"}}\n'
                "</tool_call>"},
    {"role": "tool", "name": "python", "content": "76"},
    {"role": "assistant",
     "content": '<tool_call>\n{"name": "submit", "arguments": {"answer": "76"}}\n</tool_call>'},
    {"role": "tool", "name": "submit", "content": "Answer submitted."},
)
"""Shown before the task when the task has the python tool (a task without it, such as the
README's ``"tools": []`` example, gets no example of a tool it cannot call)."""


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
        tools: list[Any] = sandbox_tools(sandbox_of(ctx), names) if names else []
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
    """(answer, where it came from): the submit tool's answer, else the last ``\\boxed{}``."""
    if SUBMITTED_ANSWER_KEY in ctx.state:
        return str(ctx.state[SUBMITTED_ANSWER_KEY]), "submit"
    metadata = ctx.outcome.metadata if ctx.outcome is not None else {}
    if SUBMITTED_ANSWER_KEY in metadata:
        return metadata[SUBMITTED_ANSWER_KEY], "submit"
    boxed = extract_boxed(metadata.get("final_text", ""))
    return (boxed, "boxed") if boxed is not None else (None, "none")
