"""Every shipped code task: the reference solution earns 1, no solution or a wrong one 0;
hidden tests stay hidden and limits hold."""

from __future__ import annotations

from typing import Any

import pytest

from rollout.runtime.envs.code.handler import CodeHandler
from rollout.runtime.handler import JobContext
from rollout.runtime.tasksets.shipped import load_tasks
from rollout.runtime.types import TerminationReason
from tests.runtime.envs.conftest import Rollout, call

pytestmark = pytest.mark.timeout(90)

TASKS = load_tasks("code")
IDS = [t["id"] for t in TASKS]
SUBMIT = call("submit", answer="done")


def write_solution(source: str, path: str = "/workspace/solution.py") -> str:
    return call("editor", command="create", path=path, file_text=source)


@pytest.mark.parametrize("task", TASKS, ids=IDS)
async def test_reference_solution_earns_1(task: dict[str, Any], rollout: Rollout) -> None:
    result = await rollout(CodeHandler(), task, [write_solution(task["solution"]), SUBMIT])
    assert result.outcome.termination is TerminationReason.SUBMITTED
    assert result.reward.value == 1.0, result.reward.info
    assert result.reward.components["passed"] == len(task["tests"])


@pytest.mark.parametrize("task", TASKS, ids=IDS)
async def test_no_solution_or_wrong_solution_earns_0(task: dict[str, Any],
                                                     rollout: Rollout) -> None:
    noop = await rollout(CodeHandler(), task, [SUBMIT])
    assert noop.reward.value == 0.0
    assert "does not exist" in noop.reward.info["first_failure"]
    wrong_src = ("def __getattr__(name):\n    return lambda *a, **k: None\n"
                 "print('no idea')\n")
    wrong = await rollout(CodeHandler(), task, [write_solution(wrong_src), SUBMIT])
    assert wrong.reward.value == 0.0
    assert wrong.reward.components["passed"] == 0


async def test_hidden_tests_and_reference_never_reach_the_agent(rollout: Rollout) -> None:
    task = next(t for t in TASKS if t["id"] == "code-007")
    seen: list[str] = []

    async def look(ctx: JobContext) -> None:
        sandbox = ctx.state["env.sandbox"]
        out = await sandbox.exec("ls -AR /workspace /tmp; cat /tmp/*/* 2>/dev/null",
                                 timeout=30)
        seen.append(out.stdout)

    result = await rollout(CodeHandler(), task, [write_solution(task["solution"]), SUBMIT],
                           inspect=look)
    shown = result.prompt_text(0)
    assert "roman_to_int" in shown and "/workspace/solution.py" in shown
    assert "MCMXCIV" not in shown and "values = {" not in shown
    assert "MCMXCIV" not in seen[0] and ".rollout-eval" not in seen[0]


async def test_fraction_mode_gives_partial_credit(rollout: Rollout) -> None:
    task = next(t for t in TASKS if t["id"] == "code-006")
    assert task["reward_mode"] == "fraction"
    quadratic = ("def two_sum(nums, target):\n    for i in range(len(nums)):\n"
                 "        for j in range(i + 1, len(nums)):\n"
                 "            if nums[i] + nums[j] == target:\n                return [i, j]\n")
    result = await rollout(CodeHandler(), {**task, "time_limit_s": 1.0},
                           [write_solution(quadratic), SUBMIT])
    assert result.reward.value == pytest.approx(3 / 4)
    assert result.reward.info["statuses"].split(",")[-1] == "timeout"
    strict = await rollout(CodeHandler(), {**task, "time_limit_s": 1.0, "reward_mode": "all_pass"},
                           [write_solution(quadratic), SUBMIT])
    assert strict.reward.value == 0.0


async def test_time_and_memory_limits_fail_only_the_offending_test(rollout: Rollout) -> None:
    task = {"prompt": "Echo a number; loop on 1, allocate on 2.", "mode": "stdio",
            "time_limit_s": 1.0, "memory_limit_mb": 128,
            "tests": [{"input": "0\n", "output": "0\n"}, {"input": "1\n", "output": "1\n"},
                      {"input": "2\n", "output": "2\n"}]}
    source = ("n = int(input())\nif n == 1:\n    while True:\n        pass\n"
              "if n == 2:\n    hog = bytearray(512 << 20)\nprint(n)\n")
    result = await rollout(CodeHandler(), {**task, "reward_mode": "fraction"},
                           [write_solution(source), SUBMIT])
    assert result.reward.info["statuses"] == "passed,timeout,memory"
    assert result.reward.value == pytest.approx(1 / 3)


async def test_function_mode_solution_at_a_custom_path(rollout: Rollout) -> None:
    task = {"prompt": "Define add(a, b).", "mode": "function", "entry_point": "add",
            "solution_file": "pkg/add.py", "tests": [{"code": "assert add(2, 3) == 5"}]}
    good = await rollout(CodeHandler(), task, [
        write_solution("def add(a, b):\n    return a + b\n", "/workspace/pkg/add.py"), SUBMIT])
    assert good.reward.value == 1.0
    assert "/workspace/pkg/add.py" in good.prompt_text()
