"""Hidden-test runner for the ``code`` environment. Runs INSIDE the grading sandbox, stdlib only.

The handler starts ``python code_runner.py`` in a sandbox of its own (a copy of the agent's
workspace, no process of the agent alive) and sends a JSON spec on stdin, so the hidden tests
never exist as a file a solution could read. Every test runs in its own child process with a
wall-clock timeout and RLIMIT_AS / RLIMIT_CPU, so one infinite loop or memory hog fails that
test only. The result is one JSON object on stdout::

    {"nonce": "<the spec's nonce>",
     "results": [{"passed": bool, "status": "passed|failed|error|timeout|memory", "detail": str}]}

Why a solution cannot forge a pass:

- A function-mode test passes only when the harness writes the test's own random token to a
  private pipe *after* the test code returned. The harness reads the token from another pipe
  and closes it before it imports the solution, so ``os._exit(0)`` at import or inside the
  function (exit status 0, no token) is a failure, not a pass.
- The runner makes itself non-dumpable (``PR_SET_DUMPABLE`` 0) before starting any test, so a
  solution running as the same user can neither ptrace it nor open ``/proc/<runner>/fd/1`` to
  write a fake result line; the result line carries the spec's nonce, which the handler checks.

What a function-mode solution could still do: it runs in the harness's own process, so it
could walk up the call stack to the harness's frame, read the token and write it itself. The
runner screens every ``.py`` file of the workspace first (:data:`SCREEN`: frame and stack
access, ``gc`` object walks, ``/proc/self``, the harness's descriptors through ``sys.argv`` or
``os.write``, tracing hooks) and fails every test of a solution that has any, with the line
named; a solution has no business with the harness that judges it. Code that hides such a
call from a text screen (``getattr`` on built strings) is not caught: docs/grading.md.

Spec fields: ``nonce``, ``mode`` ("stdio" | "function"), ``solution_file``, ``tests`` (stdio:
``{"input", "output"}``; function: ``{"code"}`` — Python run with the solution module's names in
scope), ``time_limit_s``, ``memory_limit_mb``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import resource
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable

_FUNCTION_HARNESS = r"""
import importlib.util, os, sys
def _main(token_fd, done_fd, path):
    token = os.read(token_fd, 64)
    os.close(token_fd)
    spec = importlib.util.spec_from_file_location("solution", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["solution"] = module
    spec.loader.exec_module(module)
    namespace = {k: v for k, v in vars(module).items() if not k.startswith("__")}
    exec(compile(sys.stdin.read(), "<hidden test>", "exec"), namespace)
    os.write(done_fd, token)
    os.close(done_fd)
_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
"""
_DETAIL_CHARS = 500
SCREEN = re.compile(
    r"\bsys\._getframe\b|\bf_(?:back|locals|globals)\b|\btb_frame\b|\binspect\.(?:"
    r"currentframe|stack|getouterframes|getinnerframes|trace)\b|\bgc\.get_(?:objects|referrers"
    r"|referents)\b|/proc/self|\bsys\.argv\b|\bos\.(?:write|fdopen|dup2?|read)\b|"
    r"\bsys\.(?:settrace|setprofile|addaudithook)\b|\bframe\.f_")
_MAX_SCREENED = 1 << 20
_PR_SET_DUMPABLE = 4


def _limits(memory_mb: int, cpu_s: int) -> Callable[[], None]:
    def apply() -> None:
        mem = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    return apply


def _normalize(text: str) -> str:
    """Outputs compare line by line, ignoring trailing spaces and trailing blank lines."""
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).strip("\n")


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    return b"".join(chunks)


def run_test(spec: dict, test: dict) -> dict:
    solution = os.path.abspath(spec["solution_file"])
    if not os.path.isfile(solution):
        return {"passed": False, "status": "error",
                "detail": f"{spec['solution_file']} does not exist"}
    time_limit = float(spec["time_limit_s"])
    function_mode = spec["mode"] != "stdio"
    token = secrets.token_hex(16).encode()
    pipes: list[int] = []
    if function_mode:
        token_r, token_w = os.pipe()
        done_r, done_w = os.pipe()
        os.write(token_w, token)  # 32 bytes: fits the pipe buffer, never blocks
        os.close(token_w)
        pipes = [token_r, done_w]
        argv = [sys.executable, "-c", _FUNCTION_HARNESS, str(token_r), str(done_w), solution]
        stdin = test["code"]
    else:
        argv, stdin = [sys.executable, solution], test.get("input", "")
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True, pass_fds=pipes,
            preexec_fn=_limits(int(spec["memory_limit_mb"]), int(time_limit) + 1))
    except OSError as e:
        for fd in pipes:
            os.close(fd)
        if function_mode:
            os.close(done_r)
        return {"passed": False, "status": "error", "detail": str(e)}
    for fd in pipes:  # the child's ends: only the child may hold them now
        os.close(fd)
    try:
        out, err = proc.communicate(stdin, timeout=time_limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        if function_mode:
            os.close(done_r)
        return {"passed": False, "status": "timeout",
                "detail": f"no result within {time_limit:g} s"}
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # what the test left running must not outlive it
    completed = True
    if function_mode:
        # A grandchild could keep the pipe open forever; the group is dead by now.
        os.set_blocking(done_r, False)
        try:
            completed = _read_all(done_r) == token
        except BlockingIOError:
            completed = False
        os.close(done_r)
    # The token proves the test code returned; an exit status proves nothing.
    if proc.returncode != 0 and (not function_mode or not completed):
        status = "memory" if "MemoryError" in err else "error"
        if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            status = "timeout"
        return {"passed": False, "status": status, "detail": err[-_DETAIL_CHARS:]}
    if not completed:
        return {"passed": False, "status": "error",
                "detail": "the test did not run to its end (the process exited before the "
                          f"test code returned): {err[-_DETAIL_CHARS:]}"}
    if not function_mode and _normalize(out) != _normalize(test.get("output", "")):
        return {"passed": False, "status": "failed", "detail": "wrong output"}
    return {"passed": True, "status": "passed", "detail": ""}


def _make_undumpable() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def screen(root: str) -> str:
    """The first line of a ``.py`` file under ``root`` that reaches into the harness ('' for
    none)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                text = f.read(_MAX_SCREENED).decode("utf-8", "replace")
            for number, line in enumerate(text.splitlines(), 1):
                if SCREEN.search(line):
                    where = os.path.relpath(path, root)
                    return f"{where}:{number}: {line.strip()[:200]}"
    return ""


def main() -> int:
    spec = json.loads(sys.stdin.read())
    _make_undumpable()
    found = screen(os.getcwd()) if spec["mode"] != "stdio" else ""
    if found:
        detail = f"the solution reaches into the test harness (frames, descriptors): {found}"
        results = [{"passed": False, "status": "error", "detail": detail[:_DETAIL_CHARS]}
                   for _ in spec["tests"]]
    else:
        results = [run_test(spec, test) for test in spec["tests"]]
    sys.stdout.write(json.dumps({"nonce": spec["nonce"], "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
