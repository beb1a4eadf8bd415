"""Hidden-test runner for the ``code`` environment. Runs INSIDE the sandbox, stdlib only.

The handler copies this file and a JSON spec into the sandbox's private ``/tmp`` only at EVAL
(the agent never sees the tests), then runs ``python code_runner.py SPEC``. Every test runs in
its own child process with a wall-clock timeout and RLIMIT_AS / RLIMIT_CPU, so one infinite loop
or memory hog fails that test only. The result is one JSON object on stdout::

    {"results": [{"passed": bool, "status": "passed|failed|error|timeout|memory", "detail": str}]}

Spec fields: ``mode`` ("stdio" | "function"), ``solution_file``, ``tests`` (stdio: ``{"input",
"output"}``; function: ``{"code"}`` — Python run with the solution module's names in scope),
``time_limit_s``, ``memory_limit_mb``.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable

_FUNCTION_HARNESS = r"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("solution", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules["solution"] = module
spec.loader.exec_module(module)
namespace = {k: v for k, v in vars(module).items() if not k.startswith("__")}
exec(compile(sys.stdin.read(), "<hidden test>", "exec"), namespace)
"""
_DETAIL_CHARS = 500


def _limits(memory_mb: int, cpu_s: int) -> Callable[[], None]:
    def apply() -> None:
        mem = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    return apply


def _normalize(text: str) -> str:
    """Outputs compare line by line, ignoring trailing spaces and trailing blank lines."""
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).strip("\n")


def run_test(spec: dict, test: dict) -> dict:
    solution = os.path.abspath(spec["solution_file"])
    if not os.path.isfile(solution):
        return {"passed": False, "status": "error",
                "detail": f"{spec['solution_file']} does not exist"}
    time_limit = float(spec["time_limit_s"])
    if spec["mode"] == "stdio":
        argv, stdin = [sys.executable, solution], test.get("input", "")
    else:
        argv, stdin = [sys.executable, "-c", _FUNCTION_HARNESS, solution], test["code"]
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
            preexec_fn=_limits(int(spec["memory_limit_mb"]), int(time_limit) + 1))
    except OSError as e:
        return {"passed": False, "status": "error", "detail": str(e)}
    try:
        out, err = proc.communicate(stdin, timeout=time_limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"passed": False, "status": "timeout",
                "detail": f"no result within {time_limit:g} s"}
    if proc.returncode != 0:
        status = "memory" if "MemoryError" in err else "error"
        if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            status = "timeout"
        return {"passed": False, "status": status, "detail": err[-_DETAIL_CHARS:]}
    if spec["mode"] == "stdio" and _normalize(out) != _normalize(test.get("output", "")):
        return {"passed": False, "status": "failed", "detail": "wrong output"}
    return {"passed": True, "status": "passed", "detail": ""}


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:
        spec = json.load(f)
    results = [run_test(spec, test) for test in spec["tests"]]
    sys.stdout.write(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
