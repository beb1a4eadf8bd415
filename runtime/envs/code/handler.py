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
(:mod:`rollout.runtime.envs.grading.isolated`), sends the tests to
:mod:`rollout.runtime.envs.in_sandbox.code_runner` there on stdin, and runs every test in its own
limited
process. A function-mode test passes only on a completion token the harness writes after the
test code returned (``os._exit(0)`` is not a pass); stdio outputs compare line by line ignoring
trailing whitespace.

The solution in the reply: code-RL setups (DeepCoder, LiveCodeBench, verl's code reward) grade
the last code block of the model's response, and small models answer that way instead of
calling the editor. So when RUN leaves nothing at the solution path (or an empty regular file),
EVAL takes the program from the *final* assistant message -- the one that ended the episode,
after any leading ``<think>`` reasoning; earlier turns are drafts the agent moved on from, as a
math answer comes from the final message too -- and writes it as the solution file in the
agent's workspace before the grader copies it, so it is graded exactly like a written file.
The block is the last closed fenced block labelled ``python`` / ``python3`` / ``py`` (any case),
else the last closed block with no language (an unlabelled block after a python one is usually
the program's sample output, so a labelled block wins); blocks in other languages and an
unclosed block (a turn cut off mid-program) are ignored. Anything the agent left at the path
wins and is never touched (a file, a directory, a link); the write goes through the host-side
no-follow file API, after every agent process is dead, and a block over
:data:`MAX_REPLY_SOLUTION_BYTES` is refused rather than cut. The reward's
``info["solution_source"]`` says which route was graded: ``file``, ``reply`` or ``none``.
"""

from __future__ import annotations

import asyncio
import json
import posixpath
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from rollout.runtime.agent_loop import run_agent_loop
from rollout.runtime.envs.common import (
    IN_SANDBOX,
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
from rollout.runtime.envs.grading.isolated import end_agent, open_grader
from rollout.runtime.handler import AgentHandler, JobContext, RunOutcome
from rollout.runtime.sandbox import hostfs
from rollout.runtime.toolcalls import THINK_CLOSE, THINK_OPEN, strip_reasoning
from rollout.runtime.tools.submit import SubmitTool
from rollout.runtime.types import Reward

ENV = "code"
RUNNER_SOURCE = IN_SANDBOX / "code_runner.py"

INSTRUCTIONS = (
    "You are an expert Python programmer working in a Linux sandbox. Solve the programming "
    "problem with a Python solution file, in one of two ways. Either write the file with the "
    "tools (you may test it with bash) and, when it is complete, call `submit` (its answer is "
    "a one-line summary). Or, without calling a tool, end your reply with one ```python block "
    "that holds the whole program: it is saved as the solution file. A file you wrote is "
    "graded instead of the block. Hidden tests are run on your solution when you are done.")

MAX_REPLY_SOLUTION_BYTES = 64 << 10
"""Largest program taken from the reply (UTF-8 bytes); a larger block is refused, not cut (a
truncated program is wrong anyway, and the grader copy stays small)."""
SOLUTION_SOURCE_KEY = "code.solution_source"
"""``ctx.state`` key: ``"reply"`` once EVAL wrote the reply's block, so an EVAL that runs again
still reports the reply as the source of the file it finds."""
REPLY_LANGUAGES = frozenset({"python", "python3", "py"})
_FENCE_OPEN = re.compile(r"^([ \t]*)(`{3,})[ \t]*([^`\s]*)[^`]*$")


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
        tools = [*sandbox_tools(sandbox, ["bash", "editor"], ctx),
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
        # Every agent process dies first: nothing can create the file between the check and
        # the write, or swap a link in under it.
        await end_agent(ctx)
        source = await adopt_reply_solution(ctx, posixpath.normpath(
            task.get("solution_file", "solution.py")))
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
                                    f"{result.exit_code})", "log": result.output[-800:],
                           **source})
        reward = score(results, task.get("reward_mode", "all_pass"))
        reward.info.update(source)
        return reward

    async def cleanup(self, ctx: JobContext) -> None:
        ctx.state.pop(SANDBOX_KEY, None)


def task_prompt(task: Mapping[str, Any], workspace: str) -> str:
    """What the agent reads: the problem and where the solution goes (never the tests)."""
    path = posixpath.join(workspace, task.get("solution_file", "solution.py"))
    where = f"Write your solution to `{path}`, or end your reply with it in one ```python block."
    if task.get("mode", "stdio") == "function":
        how = (f"{where} It must define the function `{task['entry_point']}`; the tests import "
               "your file and call it.")
    else:
        # Small models ask for input with a prompt (`input("Enter a number: ")`), which lands
        # on stdout and fails every test; say so once.
        how = (f"{where} It is a complete program: it reads standard input (plain `input()`, "
               "no prompt text) and prints only the answer to standard output.")
    return f"{task['prompt'].strip()}\n\n{how}"


def reply_solution(text: str) -> str | None:
    """The program in a reply (see the module docstring for which block), or None.

    Reasoning goes first: leading ``<think>`` blocks, and everything up to a ``</think>`` with
    no ``<think>`` before it (a template whose generation prompt opened the reasoning).
    Fences are read line by line as Markdown writes them: an opening line of three or more
    backticks and an optional language, a closing line of at least as many backticks and
    nothing else; the opening line's indentation is removed from the block's lines (a block
    inside a list item).
    """
    visible = strip_reasoning(text)
    head, sep, rest = visible.partition(THINK_CLOSE)
    if sep and THINK_OPEN not in head:
        visible = rest
    labelled: str | None = None
    bare: str | None = None
    fence: str | None = None
    language, indent = "", ""
    body: list[str] = []
    for line in visible.split("\n"):
        if fence is None:
            opening = _FENCE_OPEN.match(line.rstrip("\r"))
            if opening is not None:
                indent, fence, language = opening.group(1), opening.group(2), opening.group(3)
                body = []
            continue
        stripped = line.strip()
        if stripped.startswith(fence) and not stripped.strip("`"):
            fence = None
            program = "\n".join(body)
            if not program.strip():
                continue
            if language.lower() in REPLY_LANGUAGES:
                labelled = program
            elif not language:
                bare = program
            continue
        body.append(line[len(indent):] if line.startswith(indent) else line.lstrip(" \t"))
    return labelled if labelled is not None else bare


async def adopt_reply_solution(ctx: JobContext, rel_path: str) -> dict[str, str]:
    """Write the final reply's program as the solution file when the agent left none; returns
    the reward info saying which route is graded (``solution_source``, and why not the reply).

    Call only after :func:`end_agent`. Only a missing path or an empty regular file is
    replaced (the empty file is unlinked first, so a hard link to another file of the agent's
    is not written through); whatever else is there is the agent's and stays as it is.
    """
    if ctx.state.get(SOLUTION_SOURCE_KEY) == "reply":
        return {"solution_source": "reply"}
    sandbox = sandbox_of(ctx)
    root = sandbox.workspace
    try:
        kind = await asyncio.to_thread(hostfs.kind_beneath, root, rel_path)
    except OSError as e:  # a link or a file where a parent directory belongs
        return {"solution_source": "file", "solution_note": f"{rel_path}: {e}"[:300]}
    empty = False
    if kind == "file":
        try:
            empty = await asyncio.to_thread(hostfs.read_beneath, root, rel_path, 0) == b""
        except OSError:  # hostfs.FileTooLarge: it has content
            empty = False
    if kind is not None and not empty:
        return {"solution_source": "file"}
    missing = f"no solution file at {rel_path}"
    text = ctx.outcome.metadata.get("final_text", "") if ctx.outcome is not None else ""
    program = reply_solution(text)
    if program is None:
        return {"solution_source": "none", "solution_note": (
            f"{missing} and no closed ```python block in the final reply")}
    data = (program if program.endswith("\n") else program + "\n").encode(
        "utf-8", errors="replace")
    if len(data) > MAX_REPLY_SOLUTION_BYTES:
        return {"solution_source": "none", "solution_note": (
            f"{missing}; the final reply's code block is {len(data)} bytes, over the "
            f"{MAX_REPLY_SOLUTION_BYTES}-byte limit, so it was not used")}
    try:
        if empty:
            await sandbox.remove_file(rel_path)
        await sandbox.put_file(rel_path, data)
    except OSError as e:  # a full workspace quota, a read-only directory the agent made
        return {"solution_source": "none",
                "solution_note": f"{missing}; writing the reply's block failed: {e}"[:300]}
    ctx.state[SOLUTION_SOURCE_KEY] = "reply"
    return {"solution_source": "reply"}


def runner_results(stdout: str, nonce: str, count: int) -> list[dict[str, Any]] | None:
    """The runner's per-test results, or None unless its line carries this run's nonce and
    one result per test."""
    try:
        payload = json.loads(stdout)
        results = payload["results"]
        if payload["nonce"] != nonce or not isinstance(results, list) or len(results) != count:
            return None
    except (ValueError, KeyError, TypeError, RecursionError):
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
