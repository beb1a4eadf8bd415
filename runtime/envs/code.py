"""The ``code`` environment: write a program or function that passes hidden tests.

Task format (JSON object; the task sets in ``data/code.jsonl`` follow it)::

    {
      "id": "code-001",                  # optional, for logs and results
      "prompt": "Read two integers ...", # the problem statement the agent sees
      "mode": "stdio",                   # "stdio" (a program) or "function" (default "stdio")
      "entry_point": "solve",            # function mode: the function the solution must define
      "solution_file": "solution.py",    # where the agent writes it, relative to the workspace
      "tests": [                         # hidden: never shown to the agent
        {"input": "1 2\\n", "output": "3\\n"},          # stdio mode: stdin -> expected stdout
        {"code": "assert solve(1, 2) == 3"}            # function mode: Python, solution in scope
      ],
      "reward_mode": "all_pass",         # "all_pass" (1 or 0) or "fraction" (share passed)
      "time_limit_s": 2.0,               # per test, wall clock (CPU time is capped as well)
      "memory_limit_mb": 256,            # per test, address space
      "solution": "..."                  # optional reference solution; never shown to the agent
    }

INIT opens the sandbox; RUN gives the agent bash, the editor and submit, and its end kills every
process the agent started. EVAL copies the workspace into a grading sandbox of its own
(:mod:`rollout.runtime.envs.grading`), sends the tests to
:mod:`rollout.runtime.envs.code_runner` there on stdin, and runs every test in its own limited
process. A function-mode test passes only on a completion token the harness writes after the
test code returned (``os._exit(0)`` is not a pass); stdio outputs compare line by line ignoring
trailing whitespace.
"""

from __future__ import annotations

import json
import posixpath
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollout.runtime.agent_loop import run_agent_loop
from rollout.runtime.envs.common import (
    SANDBOX_KEY,
    check_task_object,
    invalid,
    optional_choice,
    optional_number,
    optional_str,
    quote,
    require_str,
    sandbox_of,
    sandbox_tools,
    write_private,
)
from rollout.runtime.envs.grading import end_agent, open_grader
from rollout.runtime.handler import AgentHandler, JobContext, RunOutcome
from rollout.runtime.tools.submit import SubmitTool
from rollout.runtime.types import Reward

ENV = "code"
RUNNER_SOURCE = Path(__file__).with_name("code_runner.py")

INSTRUCTIONS = (
    "You are an expert Python programmer working in a Linux sandbox. Solve the programming "
    "problem by writing a Python solution file with the tools. You may test it with bash. When "
    "the file is complete, call `submit` (its answer is a one-line summary). Hidden tests are "
    "run on your file after you submit.")


