"""The finish tool: the model hands in its answer and the agent loop stops.

An explicit submit call tells EVAL exactly what the model meant as its answer (no guessing from
free text) and gives the trajectory a clean SUBMITTED termination.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, MutableMapping
from typing import Any

from rollout.runtime.tools.base import ToolResult

SUBMITTED_ANSWER_KEY = "submitted_answer"
"""Key under which the answer is stored in ``ctx.state`` and in ``RunOutcome.metadata``."""


class SubmitTool:
    """``submit(answer)``: records the answer and finishes the episode.

    ``state`` is normally ``ctx.state``, so EVAL (possibly in another worker) reads the answer
    from ``ctx.state[SUBMITTED_ANSWER_KEY]``. A call without an answer is an error the model
    can correct, not a finish.
    """

    def __init__(self, state: MutableMapping[str, Any] | None = None, *, name: str = "submit",
                 description: str = "Submit your final answer. This ends the episode; call it "
                                    "exactly once, when you are done.",
                 answer_description: str = "The final answer.") -> None:
        self.name = name
        self.description = description
        self.parameters: Mapping[str, Any] = {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": answer_description}},
            "required": ["answer"],
        }
        self.state: MutableMapping[str, Any] = state if state is not None else {}
        self.answer: str | None = None

    async def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        if "answer" not in arguments:
            return ToolResult("Error: submit needs an `answer` argument.", is_error=True)
        raw = arguments["answer"]
        # Models often submit numbers or lists as JSON values; EVAL compares text.
        answer = raw if isinstance(raw, str) else json.dumps(raw)
        self.answer = answer
        self.state[SUBMITTED_ANSWER_KEY] = answer
        return ToolResult("Answer submitted.", finish=True)
