"""Every shipped math task: the right answer earns 1, a wrong or missing one earns 0."""

from __future__ import annotations

from typing import Any

import pytest

from rollout.runtime.envs.common import DATA_DIR
from rollout.runtime.envs.math.answers import answers_equivalent
from rollout.runtime.envs.math.handler import EXAMPLE, MathHandler
from rollout.runtime.tasksets.shipped import load_tasks, read_task_file
from rollout.runtime.types import TerminationReason
from tests.runtime.envs.conftest import Rollout, call

pytestmark = pytest.mark.timeout(60)

TASKS = load_tasks("math")
IDS = [t["id"] for t in TASKS]


def wrong_answer(gold: str) -> str:
    return "12345/7" if gold != "12345/7" else "1"


@pytest.mark.parametrize("task", TASKS, ids=IDS)
async def test_submitting_the_answer_earns_1(task: dict[str, Any], rollout: Rollout) -> None:
    result = await rollout(MathHandler(), task, [call("submit", answer=task["answer"])])
    assert result.outcome.termination is TerminationReason.SUBMITTED
    assert result.reward.value == 1.0, result.reward.info
    assert result.reward.info["answer_source"] == "submit"


@pytest.mark.parametrize("task", TASKS, ids=IDS)
async def test_wrong_or_missing_answer_earns_0(task: dict[str, Any], rollout: Rollout) -> None:
    script = [call("submit", answer=wrong_answer(task["answer"]))]
    wrong = await rollout(MathHandler(), task, script)
    assert wrong.reward.value == 0.0
    silent = await rollout(MathHandler(), task, ["I am not sure."])
    assert silent.outcome.termination is TerminationReason.NO_TOOL_CALL
    assert silent.reward.value == 0.0
    assert silent.reward.info["answer_source"] == "none"


async def test_boxed_answer_in_final_text_counts(rollout: Rollout) -> None:
    task = {"question": "What is 1/2 + 1/4?", "answer": "3/4", "tools": []}
    result = await rollout(MathHandler(), task, ["So the sum is \\boxed{0.75}."])
    assert result.reward.value == 1.0
    assert result.reward.info["answer_source"] == "boxed"


async def test_a_stated_answer_counts_after_box_and_submit(rollout: Rollout) -> None:
    """Small models often end with "The answer is 43." instead of a box: it counts, but a box
    in the same message wins over it."""
    task = {"question": "What is 15 + 28?", "answer": "43", "tools": []}
    stated = await rollout(MathHandler(), task, ["15 + 28 = 43\nThe answer is 43."])
    assert stated.reward.value == 1.0
    assert stated.reward.info["answer_source"] == "stated"
    boxed = await rollout(MathHandler(), task, ["\\boxed{42}\nThe answer is 43."])
    assert (boxed.reward.value, boxed.reward.info["answer_source"]) == (0.0, "boxed")


async def test_submit_wins_over_boxed_text(rollout: Rollout) -> None:
    task = {"question": "What is 2 + 2?", "answer": "4", "tools": []}
    result = await rollout(MathHandler(), task,
                           ["I think \\boxed{4}\n" + call("submit", answer="5")])
    assert result.reward.value == 0.0
    assert result.reward.info == {"predicted": "5", "answer_source": "submit", "gold": "4"}


async def test_python_tool_runs_in_the_sandbox(rollout: Rollout) -> None:
    task = next(t for t in TASKS if t["id"] == "math-021")  # digit sum of 2^100
    script = [call("python", code="print(sum(map(int, str(2**100))))"),
              call("submit", answer="115")]
    result = await rollout(MathHandler(), task, script)
    assert result.reward.value == 1.0
    assert "115" in result.prompt_text()  # the observation came back from the kernel


async def test_worked_example_precedes_the_task_only_with_python(rollout: Rollout) -> None:
    task = {"question": "What is 2 + 3?", "answer": "5"}
    shown = (await rollout(MathHandler(), task, [call("submit", answer="5")])).prompt_text()
    assert 0 <= shown.index("print(31 + 45)") < shown.index("What is 2 + 3?")
    bare = await rollout(MathHandler(), {**task, "tools": []}, [call("submit", answer="5")])
    assert "31 + 45" not in bare.prompt_text(), "no example of a tool the task does not give"


def test_copying_the_example_answer_earns_nothing() -> None:
    shown = [m["content"] for m in EXAMPLE if m["role"] == "tool"]
    assert shown == ["76", "50"]
    for task in [*TASKS, *read_task_file(DATA_DIR / "quickstart-math.jsonl", "math")]:
        for answer in shown:
            assert not answers_equivalent(answer, task["answer"]), task["id"]