class CodeHandler(AgentHandler):
    name = ENV

    def validate_task(self, task: Mapping[str, Any]) -> None:
        check_task_object(task, ENV)
        require_str(task, "prompt", env=ENV)
        mode = optional_choice(task, "mode", ("stdio", "function"), env=ENV)
        if mode == "function":
            entry = require_str(task, "entry_point", env=ENV)
            if not entry.isidentifier():
                raise invalid(f"code task field 'entry_point' must be a Python identifier, "
                              f"got {entry!r}", "entry_point")
        solution_file = optional_str(task, "solution_file", "solution.py", env=ENV)
        norm = posixpath.normpath(solution_file)
        if not solution_file or norm.startswith(("/", "..")) or not norm.endswith(".py"):
            raise invalid("code task field 'solution_file' must be a relative .py path inside "
                          f"the workspace, got {solution_file!r}", "solution_file")
        optional_choice(task, "reward_mode", ("all_pass", "fraction"), env=ENV)
        optional_number(task, "time_limit_s", 2.0, env=ENV)
        optional_number(task, "memory_limit_mb", 256, env=ENV, minimum=16)
        tests = task.get("tests")
        if not isinstance(tests, list) or not tests:
            raise invalid("code task needs 'tests': a non-empty list of hidden tests", "tests")
        need = ("input", "output") if mode == "stdio" else ("code",)
        for i, test in enumerate(tests):
            if not isinstance(test, Mapping) or not all(
                    isinstance(test.get(k), str) for k in need):
                raise invalid(f"code task field 'tests'[{i}] must be an object with string "
                              f"fields {list(need)} in {mode} mode", f"tests[{i}]")
        if "solution" in task and not isinstance(task["solution"], str):
            raise invalid("code task field 'solution' must be a string", "solution")

    async def init(self, ctx: JobContext) -> None:
        self.validate_task(ctx.spec.task)
        ctx.state[SANDBOX_KEY] = await ctx.open_sandbox()

    async def run(self, ctx: JobContext) -> RunOutcome:
        sandbox = sandbox_of(ctx)
        tools = [*sandbox_tools(sandbox, ["bash", "editor"]),
                 SubmitTool(ctx.state, answer_description="A one-line summary of your solution.")]
        messages = [{"role": "system", "content": INSTRUCTIONS},
                    {"role": "user", "content": task_prompt(ctx.spec.task,
                                                            sandbox.workspace_in_sandbox)}]
        outcome = await run_agent_loop(ctx, tools, messages)
        await end_agent(ctx)
        return outcome

    async def eval(self, ctx: JobContext) -> Reward:
        task = ctx.spec.task
        tests = list(task["tests"])
        time_limit = float(task.get("time_limit_s", 2.0))
        grader = await open_grader(ctx)
        nonce = secrets.token_hex(16)
        spec = {
            "nonce": nonce, "mode": task.get("mode", "stdio"),
            "solution_file": posixpath.join(grader.workspace_in_sandbox,
                                            task.get("solution_file", "solution.py")),
            "tests": tests, "time_limit_s": time_limit,
            "memory_limit_mb": int(task.get("memory_limit_mb", 256)),
        }
        try:
            runner = await write_private(grader, "code_runner.py", RUNNER_SOURCE.read_bytes())
            # The spec (hidden tests, expected outputs, nonce) goes in on stdin: no file a
            # solution could read ever holds it.
            result = await grader.exec(
                quote("python", runner), stdin=json.dumps(spec).encode(),
                timeout=min(ctx.spec.limits.eval_timeout_s,
                            len(tests) * (time_limit + 2.0) + 30.0),
                cwd=grader.workspace_in_sandbox)
        finally:
            await grader.destroy()
        results = runner_results(result.stdout, nonce, len(tests))
        if results is None:
            # A solution can kill the runner (same user), so a missing result is a failure
            # of the solution's run, never a pass and never a retryable error.
            return Reward(0.0, {"passed": 0.0, "total": float(len(tests)), "fraction": 0.0},
                          {"error": f"the hidden-test runner gave no valid result (exit "
                                    f"{result.exit_code})", "log": result.output[-800:]})
        return score(results, task.get("reward_mode", "all_pass"))

    async def cleanup(self, ctx: JobContext) -> None:
        ctx.state.pop(SANDBOX_KEY, None)


def task_prompt(task: Mapping[str, Any], workspace: str) -> str:
    """What the agent reads: the problem and where the solution goes (never the tests)."""
    path = posixpath.join(workspace, task.get("solution_file", "solution.py"))
    if task.get("mode", "stdio") == "function":
        how = (f"Write your solution to `{path}`. It must define the function "
               f"`{task['entry_point']}`; the tests import your file and call it.")
    else:
        how = (f"Write your solution to `{path}` as a complete program: it reads standard input "
               "and writes the answer to standard output.")
    return f"{task['prompt'].strip()}\n\n{how}"


def runner_results(stdout: str, nonce: str, count: int) -> list[dict[str, Any]] | None:
    """The runner's per-test results, or None unless its line carries this run's nonce and
    one result per test."""
    try:
        payload = json.loads(stdout)
        results = payload["results"]
        if payload["nonce"] != nonce or not isinstance(results, list) or len(results) != count:
            return None
    except (ValueError, KeyError, TypeError):
        return None
    return [r if isinstance(r, dict) else {"passed": False} for r in results]


def score(results: Sequence[Mapping[str, Any]], reward_mode: str) -> Reward:
    passed = sum(bool(r.get("passed")) for r in results)
    total = len(results)
    fraction = passed / total if total else 0.0
    value = fraction if reward_mode == "fraction" else float(total > 0 and passed == total)
    statuses = [str(r.get("status", "")) for r in results]
    first_failure = next((r for r in results if not r.get("passed")), None)
    info = {"reward_mode": reward_mode, "statuses": ",".join(statuses)}
    if first_failure is not None:
        info["first_failure"] = str(first_failure.get("detail", ""))[:300]
    return Reward(value=value, components={"passed": float(passed), "total": float(total),
                                           "fraction": fraction}, info=info)
