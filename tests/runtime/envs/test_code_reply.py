"""The code environment grades a program the model writes in its final reply when it wrote no
solution file: through the same grading sandbox and hidden tests as a written file, never over
a file the agent left, never outside the workspace, bounded in size.

The rollouts are real (bubblewrap sandboxes, the agent loop, the code runner); the policy is
scripted. Where a test asserts what the grader saw, a hidden test reads the graded copy itself,
so the check does not go through the code under test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.code import handler as code_env
from rollout.runtime.envs.code.handler import MAX_REPLY_SOLUTION_BYTES, CodeHandler, reply_solution
from rollout.runtime.tasksets.shipped import load_tasks
from rollout.runtime.types import TerminationReason
from tests.runtime.envs.conftest import Rollout, call
from tests.runtime.envs.test_code_exploits import SNOOP, SQUARE

pytestmark = pytest.mark.timeout(90)

SUBMIT = call("submit", answer="done")
SUM = next(t for t in load_tasks("code") if t["id"] == "code-001")  # stdio: print a + b
SUM_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD = {"prompt": "Define add(a, b).", "mode": "function", "entry_point": "add",
       "tests": [{"code": "assert add(2, 3) == 5"}, {"code": "assert add(-1, 1) == 0"}]}
GOOD = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"


def block(source: str, language: str = "python") -> str:
    return f"```{language}\n{source}```"


def reply(source: str) -> str:
    """A final message the way small models write it: prose, the program, its sample output."""
    return (f"Here is my solution:\n\n{block(source)}\n\nFor the input `2 3` it prints:\n"
            "```\n5\n```\n")


def write(source: str, path: str = "/workspace/solution.py") -> str:
    return call("editor", command="create", path=path, file_text=source)


def bash(command: str) -> str:
    return call("bash", command=command)


def graded_source_is(expected: str, path: str = "/workspace/solution.py") -> dict[str, str]:
    """A hidden function-mode test that passes only if the graded file holds ``expected``."""
    return {"code": f"assert open({path!r}).read() == {expected!r}, 'graded file differs'"}


# ----------------------------------------------------------------------- graded from the reply

async def test_stdio_program_in_the_final_reply_is_graded_and_passes(rollout: Rollout) -> None:
    result = await rollout(CodeHandler(), SUM, [reply(SUM_PROGRAM)])
    # The block is the model showing its solution: the job has no python tool, so no call ran.
    assert result.outcome.termination is TerminationReason.NO_TOOL_CALL
    assert all(not turn.tool_calls for turn in result.outcome.turns)
    assert result.reward.value == 1.0, result.reward.info
    assert result.reward.components["passed"] == len(SUM["tests"])
    assert result.reward.info["solution_source"] == "reply"
    shown = result.prompt_text(0)
    assert "```python block" in shown and "/workspace/solution.py" in shown


async def test_function_in_the_final_reply_is_graded_byte_for_byte(rollout: Rollout) -> None:
    task = {**ADD, "tests": [*ADD["tests"], graded_source_is(GOOD)]}
    result = await rollout(CodeHandler(), task, [reply(GOOD)])
    assert result.reward.value == 1.0, result.reward.info
    assert result.reward.info["solution_source"] == "reply"


async def test_reply_goes_to_the_tasks_solution_file_in_a_new_directory(
        rollout: Rollout) -> None:
    path = "/workspace/pkg/deep/add.py"
    task = {**ADD, "solution_file": "pkg/deep/add.py",
            "tests": [*ADD["tests"], graded_source_is(GOOD, path)]}
    result = await rollout(CodeHandler(), task, [reply(GOOD)])
    assert result.reward.value == 1.0, result.reward.info
    assert path in result.prompt_text(0)


async def test_wrong_program_in_the_reply_earns_0(rollout: Rollout) -> None:
    result = await rollout(CodeHandler(), ADD, [reply(WRONG)])
    assert result.reward.value == 0.0
    assert result.reward.components["passed"] == 0
    assert "AssertionError" in result.reward.info["first_failure"]
    assert result.reward.info["solution_source"] == "reply"
    stdio = await rollout(CodeHandler(), SUM, [reply("print(int(input().split()[0]))\n")])
    assert stdio.reward.value == 0.0 and stdio.reward.info["solution_source"] == "reply"


async def test_empty_file_the_agent_left_is_replaced_without_touching_its_hard_link(
        rollout: Rollout) -> None:
    # solution.py is an empty hard link of keep.py: writing into it would fill keep.py too.
    task = {**ADD, "tests": [*ADD["tests"], graded_source_is("", "/workspace/keep.py")]}
    result = await rollout(CodeHandler(), task, [
        bash("touch /workspace/keep.py && ln /workspace/keep.py /workspace/solution.py"),
        reply(GOOD)])
    assert result.reward.value == 1.0, result.reward.info
    assert result.reward.info["solution_source"] == "reply"


# ----------------------------------------------------------------------------- the file wins

async def test_a_written_file_wins_over_the_reply(rollout: Rollout) -> None:
    wrong_file = await rollout(CodeHandler(), ADD, [write(WRONG), reply(GOOD)])
    assert wrong_file.outcome.termination is TerminationReason.NO_TOOL_CALL
    assert wrong_file.reward.value == 0.0, wrong_file.reward.info
    assert wrong_file.reward.info["solution_source"] == "file"
    good_file = await rollout(CodeHandler(), ADD, [write(GOOD), reply(WRONG)])
    assert good_file.reward.value == 1.0, good_file.reward.info
    assert good_file.reward.info["solution_source"] == "file"


async def test_a_link_at_the_solution_path_is_never_written_through(
        rollout: Rollout, tmp_path: Path) -> None:
    """A link the agent planted names a host file (the sandbox sees no such path): a server
    writing the reply through it would overwrite that host file."""
    victim = tmp_path / "victim.py"
    victim.write_text("host data\n")
    result = await rollout(CodeHandler(), ADD, [
        bash(f"ln -s {victim} /workspace/solution.py && echo linked"), reply(GOOD)])
    assert victim.read_text() == "host data\n"
    assert result.reward.value == 0.0
    assert result.reward.info["solution_source"] == "file"


async def test_a_linked_parent_directory_is_never_written_through(
        rollout: Rollout, tmp_path: Path) -> None:
    host_dir = tmp_path / "host-dir"
    host_dir.mkdir()
    task = {**ADD, "solution_file": "pkg/add.py"}
    result = await rollout(CodeHandler(), task, [
        bash(f"ln -s {host_dir} /workspace/pkg && echo linked"), reply(GOOD)])
    assert list(host_dir.iterdir()) == []
    assert result.reward.value == 0.0
    assert result.reward.info["solution_source"] == "file"
    assert "pkg/add.py" in result.reward.info["solution_note"]


# ----------------------------------------------------------------------- which reply, which block

async def test_no_file_and_no_block_earns_0_and_says_why(rollout: Rollout) -> None:
    result = await rollout(CodeHandler(), SUM, ["I would read two numbers and add them."])
    assert result.reward.value == 0.0
    assert result.reward.info["solution_source"] == "none"
    assert result.reward.info["solution_note"] == (
        "no solution file at solution.py and no closed ```python block in the final reply")
    assert "does not exist" in result.reward.info["first_failure"]
    submitted = await rollout(CodeHandler(), ADD, [SUBMIT])
    assert submitted.reward.info["solution_source"] == "none"


async def test_only_the_final_message_counts(rollout: Rollout) -> None:
    """A block in an earlier turn is a draft the agent moved on from; the final message (here a
    bare submit) has none, so nothing is graded."""
    draft = f"First a draft:\n{block(GOOD)}\n" + bash("echo testing")
    result = await rollout(CodeHandler(), ADD, [draft, SUBMIT])
    assert result.outcome.termination is TerminationReason.SUBMITTED
    assert result.reward.value == 0.0
    assert result.reward.info["solution_source"] == "none"
    final = await rollout(CodeHandler(), ADD, [draft, f"Final:\n{block(GOOD)}\n{SUBMIT}"])
    assert final.reward.value == 1.0, final.reward.info
    assert final.reward.info["solution_source"] == "reply"


async def test_a_cut_off_block_is_not_graded(rollout: Rollout) -> None:
    result = await rollout(CodeHandler(), ADD, [f"Solution:\n```python\n{GOOD}"])
    assert result.reward.info["solution_source"] == "none"
    assert result.reward.value == 0.0


@pytest.mark.parametrize(("text", "expected"), [
    ("```python\nx = 1\n```", "x = 1"),
    ("```Python3\nx = 1\n```", "x = 1"),
    ("```py title=a.py\nx = 1\n```", "x = 1"),
    ("```\nx = 1\n```", "x = 1"),
    # A labelled block wins over a later bare one (sample output), the last labelled wins.
    ("```python\nx = 1\n```\nprints\n```\n1\n```", "x = 1"),
    ("```python\nx = 1\n```\nbetter:\n```python\nx = 2\n```", "x = 2"),
    ("```\nx = 1\n```\n```\nx = 2\n```", "x = 2"),
    # Other languages, empty and unclosed blocks are not programs.
    ("```bash\nls\n```", None),
    ("```python\nx = 1\n```\n```python\n\n```", "x = 1"),
    ("```python\nx = 1\n```\n```python\nx = 2", "x = 1"),
    ("no code at all", None),
    # The closing fence needs as many backticks, alone on its line.
    ("````python\ns = '''\n```\n'''\n````", "s = '''\n```\n'''"),
    ("```python\nprint('```')\n```", "print('```')"),
    # A block in a list item loses the item's indentation, keeps its own.
    ("1. Code:\n   ```python\n   def f():\n       return 1\n   ```", "def f():\n    return 1"),
    # Reasoning is not the answer: leading <think>, or a </think> the template opened.
    ("<think>\n```python\nx = 1\n```\n</think>\nDone.", None),
    ("<think>\n```python\nx = 1\n```\n</think>\n```python\nx = 2\n```", "x = 2"),
    ("plan: ```python\nx = 1\n```\n</think>\n```python\nx = 2\n```", "x = 2"),
    ("<think>\n```python\nx = 1\n```\n", None),
    ("```python\r\nx = 1\r\n```\r\n", "x = 1\r"),
])
def test_which_block_is_the_program(text: str, expected: str | None) -> None:
    assert reply_solution(text) == expected


# ----------------------------------------------------------------------- a hostile reply

@pytest.mark.parametrize("source", [
    "import os\nos._exit(0)\n",
    "import os\ndef add(a, b):\n    os._exit(0)\n",
], ids=["exit-at-import", "exit-in-function"])
async def test_exiting_with_status_0_from_the_reply_is_not_a_pass(
        source: str, rollout: Rollout) -> None:
    result = await rollout(CodeHandler(), ADD, [reply(source)])
    assert result.reward.value == 0.0, result.reward.info
    assert result.reward.info["statuses"] == "error,error"
    assert result.reward.info["solution_source"] == "reply"


async def test_a_reply_program_cannot_read_the_hidden_tests(rollout: Rollout) -> None:
    result = await rollout(CodeHandler(), SQUARE, [reply(SNOOP)])
    assert result.reward.info["solution_source"] == "reply"
    assert result.reward.value == 0.0
    assert result.reward.info["statuses"] == "failed"


async def test_an_oversized_block_is_refused_whole(rollout: Rollout) -> None:
    # '#' runs tokenize compactly, so the block fits in one scripted turn.
    padding = MAX_REPLY_SOLUTION_BYTES - len(GOOD) - 1
    just_under = GOOD + "#" * padding + "\n"
    assert len(just_under.encode()) == MAX_REPLY_SOLUTION_BYTES
    fits = await rollout(CodeHandler(), ADD, [reply(just_under)])
    assert fits.reward.value == 1.0, fits.reward.info
    over = await rollout(CodeHandler(), ADD, [reply(GOOD + "#" * (padding + 1) + "\n")])
    assert over.reward.value == 0.0
    assert over.reward.info["solution_source"] == "none"
    assert f"over the {MAX_REPLY_SOLUTION_BYTES}-byte limit" in over.reward.info["solution_note"]


async def test_an_eval_run_again_still_reports_the_reply(
        rollout: Rollout, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second EVAL finds the file the first one wrote; it is still the reply's."""
    seen: list[Any] = []
    original = CodeHandler.eval

    async def twice(self: CodeHandler, ctx: Any) -> Any:
        seen.append(await original(self, ctx))
        return await original(self, ctx)

    monkeypatch.setattr(code_env.CodeHandler, "eval", twice)
    result = await rollout(CodeHandler(), ADD, [reply(GOOD)])
    assert seen[0].value == 1.0 and seen[0].info["solution_source"] == "reply"
    assert result.reward.value == 1.0
    assert result.reward.info["solution_source"] == "reply"
