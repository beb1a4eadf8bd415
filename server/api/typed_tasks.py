"""Typed tasks (proto/rollout/v1/tasks.proto) to the JSON task objects the environments read.

The environments define their task formats as JSON objects (runtime/envs/{math,code,swe}.py
docstrings) and validate those; a typed task is only a checked, documented way to write one.
So the conversion is mechanical: fields keep the environment's names, unset optional fields
are left out (the environment's default applies), and the result is validated by the
environment exactly like a ``task`` Struct. Nothing here knows what a valid task is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout.runtime.types import InvalidArgument
from rollout.v1 import tasks_pb2

ENVIRONMENTS = {"math": "math", "code": "code", "swe": "swe"}
"""Field of JobSpec.typed_task -> the environment it implies."""

_MODES = {tasks_pb2.CodeTask.MODE_UNSPECIFIED: None, tasks_pb2.CodeTask.MODE_STDIO: "stdio",
          tasks_pb2.CodeTask.MODE_FUNCTION: "function"}
_REWARD_MODES = {tasks_pb2.CodeTask.REWARD_MODE_UNSPECIFIED: None,
                 tasks_pb2.CodeTask.REWARD_MODE_ALL_PASS: "all_pass",
                 tasks_pb2.CodeTask.REWARD_MODE_FRACTION: "fraction"}


def _put(out: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key`` unless ``value`` is empty (proto3 cannot tell empty from unset)."""
    if value not in ("", [], {}, None):
        out[key] = value


def math_task(t: tasks_pb2.MathTask) -> dict[str, Any]:
    out: dict[str, Any] = {"question": t.question, "answer": t.answer}
    _put(out, "id", t.id)
    if t.no_tools:
        if t.tools:
            raise InvalidArgument("math.no_tools runs without tools: leave math.tools empty",
                                  "INVALID_TASK", "math.tools")
        out["tools"] = []
    else:
        _put(out, "tools", list(t.tools))
    if t.HasField("rel_tol"):
        out["rel_tol"] = t.rel_tol
    return out


def code_task(t: tasks_pb2.CodeTask) -> dict[str, Any]:
    mode = _enum(_MODES, t.mode, "code.mode")
    out: dict[str, Any] = {"prompt": t.prompt}
    _put(out, "id", t.id)
    _put(out, "mode", mode)
    _put(out, "entry_point", t.entry_point)
    _put(out, "solution_file", t.solution_file)
    # A test carries the fields of its mode only, as the environment's format has them.
    out["tests"] = [{"code": x.code} if mode == "function"
                    else {"input": x.input, "output": x.output} for x in t.tests]
    _put(out, "reward_mode", _enum(_REWARD_MODES, t.reward_mode, "code.reward_mode"))
    if t.HasField("time_limit_s"):
        out["time_limit_s"] = t.time_limit_s
    if t.HasField("memory_limit_mb"):
        out["memory_limit_mb"] = t.memory_limit_mb
    _put(out, "solution", t.solution)
    return out


def swe_task(t: tasks_pb2.SweTask) -> dict[str, Any]:
    """A repository instance (``repo_source``), or an image instance: ``image`` becomes
    ``spec.image``, as the environment's format has it (runtime/envs/swe/images.py)."""
    if t.image and t.repo_source:
        raise InvalidArgument("swe.image is an image that carries the repository, swe.repo_source "
                              "a clone on the server: set one of them", "INVALID_TASK",
                              "swe.image")
    out: dict[str, Any] = {"instance_id": t.instance_id}
    if not t.image:
        out["repo_source"] = t.repo_source
    out.update({"base_commit": t.base_commit, "problem_statement": t.problem_statement,
                "test_patch": t.test_patch, "FAIL_TO_PASS": list(t.fail_to_pass),
                "PASS_TO_PASS": list(t.pass_to_pass)})
    _put(out, "repo", t.repo)
    _put(out, "patch", t.patch)
    _put(out, "test_env", dict(t.test_env))
    if t.HasField("test_timeout_s"):
        out["test_timeout_s"] = t.test_timeout_s
    _put(out, "pytest_plugins", list(t.pytest_plugins))
    if t.pytest_plugin_autoload:
        out["pytest_plugin_autoload"] = True
    _put(out, "version", t.version)
    _put(out, "test_runner", t.test_runner)
    if t.HasField("spec") or t.image:
        s = t.spec
        spec: dict[str, Any] = {}
        _put(spec, "image", t.image)
        _put(spec, "python", s.python)
        _put(spec, "pre_install", list(s.pre_install))
        _put(spec, "pip_packages", list(s.pip_packages))
        _put(spec, "install", s.install)
        _put(spec, "test_cmd", s.test_cmd)
        _put(spec, "log_parser", s.log_parser)
        _put(spec, "eval_commands", list(s.eval_commands))
        out["spec"] = spec
    return out


_CONVERT = {"math": math_task, "code": code_task, "swe": swe_task}


def typed_task(which: str, message: Any) -> dict[str, Any]:
    """The task object of JobSpec.typed_task's field ``which``."""
    return _CONVERT[which](message)


def error_for(typed: str | None, exc: BaseException) -> BaseException:
    """An environment names the task field it refuses as ``task.<name>``; for a typed task
    the field to fix is ``<typed>.<name>`` (FAIL_TO_PASS is fail_to_pass there)."""
    field = getattr(exc, "field", "")
    if typed is None or not isinstance(exc, InvalidArgument) or not (
            field == "task" or field.startswith("task.")):
        return exc
    named = typed + field[len("task"):].lower()
    return InvalidArgument(str(exc), exc.reason, _RENAMED.get(named, named))


_RENAMED = {"swe.spec.image": "swe.image"}
"""Task fields whose typed field has another path (an image instance's ``spec.image`` is
``SweTask.image``)."""


def _enum(table: Mapping[Any, str | None], value: int, field: str) -> str | None:
    if value not in table:
        raise InvalidArgument(f"{field} has the unknown value {value}", "INVALID_ENUM_VALUE",
                              field)
    return table[value]
