"""Harness presets: how an agent harness is installed, started and pointed at the job's gateway.

A preset is a TOML file (``harnesses/<name>.toml`` beside this module for the shipped
ones; more in the directories of ``$ROLLOUT_HARNESS_PRESETS``, ``:``-separated, which win over
shipped ones of the same name)::

    description = "what it is"
    install = "current-harness-mini-swe-agent"   # a directory: relative = under the set-up
                                                 # cache (~/.cache/rollout-service), or absolute
    install_hint = "bash scripts/setup_harnesses.sh"   # what makes it (shown when missing)
    command = ["{install}/bin/python", "-m", "minisweagent.run.mini", "-t", "{prompt}"]
    port = 4000                                  # optional: the relay's port in the sandbox
    [env]                                        # added to the sandbox's environment
    MSWEA_COST_TRACKING = "ignore_errors"
    [files]                                      # written before the command starts
    "{home}/.codex/config.toml" = '''model_provider = "rollout" ...'''
    [limits]                                     # optional: sandbox rlimits it needs, cut to
    address_space = "32GiB"                      # the server's ceilings (sandbox.max_*)
    processes = 1024                             # processes and threads together
    [[side_call]]                                # optional: requests never trained (a title)
    system = "(?i)title generator"               # model / system / metadata = {key = regex}

A task may instead carry the same fields itself (``"harness": {"command": [...], ...}``), or
name a preset and override ``env`` entries (``{"preset": "codex", "env": {...}}``), so a user
runs their own harness without touching the server.

Placeholders in ``command``, ``env`` values, ``files`` paths and contents (only these names;
other braces stay as they are, so JSON and TOML bodies need no escaping):

=================  =================================================================
``{install}``      where the install directory is bound in the sandbox (read-only)
``{base_url}``     ``http://127.0.0.1:PORT/v1``: the job's gateway, OpenAI style
``{origin}``       ``http://127.0.0.1:PORT``: the same without ``/v1`` (Anthropic SDKs)
``{api_key}``      the job's gateway key
``{model}``        the model name the harness sends (``task.model``, default ``policy``)
``{prompt}``       the task as the inner environment words it
``{prompt_file}``  a file in the sandbox holding ``{prompt}``
``{workspace}``    the working directory (the inner environment's workspace)
``{home}``         ``$HOME`` in the sandbox
``{max_steps}``    the job's ``limits.max_turns``: the harness's step limit
``{max_tokens}``   ``sampling.max_tokens_per_turn``
=================  =================================================================
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.runtime.envs.common import host_path, invalid
from rollout.runtime.gateway import SideCallRule

SHIPPED_DIR = Path(__file__).with_name("shipped")
PLACEHOLDERS = ("install", "base_url", "origin", "api_key", "model", "prompt", "prompt_file",
                "workspace", "home", "max_steps", "max_tokens")
_PLACEHOLDER = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
_FIELDS = ("description", "install", "install_hint", "command", "port", "env", "files",
           "side_call", "limits")
LIMIT_FIELDS = {"address_space": "address_space_bytes", "processes": "processes",
                "open_files": "open_files"}
"""``[limits]`` keys -> the sandbox limit each sets (:data:`rollout.runtime.sandbox.base.
RAISABLE_LIMITS`)."""
_SIZE = re.compile(r"\s*(\d+)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
DEFAULT_PORT = 4000


@dataclass(frozen=True)
class HarnessSpec:
    """One harness, resolved: the install directory exists on this host."""

    name: str
    command: tuple[str, ...]
    install: Path | None
    """Host directory bound read-only at
    :data:`rollout.runtime.envs.harness.handler.INSTALL_MOUNT`."""
    env: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, str] = field(default_factory=dict)
    port: int = DEFAULT_PORT
    side_calls: tuple[SideCallRule, ...] = ()
    """Requests of this harness that are not the agent's work (never trained)."""
    limits: Mapping[str, int] = field(default_factory=dict)
    """Sandbox limits the harness needs (``SandboxLimits`` field -> value), as asked: the
    handler clamps them to the server's ceilings."""


