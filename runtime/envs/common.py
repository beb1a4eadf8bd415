"""Helpers shared by the built-in environments (math, code, swe).

Task validation raises :class:`rollout.runtime.types.InvalidArgument` with reason
``INVALID_TASK`` and
the dotted field name, so a bad task is rejected at submit time with a message that says which
field to fix, instead of failing minutes later inside a stage.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollout.runtime.handler import HandlerError, JobContext
from rollout.runtime.types import InvalidArgument

DATA_DIR = Path(__file__).resolve().parent / "data"
"""Shipped task sets (``<env>.jsonl``) and the small repositories of the swe tasks."""

IN_SANDBOX = Path(__file__).resolve().parent / "in_sandbox"
"""Scripts that run inside sandboxes (standard library only). The package never imports them:
a handler reads one as text and writes it into the sandbox that runs it."""

SANDBOX_KEY = "env.sandbox"
"""``ctx.state`` key of the job's sandbox (opened in INIT, used by RUN and EVAL)."""

PRIVATE_DIR = "/tmp/.rollout-eval"
"""Sandbox path for EVAL-only files (hidden tests, test patches): the sandbox's own ``/tmp``,
outside the workspace, written only after RUN has ended."""


_HOST_PATH_ROOTS: tuple[Path, ...] | None = None


def set_host_path_roots(roots: Sequence[str | Path] | None) -> tuple[Path, ...] | None:
    """Set the directories tasks may name host paths in (symlinks resolved); returns the
    previous setting so a server can restore it when it stops. The server sets this at start
    from ``server.task_path_roots``; None (library use without a server) leaves host paths
    unrestricted, since whoever calls a handler in-process already controls the host."""
    global _HOST_PATH_ROOTS
    previous = _HOST_PATH_ROOTS
    _HOST_PATH_ROOTS = (None if roots is None
                        else tuple(Path(os.path.realpath(Path(r).expanduser())) for r in roots))
    return previous


def host_path(value: str, field: str, *, env: str) -> Path:
    """A host path named by a task: relative paths are under :data:`DATA_DIR`; the result
    (symlinks resolved, so a link cannot lead out) must lie in an allowed root. Permission is
    checked before existence, so a task cannot probe which paths exist outside the roots."""
    path = Path(value).expanduser()
    real = Path(os.path.realpath(path if path.is_absolute() else DATA_DIR / path))
    roots = _HOST_PATH_ROOTS
    if roots is not None and not any(real == r or real.is_relative_to(r) for r in roots):
        shown = value if len(value) <= 200 else value[:200] + "..."
        raise InvalidArgument(
            f"{env} task field {field!r} ({shown!r}) is outside the directories this server "
            "reads task files from; an operator can allow a directory with the config key "
            "server.task_path_roots", "PATH_NOT_ALLOWED", f"task.{field}")
    return real


def invalid(message: str, field: str) -> InvalidArgument:
    return InvalidArgument(message, "INVALID_TASK", f"task.{field}" if field else "task")


def require_str(task: Mapping[str, Any], name: str, *, env: str) -> str:
    """The non-empty string field ``name`` of a task."""
    value = task.get(name)
    if value is None:
        raise invalid(f"{env} task is missing the required field {name!r}", name)
    if not isinstance(value, str) or not value.strip():
        raise invalid(f"{env} task field {name!r} must be a non-empty string, "
                      f"got {type(value).__name__}", name)
    return value


def optional_str(task: Mapping[str, Any], name: str, default: str, *, env: str) -> str:
    value = task.get(name, default)
    if not isinstance(value, str):
        raise invalid(f"{env} task field {name!r} must be a string, got {type(value).__name__}",
                      name)
    return value


def optional_number(task: Mapping[str, Any], name: str, default: float, *, env: str,
                    minimum: float = 0.0) -> float:
    value = task.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= minimum:
        raise invalid(f"{env} task field {name!r} must be a number > {minimum:g}, got {value!r}",
                      name)
    return float(value)


def optional_choice(task: Mapping[str, Any], name: str, choices: Sequence[str], *,
                    env: str) -> str:
    value = task.get(name, choices[0])
    if value not in choices:
        raise invalid(f"{env} task field {name!r} must be one of {list(choices)}, got {value!r}",
                      name)
    return str(value)


def string_env(task: Mapping[str, Any], name: str, *, env: str) -> dict[str, str]:
    """An optional ``{str: str}`` field (environment variables for a command)."""
    value = task.get(name, {})
    if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise invalid(f"{env} task field {name!r} must be an object of strings", name)
    return dict(value)


def check_task_object(task: Any, env: str) -> None:
    if not isinstance(task, Mapping):
        raise invalid(f"a {env} task must be a JSON object, got {type(task).__name__}", "")


def sandbox_of(ctx: JobContext) -> Any:
    """The sandbox INIT opened; a clear error when a stage runs without INIT."""
    sandbox = ctx.state.get(SANDBOX_KEY)
    if sandbox is None:
        raise HandlerError("no sandbox in the job state: INIT did not run", "NO_SANDBOX")
    return sandbox


async def write_private(sandbox: Any, name: str, data: bytes | str) -> str:
    """Write an EVAL-only file into the sandbox's private directory; returns its path there."""
    path = f"{PRIVATE_DIR}/{name}"
    raw = data.encode() if isinstance(data, str) else data
    result = await sandbox.exec(
        ["bash", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1"', "write", path],
        stdin=raw, timeout=30.0)
    if result.exit_code != 0:
        raise HandlerError(f"could not write {path} into the sandbox: {result.output[-500:]}",
                           "SANDBOX_WRITE_FAILED")
    return path


def quote(*parts: str) -> str:
    return " ".join(shlex.quote(p) for p in parts)


def sandbox_tools(sandbox: Any, names: Sequence[str], ctx: JobContext) -> list[Any]:
    """The named sandbox tools (``bash``, ``python``, ``editor``) from ``runtime.tools``, each
    call capped at the job's ``limits.tool_timeout_s``."""
    from rollout.runtime.tools import make_tools

    return list(make_tools(sandbox, names=list(names),
                           tool_timeout_s=ctx.spec.limits.tool_timeout_s))