def setup_cache() -> Path:
    """Where ``scripts/setup_harnesses.sh`` installs harnesses (as the set-up's other caches)."""
    root = os.environ.get("ROLLOUT_SETUP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rollout-service")
    return Path(root)


def preset_dirs() -> list[Path]:
    """The user's preset directories first (``$ROLLOUT_HARNESS_PRESETS``), then the shipped."""
    user = [Path(p).expanduser() for p in os.environ.get("ROLLOUT_HARNESS_PRESETS", "").split(
        os.pathsep) if p]
    return [*user, SHIPPED_DIR]


def preset_names() -> list[str]:
    names: set[str] = set()
    for d in preset_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.toml"))
    return sorted(names)


def load_preset(name: str) -> dict[str, Any]:
    """The preset's table (unresolved); INVALID_TASK naming the known presets when unknown."""
    if not _NAME.fullmatch(name):
        raise invalid(f"harness preset name {name!r} must be letters, digits, '.', '_' or '-'",
                      "harness")
    for d in preset_dirs():
        path = d / f"{name}.toml"
        if path.is_file():
            try:
                data = tomllib.loads(path.read_text(encoding="utf-8"))
            except (OSError, tomllib.TOMLDecodeError) as e:
                raise invalid(f"harness preset {name!r} ({path}) cannot be read: {e}",
                              "harness") from e
            _check_fields(data, f"harness preset {path}")
            return data
    raise invalid(f"unknown harness preset {name!r}; this server has: "
                  f"{', '.join(preset_names()) or 'none'} (or give a command spec: "
                  '{"command": [...], "install": DIR, "env": {...}})', "harness")


def _check_fields(data: Mapping[str, Any], where: str) -> None:
    unknown = sorted(set(data) - set(_FIELDS) - {"preset"})
    if unknown:
        raise invalid(f"{where} has unknown fields {unknown}; known: {list(_FIELDS)}",
                      "harness")


def resolve(value: Any) -> HarnessSpec:
    """A task's ``harness`` field: a preset name, ``{"preset": NAME, "env": {...}}``, or a
    command spec of the preset fields. The install directory must exist (a task's own
    ``install`` must lie in the server's allowed task path roots)."""
    if isinstance(value, str):
        name, data, from_task = value, load_preset(value), False
    elif isinstance(value, Mapping):
        _check_fields(value, "task field 'harness'")
        if "preset" in value:
            if not isinstance(value["preset"], str):
                raise invalid("task field 'harness.preset' must be a preset name",
                              "harness.preset")
            name = value["preset"]
            base = load_preset(name)
            given = sorted(set(value) - {"preset", "env"})
            if given:
                raise invalid(f"task field 'harness' names preset {name!r}, which fixes "
                              f"{given}; a task may override only 'env' (or drop 'preset' and "
                              "give a whole command spec)", "harness")
            data = {**base, "env": {**_strings(base.get("env", {}), "harness.env"),
                                    **_strings(value.get("env", {}), "harness.env")}}
            from_task = False
        else:
            name, data, from_task = "custom", dict(value), True
    else:
        raise invalid("task field 'harness' must be a preset name or an object "
                      '({"preset": NAME} or {"command": [...], ...})', "harness")
    command = data.get("command")
    if not isinstance(command, list) or not command or not all(
            isinstance(c, str) and c for c in command):
        raise invalid(f"harness {name!r}: 'command' must be a non-empty list of strings",
                      "harness.command")
    port = data.get("port", DEFAULT_PORT)
    if isinstance(port, bool) or not isinstance(port, int) or not 1024 <= port <= 65535:
        raise invalid(f"harness {name!r}: 'port' must be an integer in [1024, 65535]",
                      "harness.port")
    env = _strings(data.get("env", {}), "harness.env")
    files = _strings(data.get("files", {}), "harness.files")
    for path in files:
        if not _PLACEHOLDER.sub("/x", path).startswith("/"):
            raise invalid(f"harness {name!r}: file paths must be absolute (or start with "
                          f"{{home}} / {{workspace}}), got {path!r}", "harness.files")
    side_calls = _side_calls(name, data.get("side_call", []))
    limits = _limits(name, data.get("limits", {}))
    install = _install_dir(name, data, from_task)
    return HarnessSpec(name, tuple(command), install, env, files, port, side_calls, limits)


def resolve_side_calls(name: str) -> tuple[SideCallRule, ...]:
    """A preset's side-call rules alone: what the gateway is told about its jobs, readable where
    the harness is not installed (a replay of its recorded requests)."""
    return _side_calls(name, load_preset(name).get("side_call", []))


def _side_calls(name: str, value: Any) -> tuple[SideCallRule, ...]:
    """``[[side_call]]`` tables: ``model`` / ``system`` / ``last_user`` patterns, ``metadata =
    {key = pattern}``."""
    where = f"harness {name!r}: 'side_call'"
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise invalid(f"{where} must be a list of tables ([[side_call]] with model, system, "
                      "last_user or metadata)", "harness.side_call")
    rules = []
    for i, rule in enumerate(value):
        unknown = sorted(set(rule) - {"model", "system", "last_user", "metadata"})
        if unknown:
            raise invalid(f"{where} #{i + 1} has unknown fields {unknown}; known: model, "
                          "system, last_user, metadata", "harness.side_call")
        model, system = rule.get("model", ""), rule.get("system", "")
        last_user = rule.get("last_user", "")
        metadata = rule.get("metadata", {})
        if not all(isinstance(v, str) for v in (model, system, last_user)):
            raise invalid(f"{where} #{i + 1}: 'model', 'system' and 'last_user' are regular "
                          "expressions (strings)", "harness.side_call")
        try:
            rules.append(SideCallRule(model, system, tuple(sorted(
                _strings(metadata, "harness.side_call.metadata").items())), last_user))
        except ValueError as e:
            raise invalid(f"{where} #{i + 1}: {e}", "harness.side_call") from None
    return tuple(rules)


def _limits(name: str, value: Any) -> dict[str, int]:
    """``[limits]``: ``address_space`` (bytes, or a size such as ``"16GiB"``), ``processes``
    (processes and threads together), ``open_files``."""
    where = f"harness {name!r}: 'limits'"
    if not isinstance(value, Mapping):
        raise invalid(f"{where} must be a table ({', '.join(LIMIT_FIELDS)})", "harness.limits")
    unknown = sorted(set(value) - set(LIMIT_FIELDS))
    if unknown:
        raise invalid(f"{where} has unknown fields {unknown}; known: {list(LIMIT_FIELDS)}",
                      "harness.limits")
    limits = {}
    for key, raw in value.items():
        amount = _size(raw) if key == "address_space" else raw
        if isinstance(amount, bool) or not isinstance(amount, int) or amount < 1:
            raise invalid(f"{where}: {key} must be a positive integer"
                          + (" of bytes or a size such as \"16GiB\"" if key == "address_space"
                             else "") + f", got {raw!r}", f"harness.limits.{key}")
        limits[LIMIT_FIELDS[key]] = amount
    return limits


def _size(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    match = _SIZE.fullmatch(raw)
    if match is None:
        return raw
    unit = (match.group(2) or "B").upper().rstrip("B").rstrip("I")
    return int(match.group(1)) << (10 * "_KMGT".index(unit or "_"))


def _strings(value: Any, field_name: str) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise invalid(f"task field {field_name!r} must be an object of strings", field_name)
    return dict(value)


def _install_dir(name: str, data: Mapping[str, Any], from_task: bool) -> Path | None:
    install = data.get("install")
    if install is None or install == "":
        return None
    if not isinstance(install, str):
        raise invalid(f"harness {name!r}: 'install' must be a directory path",
                      "harness.install")
    if from_task:
        # A task names a host path: only inside the roots the server reads task files from.
        path = host_path(install, "harness.install", env="harness")
    else:
        path = Path(os.path.realpath(setup_cache() / Path(install).expanduser()))
    if not path.is_dir():
        hint = data.get("install_hint") or "install it first"
        raise invalid(f"harness {name!r} is not installed on this server ({path} is missing): "
                      f"{hint}", "harness")
    return path


def render(text: str, values: Mapping[str, str]) -> str:
    """``text`` with every known ``{placeholder}`` replaced; other braces stay."""
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)
