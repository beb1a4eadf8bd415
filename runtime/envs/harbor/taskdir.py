"""One Harbor task folder, read and checked: what the ``harbor`` environment and ``rollout tasks
import-harbor`` / ``check-harbor`` know of it.

The layout (Harbor's task format, schema 1.x; Terminal-Bench and several SWE data sets ship in
it)::

    TASK/
      instruction.md        the prompt
      task.toml             timeouts, resources, network, a prebuilt image
      environment/          the image's build context (environment/Dockerfile), unless
                            task.toml names a prebuilt ``[environment].docker_image``
      tests/test.sh         the verifier: writes /logs/verifier/reward.txt or reward.json
      solution/solve.sh     optional: the reference solution (the oracle policy)

``task.toml`` keys read here (Harbor's names; later 1.x spellings beside the first ones)::

    version = "1.0" | schema_version = "1.3"
    [task] name, description
    [agent] timeout_sec                         -> the RUN stage's deadline
    [verifier] timeout_sec, env                 -> test.sh's deadline and environment
    [solution] env                              -> solve.sh's environment (oracle)
    [environment] docker_image, build_timeout_sec, cpus, memory_mb | memory = "4G",
                  storage_mb | storage = "10G", gpus, allow_internet | network_mode, env,
                  workdir, os

Keys this module does not know are kept out and reported (``unknown_keys``), as Harbor itself
ignores what it does not know. What the server cannot honour is refused with the key named:
``gpus > 0`` (sandboxes get no GPU), ``os`` other than linux, a schema major version other
than 1, and a multi-container task: a Compose file in ``environment/`` that adds services
beside the agent's ``main`` (sidecars on networks of their own), or
``[[environment.mcp_servers]]`` (tools served by such a sidecar). A job runs in one rootless
sandbox; run without its other containers such a task would grade the agent on an environment
it was not written for, so it is refused, as Harbor's own cloud providers refuse it. A Compose
file that only adjusts ``main`` is read, and what it sets is reported with the unknown keys.

A multi-step task (``[[steps]]``, schema 1.1) replaces ``instruction.md``, ``tests/`` and
``solution/`` at the root with one folder per step, run in order in one environment::

    TASK/
      task.toml             multi_step_reward_strategy = "mean" | "final"; [[steps]] tables
      environment/          built once, shared by every step
      tests/                optional: helpers (and a fallback test.sh) under every step's tests
      steps/NAME/instruction.md          the step's prompt
      steps/NAME/tests/                  the step's verifier, copied over tests/ (same names win)
      steps/NAME/workdir/                optional: copied into the working directory before
                                         the step's agent; its setup.sh runs there first
      steps/NAME/solution/solve.sh       optional: the step's oracle

``[[steps]]`` keys: ``name``, ``min_reward`` (a number for the ``reward`` entry, or a table of
entries to thresholds: below it the remaining steps do not run), ``[steps.agent]``
``timeout_sec`` / ``user``, ``[steps.verifier]`` ``timeout_sec`` / ``env`` / ``user`` (unset:
the task's ``[agent]`` / ``[verifier]``; ``env`` is merged over the task's), and
``[steps.healthcheck]`` ``command``, ``interval_sec``, ``timeout_sec``, ``retries``,
``start_period_sec`` (polled after the upload and ``setup.sh``, before the agent).

A separate verifier (``[verifier] environment_mode = "separate"`` or a
``[verifier.environment]`` table; per step in ``[steps.verifier]``) runs in a fresh sandbox of
its own image (``[verifier.environment].docker_image``, or ``tests/Dockerfile`` built with
``tests/`` as its context) that gets only the top-level (and the step's) ``artifacts``:
:class:`VerifierEnvironment`.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INSTRUCTION = "instruction.md"
CONFIG = "task.toml"
ENVIRONMENT = "environment"
DOCKERFILE = "environment/Dockerfile"
TESTS = "tests"
TEST_SCRIPT = "tests/test.sh"
SOLUTION = "solution"
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
"""The names Docker Compose reads in ``environment/``: a multi-container task."""
SOLVE_SCRIPT = "solution/solve.sh"
STEPS = "steps"
WORKDIR = "workdir"
SETUP_SCRIPT = "setup.sh"
"""In a step's ``workdir/``: run from the working directory after the upload, before the agent."""
REWARD_STRATEGIES = ("mean", "final")
MAX_STEPS = 64
MAX_HEALTHCHECK_RETRIES = 100
MAX_ARTIFACTS = 256
PROTECTED_PATHS = ("/tests", "/logs/verifier", "/solution", "/proc", "/dev", "/sys")
"""What an artifact may not be, hold or lie in: the verifier's own tests and reward folder,
and what no copy should touch."""
_STEP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

DEFAULT_TIMEOUT_S = 600.0
"""Harbor's default for the agent, the verifier and the build."""
MAX_INSTRUCTION = 256 << 10
MAX_CONFIG = 64 << 10
MAX_FOLDER_BYTES = 256 << 20
"""What ``tests/`` and ``solution/`` may hold together: they are copied per job."""

_KNOWN: dict[str, frozenset[str]] = {
    "": frozenset({"version", "schema_version", "task", "metadata", "verifier", "agent",
                   "solution", "environment", "source", "steps", "multi_step_reward_strategy",
                   "artifacts"}),
    "task": frozenset({"name", "description", "authors", "keywords"}),
    "agent": frozenset({"timeout_sec", "user"}),
    "verifier": frozenset({"timeout_sec", "env", "user", "environment_mode", "environment"}),
    "solution": frozenset({"env"}),
    "environment": frozenset({"docker_image", "build_timeout_sec", "cpus", "memory_mb", "memory",
                              "storage_mb", "storage", "gpus", "gpu_types", "allow_internet",
                              "network_mode", "env", "workdir", "os", "mcp_servers"}),
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)i?[bB]?\s*")
_SIZE_UNITS = {"": 1 / (1 << 20), "k": 1 / 1024, "m": 1, "g": 1024, "t": 1 << 20}


_ENV_KNOWN = _KNOWN["environment"] - {"mcp_servers"}
"""``[verifier.environment]`` keys read (``[environment]``'s, less the agent's MCP servers)."""
_STEP_KNOWN: dict[str, frozenset[str]] = {
    "": frozenset({"name", "min_reward", "agent", "verifier", "healthcheck", "artifacts"}),
    "agent": _KNOWN["agent"],
    "verifier": _KNOWN["verifier"],
    "healthcheck": frozenset({"command", "interval_sec", "timeout_sec", "retries",
                              "start_period_sec", "start_interval_sec"}),
}


class TaskFolderError(ValueError):
    """The folder is not a usable Harbor task; the message names the file and key to fix."""


@dataclass(frozen=True)
class Healthcheck:
    """``[steps.healthcheck]``: polled as Docker polls a HEALTHCHECK (Docker's defaults)."""

    command: str
    interval_s: float = 30.0
    timeout_s: float = 30.0
    retries: int = 3
    """Failures in a row (after the start period) that make the check fail."""
    start_period_s: float = 0.0
    """Failures within this long of the first attempt do not count."""
    start_interval_s: float = 5.0
    """The wait between attempts within the start period."""


@dataclass(frozen=True)
class VerifierEnvironment:
    """A separate verifier's environment (Harbor's ``environment_mode = "separate"``): a fresh
    sandbox of its own image, which holds ``/tests/test.sh``, given only the task's artifacts
    from the agent's sandbox."""

    docker_image: str = ""
    context: str = ""
    """The task's folder (relative path) the image is built from, holding its Dockerfile:
    ``tests`` (or a step's ``steps/NAME/tests``); '' when ``docker_image`` names the image."""
    build_timeout_s: float = DEFAULT_TIMEOUT_S
    cpus: float = 1.0
    memory_mb: int = 2048
    storage_mb: int = 10240
    workdir: str = ""
    """Where ``test.sh`` runs ('' = the image's WorkingDir)."""
    env: Mapping[str, str] = field(default_factory=dict)
    allow_internet: bool = True
    """Whether its ``test.sh`` may use the server's verifier network (its own
    ``allow_internet`` / ``network_mode``, else the task's)."""


@dataclass(frozen=True)
class HarborStep:
    """One ``[[steps]]`` entry and its folder ``steps/NAME/``."""

    name: str
    instruction: str
    agent_timeout_s: float
    verifier_timeout_s: float
    verifier_env: Mapping[str, str]
    """The task's ``[verifier].env`` with the step's own over it."""
    min_reward: float | Mapping[str, float] | None = None
    healthcheck: Healthcheck | None = None
    has_workdir: bool = False
    has_solution: bool = False
    has_tests: bool = False
    """``steps/NAME/tests/`` exists (copied over the task's ``tests/``)."""
    agent_user: str | None = None
    verifier_user: str | None = None
    artifacts: tuple[str, ...] = ()
    """The task's ``artifacts`` and the step's own (absolute paths)."""
    separate: VerifierEnvironment | None = None
    """The step's separate verifier environment; None = the agent's sandbox (shared)."""

    def below_minimum(self, components: Mapping[str, float]) -> str:
        """Why a step whose verifier gave ``components`` stops the task ('' = it does not):
        an entry under its threshold (a missing entry counts as 0)."""
        if self.min_reward is None:
            return ""
        wanted = ({"reward": self.min_reward} if isinstance(self.min_reward, float)
                  else self.min_reward)
        for key, floor in wanted.items():
            got = components.get(key, 0.0)
            if got < floor:
                return (f"step {self.name!r}: {key} = {got:g}, under its min_reward "
                        f"{floor:g}; the remaining steps do not run")
        return ""


@dataclass(frozen=True)
class HarborTask:
    """A Harbor task folder as the environment runs it."""

    path: Path
    """The folder (symlinks resolved)."""
    name: str
    instruction: str
    agent_timeout_s: float = DEFAULT_TIMEOUT_S
    verifier_timeout_s: float = DEFAULT_TIMEOUT_S
    build_timeout_s: float = DEFAULT_TIMEOUT_S
    docker_image: str = ""
    """A prebuilt image (``[environment].docker_image``); '' = build ``environment/``."""
    has_dockerfile: bool = False
    cpus: float = 1.0
    memory_mb: int = 2048
    storage_mb: int = 10240
    allow_internet: bool = True
    workdir: str = ""
    """``[environment].workdir``: where the agent starts ('' = the image's WorkingDir)."""
    environment_env: Mapping[str, str] = field(default_factory=dict)
    verifier_env: Mapping[str, str] = field(default_factory=dict)
    solution_env: Mapping[str, str] = field(default_factory=dict)
    has_solution: bool = False
    unknown_keys: tuple[str, ...] = ()
    agent_user: str | None = None
    """``[agent].user``: who the agent's (and the oracle's) commands run as; None = the
    image's ``USER``."""
    verifier_user: str | None = None
    """``[verifier].user``: who ``tests/test.sh`` runs as; None = the image's ``USER``."""
    steps: tuple[HarborStep, ...] = ()
    """A multi-step task's steps in order; () for a single-step task."""
    reward_strategy: str = "mean"
    """``multi_step_reward_strategy``: how the steps' rewards make the task's."""
    artifacts: tuple[str, ...] = ()
    """``artifacts``: paths a separate verifier gets from the agent's sandbox (with
    ``/logs/artifacts``)."""
    separate: VerifierEnvironment | None = None
    """A separate verifier environment; None = the verifier runs in the agent's sandbox."""

    @property
    def verifier_environments(self) -> tuple[VerifierEnvironment, ...]:
        """Every separate verifier environment the task uses (each once)."""
        found: list[VerifierEnvironment] = []
        for env in (self.separate, *(step.separate for step in self.steps)):
            if env is not None and env not in found:
                found.append(env)
        return tuple(found)

    @property
    def image_source(self) -> str:
        """What the sandbox's root comes from, for messages: the image or the Dockerfile."""
        if self.docker_image:
            return self.docker_image
        return str(self.path / DOCKERFILE) if self.has_dockerfile else ""


def load(path: str | Path, *, sizes: bool = True) -> HarborTask:
    """Read and check the task folder at ``path`` (a directory holding ``task.toml``).
    ``sizes=False`` skips the walk that sums ``tests/`` and ``solution/``: a submit checks
    the small files only, INIT (off the event loop) the rest."""
    root = Path(os.path.realpath(path))
    if not root.is_dir():
        raise TaskFolderError(f"{path}: not a directory")
    config = _read_toml(root / CONFIG)
    multi_step = "steps" in config
    instruction = ""
    if not multi_step:
        instruction = _read_text(root / INSTRUCTION, MAX_INSTRUCTION).strip()
        if not instruction:
            raise TaskFolderError(f"{root / INSTRUCTION}: empty; it is the prompt")
    solve = root / SOLVE_SCRIPT
    has_solution = solve.is_file() and not solve.is_symlink()
    if sizes:
        _check_size(root, (TESTS, SOLUTION, STEPS))

    version = str(config.get("schema_version", config.get("version", "1.0")))
    if not re.fullmatch(r"1(\.\d+)*", version):
        raise TaskFolderError(f"{root / CONFIG}: schema version {version!r}; this server reads "
                              "Harbor's schema 1.x")
    section = {name: _table(config, name, root) for name in
               ("task", "agent", "verifier", "solution", "environment")}
    env_table = section["environment"]
    where = f"{root / CONFIG}: [environment]"
    gpus = _number(env_table, "gpus", 0, where)
    if gpus > 0:
        raise TaskFolderError(f"{where} gpus = {gpus:g}: sandboxes on this server get no GPU")
    if str(env_table.get("os", "linux")).lower() != "linux":
        raise TaskFolderError(f"{where} os = {env_table['os']!r}: only linux tasks run here")
    compose_keys = _refuse_multi_container(root, env_table, where)
    steps_value = config.get("steps")
    verifiers: list[tuple[Mapping[str, Any], str]] = [
        (section["verifier"], f"{root / CONFIG}: [verifier]")]
    for i, e in enumerate(steps_value if isinstance(steps_value, list) else ()):
        if isinstance(e, Mapping) and isinstance(e.get("verifier"), Mapping):
            verifiers.append((e["verifier"], f"{root / CONFIG}: [[steps]] #{i + 1} "
                                             f"[steps.verifier]"))
    for verifier, where_v in verifiers:
        if verifier.get("collect"):
            raise TaskFolderError(
                f"{where_v} collect: [[verifier.collect]] hooks (commands run in the task's "
                f"services before their artifacts are collected) are not run by this server, "
                f"and the verifier would miss what they gather")
    env_keys: list[str] = []
    # The task's resources, which a separate verifier's environment defaults to.
    resources = VerifierEnvironment(
        build_timeout_s=_number(env_table, "build_timeout_sec", DEFAULT_TIMEOUT_S, where,
                                positive=True),
        cpus=_number(env_table, "cpus", 1, where, positive=True),
        memory_mb=_megabytes(env_table, "memory_mb", "memory", 2048, where),
        storage_mb=_megabytes(env_table, "storage_mb", "storage", 10240, where),
        allow_internet=_allow_internet(env_table, where))
    # A multi-step task's [verifier] mode and environment are its steps' defaults (each
    # step's verifier image comes from its own tests/ where that has a Dockerfile).
    separate = None if multi_step else _verifier_environment(
        root, section["verifier"], resources, TESTS, f"{root / CONFIG}: [verifier]", env_keys)
    artifacts = _artifacts(config.get("artifacts"), f"{root / CONFIG}: artifacts")
    if not multi_step and separate is None:
        test = root / TEST_SCRIPT
        if not test.is_file() or test.is_symlink():
            raise TaskFolderError(f"{root}: no {TEST_SCRIPT} (the verifier every task needs)")
    image = env_table.get("docker_image") or ""
    if not isinstance(image, str) or any(c.isspace() for c in image) or len(image) > 1000:
        raise TaskFolderError(f"{where} docker_image must be one image reference")
    has_dockerfile = (root / DOCKERFILE).is_file()
    if not image and not has_dockerfile:
        raise TaskFolderError(f"{root}: neither [environment].docker_image in {CONFIG} nor "
                              f"{DOCKERFILE}: the task has no image to run in")
    workdir = env_table.get("workdir") or ""
    if not isinstance(workdir, str) or (workdir and not workdir.startswith("/")):
        raise TaskFolderError(f"{where} workdir must be an absolute path")
    name = section["task"].get("name") or root.name
    agent_timeout = _number(section["agent"], "timeout_sec", DEFAULT_TIMEOUT_S,
                            f"{root / CONFIG}: [agent]", positive=True)
    verifier_timeout = _number(section["verifier"], "timeout_sec", DEFAULT_TIMEOUT_S,
                               f"{root / CONFIG}: [verifier]", positive=True)
    verifier_env = _strings(section["verifier"], "env", f"{root / CONFIG}: [verifier]")
    agent_user = _user(section["agent"], f"{root / CONFIG}: [agent]")
    verifier_user = _user(section["verifier"], f"{root / CONFIG}: [verifier]")
    strategy = config.get("multi_step_reward_strategy", "mean")
    if strategy not in REWARD_STRATEGIES:
        raise TaskFolderError(f"{root / CONFIG}: multi_step_reward_strategy must be one of "
                              f"{', '.join(map(repr, REWARD_STRATEGIES))}, got {strategy!r}")
    steps: tuple[HarborStep, ...] = ()
    step_keys: tuple[str, ...] = ()
    if multi_step:
        steps, step_keys = _steps(root, config["steps"], agent_timeout, verifier_timeout,
                                  verifier_env, agent_user, verifier_user,
                                  section["verifier"], resources, artifacts, env_keys)
        instruction = steps[0].instruction
    if artifacts and separate is None and not any(step.separate for step in steps):
        env_keys.append("artifacts (collected for a separate verifier only)")
    return HarborTask(
        path=root, name=str(name)[:200], instruction=instruction,
        agent_timeout_s=agent_timeout, verifier_timeout_s=verifier_timeout,
        build_timeout_s=resources.build_timeout_s,
        docker_image=image, has_dockerfile=has_dockerfile, cpus=resources.cpus,
        memory_mb=resources.memory_mb, storage_mb=resources.storage_mb,
        allow_internet=resources.allow_internet,
        workdir=workdir,
        environment_env=_strings(env_table, "env", where),
        verifier_env=verifier_env,
        solution_env=_strings(section["solution"], "env", f"{root / CONFIG}: [solution]"),
        has_solution=has_solution or any(step.has_solution for step in steps),
        unknown_keys=_unknown(config) + step_keys + compose_keys + tuple(env_keys),
        agent_user=agent_user, verifier_user=verifier_user, steps=steps,
        reward_strategy=strategy, artifacts=artifacts, separate=separate)


def _steps(root: Path, entries: Any, agent_timeout: float, verifier_timeout: float,
           verifier_env: Mapping[str, str], agent_user: str | None,
           verifier_user: str | None, task_verifier: Mapping[str, Any],
           resources: VerifierEnvironment, artifacts: tuple[str, ...],
           env_keys: list[str]) -> tuple[tuple[HarborStep, ...], tuple[str, ...]]:
    """The ``[[steps]]`` tables with their folders, checked; and the keys Harbor has that are
    not read here."""
    where = f"{root / CONFIG}: [[steps]]"
    if not isinstance(entries, list) or not entries or not all(
            isinstance(e, Mapping) for e in entries):
        raise TaskFolderError(f"{where} must be one or more tables ([[steps]] entries)")
    if len(entries) > MAX_STEPS:
        raise TaskFolderError(f"{where}: {len(entries)} steps, over the {MAX_STEPS} this "
                              "server runs")
    if (root / STEPS).is_symlink():
        raise TaskFolderError(f"{root}: {STEPS}/ is a link; a step's files must be in the "
                              "task's folder (they are copied per job)")
    if not (root / STEPS).is_dir():
        raise TaskFolderError(f"{root}: no {STEPS}/ folder (a multi-step task keeps each "
                              "step's instruction and tests there)")
    shared_test = (root / TEST_SCRIPT).is_file() and not (root / TEST_SCRIPT).is_symlink()
    steps: list[HarborStep] = []
    unknown: list[str] = []
    for index, entry in enumerate(entries):
        name = entry.get("name")
        if not isinstance(name, str) or not _STEP_NAME.fullmatch(name):
            raise TaskFolderError(f"{where} #{index + 1}: name must be a folder name of "
                                  f"letters, digits, '.', '_' and '-', got {name!r}")
        if any(step.name == name for step in steps):
            raise TaskFolderError(f"{where}: two steps are named {name!r}")
        here = f"{root / CONFIG}: [[steps]] {name!r}"
        folder = root / STEPS / name
        if folder.is_symlink() or not folder.is_dir():
            raise TaskFolderError(f"{here}: no folder {STEPS}/{name}/ (its instruction.md "
                                  "and tests)")
        links = [sub for sub in (TESTS, WORKDIR, SOLUTION) if (folder / sub).is_symlink()]
        if links:
            raise TaskFolderError(f"{here}: {STEPS}/{name}/{links[0]} is a link; a step's "
                                  "files must be in its folder (they are copied per job)")
        instruction = _read_text(folder / INSTRUCTION, MAX_INSTRUCTION).strip()
        if not instruction:
            raise TaskFolderError(f"{folder / INSTRUCTION}: empty; it is the step's prompt")
        agent = _step_table(entry, "agent", here)
        verifier = _step_table(entry, "verifier", here)
        own_context = f"{STEPS}/{name}/{TESTS}"
        separate = _verifier_environment(
            root, _step_verifier_mode(task_verifier, verifier), resources,
            own_context if (root / own_context / "Dockerfile").is_file() else TESTS,
            f"{here} [steps.verifier]", env_keys)
        own_test = (folder / TEST_SCRIPT).is_file() and not (folder / TEST_SCRIPT).is_symlink()
        if not own_test and not shared_test and separate is None:
            raise TaskFolderError(f"{here}: no verifier: neither {STEPS}/{name}/{TEST_SCRIPT} "
                                  f"nor {TEST_SCRIPT}")
        unknown += [f"steps.{name}.{k}" for k in entry if k not in _STEP_KNOWN[""]]
        for table_name in ("agent", "verifier", "healthcheck"):
            table = entry.get(table_name)
            if isinstance(table, Mapping):
                unknown += [f"steps.{name}.{table_name}.{k}" for k in table
                            if k not in _STEP_KNOWN[table_name]]
        workdir = folder / WORKDIR
        steps.append(HarborStep(
            name=name, instruction=instruction,
            agent_timeout_s=_number(agent, "timeout_sec", agent_timeout, f"{here} [agent]",
                                    positive=True),
            verifier_timeout_s=_number(verifier, "timeout_sec", verifier_timeout,
                                       f"{here} [verifier]", positive=True),
            verifier_env={**verifier_env,
                          **_strings(verifier, "env", f"{here} [verifier]")},
            min_reward=_min_reward(entry.get("min_reward"), here),
            healthcheck=_healthcheck(entry.get("healthcheck"), here),
            has_workdir=workdir.is_dir() and not workdir.is_symlink(),
            has_solution=(folder / SOLVE_SCRIPT).is_file()
            and not (folder / SOLVE_SCRIPT).is_symlink(),
            has_tests=(folder / TESTS).is_dir() and not (folder / TESTS).is_symlink(),
            agent_user=_step_agent_user(agent, agent_user, f"{here} [steps.agent]"),
            verifier_user=(_user(verifier, f"{here} [verifier]") if "user" in verifier
                           else verifier_user),
            artifacts=tuple(dict.fromkeys(
                [*artifacts, *_artifacts(entry.get("artifacts"), f"{here} artifacts")])),
            separate=separate))
    return tuple(steps), tuple(unknown)


def _step_agent_user(agent: Mapping[str, Any], task_user: str | None,
                     where: str) -> str | None:
    """A step's agent runs as the task's ``[agent].user``: one sandbox has one agent user, so
    a step that names another is refused."""
    if "user" not in agent:
        return task_user
    user = _user(agent, where)
    if user != task_user:
        raise TaskFolderError(f"{where} user = {user!r}: every step's agent runs as the task's "
                              f"[agent].user ({task_user or 'the image USER'}) on this server "
                              "(one sandbox, one agent user)")
    return user


def _step_table(entry: Mapping[str, Any], name: str, where: str) -> Mapping[str, Any]:
    value = entry.get(name, {})
    if not isinstance(value, Mapping):
        raise TaskFolderError(f"{where}: [steps.{name}] must be a table")
    return value


def _min_reward(value: Any, where: str) -> float | dict[str, float] | None:
    """``min_reward``: a number (the ``reward`` entry's floor) or a table of entries' floors."""
    if value is None:
        return None
    if isinstance(value, Mapping) and value and all(isinstance(k, str) for k in value):
        return {k: _number(value, k, 0, f"{where} min_reward", signed=True) for k in value}
    if not isinstance(value, Mapping):
        return _number({"min_reward": value}, "min_reward", 0, where, signed=True)
    raise TaskFolderError(f"{where} min_reward must be a number or a table of reward entries "
                          f"to numbers, got {value!r}")


def _healthcheck(value: Any, where: str) -> Healthcheck | None:
    if value is None:
        return None
    here = f"{where} [steps.healthcheck]"
    if not isinstance(value, Mapping):
        raise TaskFolderError(f"{here} must be a table")
    command = value.get("command")
    if not isinstance(command, str) or not command.strip() or len(command) > 4096:
        raise TaskFolderError(f"{here} command must be a shell command")
    base = Healthcheck(command)
    retries = _number(value, "retries", base.retries, here)
    if retries != int(retries) or not 1 <= retries <= MAX_HEALTHCHECK_RETRIES:
        raise TaskFolderError(f"{here} retries must be a whole number from 1 to "
                              f"{MAX_HEALTHCHECK_RETRIES}, got {value['retries']!r}")
    return Healthcheck(
        command=command,
        interval_s=_number(value, "interval_sec", base.interval_s, here),
        timeout_s=_number(value, "timeout_sec", base.timeout_s, here, positive=True),
        retries=int(retries),
        start_period_s=_number(value, "start_period_sec", base.start_period_s, here),
        start_interval_s=_number(value, "start_interval_sec", base.start_interval_s, here))


def _refuse_multi_container(root: Path, env_table: Mapping[str, Any],
                            where: str) -> tuple[str, ...]:
    """A task that needs containers beside the agent's (see the module's docstring) is
    refused. Harbor merges a Compose file in ``environment/`` over its own configuration of
    the agent's container, the service ``main``: one that only adjusts ``main`` is a
    single-container task, and what it sets there is returned to be reported with the unknown
    keys (it is not applied here)."""
    adjusted: list[str] = []
    for name in COMPOSE_FILES:
        path = root / ENVIRONMENT / name
        if not path.exists():
            continue
        import yaml  # pyyaml; only for the tasks that bring a Compose file

        try:
            doc = yaml.safe_load(_read_text(path, MAX_CONFIG))
        except yaml.YAMLError as e:
            raise TaskFolderError(f"{path}: not valid YAML: {e}") from None
        except RecursionError:  # the composer recurses once per level of nesting
            raise TaskFolderError(f"{path}: nested too deeply to read") from None
        doc = doc if isinstance(doc, Mapping) else {}
        services = doc.get("services")
        services = services if isinstance(services, Mapping) else {}
        others = sorted(str(n) for n in services if n != "main")
        if others:
            raise TaskFolderError(
                f"{path}: a multi-container task (services {', '.join(others)} beside the "
                f"agent's container 'main'); this server runs each job in one rootless "
                f"sandbox, without a Docker daemon, and cannot start the task's other "
                f"containers")
        main = services.get("main")
        adjusted += [f"{ENVIRONMENT}/{name}: services.main.{k}"
                     for k in (main if isinstance(main, Mapping) else {})]
        adjusted += [f"{ENVIRONMENT}/{name}: {k}" for k in doc if k != "services"]
    if env_table.get("mcp_servers"):
        raise TaskFolderError(
            f"{where} mcp_servers: the task's tools are served by MCP servers beside the "
            f"agent's container, which this server cannot start (one rootless sandbox per job)")
    return tuple(adjusted)


def _verifier_environment(root: Path, verifier: Mapping[str, Any],
                          resources: VerifierEnvironment, context: str, where: str,
                          unknown: list[str]) -> VerifierEnvironment | None:
    """Harbor's separate verifier, when the table asks for one (``environment_mode =
    "separate"``, or a ``[verifier.environment]`` table without a mode): its image is
    ``[verifier.environment].docker_image`` or built from ``context`` (the tests' folder,
    which must then hold a Dockerfile; Harbor does not copy the tests into it, the image holds
    ``/tests/test.sh``); its resources default to the task's ``[environment]``."""
    mode = verifier.get("environment_mode")
    if mode not in (None, "shared", "separate"):
        raise TaskFolderError(f"{where} environment_mode must be \"shared\" or \"separate\", "
                              f"got {mode!r}")
    table = verifier.get("environment")
    if mode == "shared" and table is not None:
        raise TaskFolderError(f"{where}: environment_mode = \"shared\" with a "
                              f"[verifier.environment] table (Harbor refuses it too)")
    if mode != "separate" and table is None:
        return None
    table = {} if table is None else table
    here = where.replace("verifier]", "verifier.environment]")
    if not isinstance(table, Mapping):
        raise TaskFolderError(f"{here} must be a table")
    gpus = _number(table, "gpus", 0, here)
    if gpus > 0:
        raise TaskFolderError(f"{here} gpus = {gpus:g}: sandboxes on this server get no GPU")
    if str(table.get("os", "linux")).lower() != "linux":
        raise TaskFolderError(f"{here} os = {table['os']!r}: only linux tasks run here")
    image = table.get("docker_image") or ""
    if not isinstance(image, str) or any(c.isspace() for c in image) or len(image) > 1000:
        raise TaskFolderError(f"{here} docker_image must be one image reference")
    dockerfile = root / context / "Dockerfile"
    if not image and (not dockerfile.is_file() or dockerfile.is_symlink()):
        raise TaskFolderError(
            f"{where}: a separate verifier needs its image: [verifier.environment].docker_image "
            f"or {context}/Dockerfile (built with {context}/ as its context; the image holds "
            f"/tests/test.sh)")
    workdir = table.get("workdir") or ""
    if not isinstance(workdir, str) or (workdir and not workdir.startswith("/")):
        raise TaskFolderError(f"{here} workdir must be an absolute path")
    unknown += [f"{here.rsplit('[', 1)[-1].rstrip(']')}.{k}" for k in table
                if k not in _ENV_KNOWN]
    return VerifierEnvironment(
        docker_image=image, context="" if image else context,
        build_timeout_s=_number(table, "build_timeout_sec", resources.build_timeout_s, here,
                                positive=True),
        cpus=_number(table, "cpus", resources.cpus, here, positive=True),
        memory_mb=_megabytes(table, "memory_mb", "memory", resources.memory_mb, here),
        storage_mb=_megabytes(table, "storage_mb", "storage", resources.storage_mb, here),
        workdir=workdir, env=_strings(table, "env", here),
        allow_internet=(_allow_internet(table, here)
                        if {"allow_internet", "network_mode"} & set(table)
                        else resources.allow_internet))


def _step_verifier_mode(task: Mapping[str, Any], step: Mapping[str, Any]) -> dict[str, Any]:
    """A step's ``environment_mode`` and ``environment``: its own where it sets either (a
    separate step without its own table takes the task's), else the task's."""
    keys = ("environment_mode", "environment")
    if not any(k in step for k in keys):
        return {k: task[k] for k in keys if k in task}
    own = {k: step[k] for k in keys if k in step}
    if own.get("environment_mode") == "separate" and "environment" not in own and (
            "environment" in task):
        own["environment"] = task["environment"]
    return own


def _artifacts(value: Any, where: str) -> tuple[str, ...]:
    """``artifacts``: absolute paths, or tables with a ``source`` (``destination`` places the
    copy in Harbor's trial folder and means nothing here; a ``service`` other than ``main`` is
    a sidecar's, which this server has none of)."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_ARTIFACTS:
        raise TaskFolderError(f"{where} must be a list of at most {MAX_ARTIFACTS} paths")
    paths: list[str] = []
    for entry in value:
        source = entry.get("source") if isinstance(entry, Mapping) else entry
        if isinstance(entry, Mapping) and entry.get("service", "main") != "main":
            raise TaskFolderError(f"{where}: an artifact of service {entry['service']!r}, a "
                                  "sidecar this server does not run")
        if not isinstance(source, str) or not source.startswith("/") or "\0" in source or (
                len(source) > 4096 or os.path.normpath(source) == "/"):
            raise TaskFolderError(f"{where}: each entry must be an absolute path (below /) or "
                                  f"a table with one as its source, got {entry!r}")
        path = os.path.normpath(source)
        clash = next((p for p in PROTECTED_PATHS if path == p or path.startswith(p + "/")
                      or p.startswith(path.rstrip("/") + "/")), None)
        if clash is not None:
            raise TaskFolderError(f"{where}: {path!r} is or holds {clash}, which the verifier's "
                                  "sandbox keeps its own (the agent's copy would replace it)")
        paths.append(path)
    return tuple(dict.fromkeys(paths))


def find_tasks(paths: list[Path]) -> list[Path]:
    """Task folders named by ``paths``: each is a task (it holds ``task.toml``) or a data set
    whose subfolders (at any depth) are; sorted, each once."""
    found: dict[Path, None] = {}
    for given in paths:
        root = Path(os.path.realpath(given))
        if (root / CONFIG).is_file():
            found.setdefault(root, None)
            continue
        if not root.is_dir():
            raise TaskFolderError(f"{given}: not a directory")
        below = sorted(p.parent for p in root.rglob(CONFIG) if p.is_file())
        if not below:
            raise TaskFolderError(f"{given}: no {CONFIG} in it or below it")
        for task in below:
            if not any(parent in found for parent in task.parents):
                found.setdefault(task, None)
    return list(found)


def digest(path: Path) -> str:
    """A hash of every regular file of the folder (paths and contents), so a job can tell the
    folder changed since it was imported."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath) / name
            if full.is_symlink() or not full.is_file():
                continue
            h.update(str(full.relative_to(path)).encode() + b"\0")
            h.update(hashlib.sha256(full.read_bytes()).digest())
    return h.hexdigest()


def _read_text(path: Path, limit: int) -> str:
    if not path.is_file() or path.is_symlink():
        raise TaskFolderError(f"{path}: missing (every Harbor task has it)")
    data = path.read_bytes()
    if len(data) > limit:
        raise TaskFolderError(f"{path}: {len(data)} bytes, over the {limit} this server reads")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise TaskFolderError(f"{path}: not UTF-8 text") from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(_read_text(path, MAX_CONFIG))
    except tomllib.TOMLDecodeError as e:
        raise TaskFolderError(f"{path}: not valid TOML: {e}") from None
    except RecursionError:  # the parser recurses once per level of nested arrays
        raise TaskFolderError(f"{path}: nested too deeply to read") from None


def _table(config: Mapping[str, Any], name: str, root: Path) -> Mapping[str, Any]:
    value = config.get(name, {})
    if not isinstance(value, Mapping):
        raise TaskFolderError(f"{root / CONFIG}: [{name}] must be a table")
    return value


def _number(table: Mapping[str, Any], key: str, default: float, where: str, *,
            positive: bool = False, signed: bool = False) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value) or (value < 0 and not signed) or (positive and value == 0):
        kind = "positive" if positive else "finite" if signed else "non-negative"
        raise TaskFolderError(f"{where} {key} must be a {kind} number, got {value!r}")
    return float(value)


def _megabytes(table: Mapping[str, Any], key: str, spelled: str, default: int,
               where: str) -> int:
    """``memory_mb = 2048`` or the later spelling ``memory = "2G"``."""
    if key in table:
        return int(_number(table, key, default, where, positive=True))
    if spelled not in table:
        return default
    value = table[spelled]
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise TaskFolderError(f"{where} {spelled} must be a size such as \"4G\" or \"512M\", "
                              f"got {value!r}")
    return max(1, int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]))


def _allow_internet(table: Mapping[str, Any], where: str) -> bool:
    if "network_mode" in table:
        mode = table["network_mode"]
        if mode not in ("public", "no-network"):
            raise TaskFolderError(f"{where} network_mode must be \"public\" or \"no-network\", "
                                  f"got {mode!r}")
        return mode == "public"
    value = table.get("allow_internet", True)
    if not isinstance(value, bool):
        raise TaskFolderError(f"{where} allow_internet must be true or false")
    return value


def _strings(table: Mapping[str, Any], key: str, where: str) -> dict[str, str]:
    value = table.get(key, {})
    if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)
            and isinstance(v, str | int | float | bool) for k, v in value.items()):
        raise TaskFolderError(f"{where} {key} must be a table of variable names to values")
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in value.items()}


def _user(table: Mapping[str, Any], where: str) -> str | None:
    """``user``: a name or a uid (optionally ``:group``), as Harbor passes it to the
    container runtime; resolved later in the task's image."""
    value = table.get("user")
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32 - 1:
        return str(value)
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9_.][A-Za-z0-9_.$-]*"
                                               r"(:[A-Za-z0-9_.][A-Za-z0-9_.$-]*)?", value) \
            and len(value) <= 128:
        return value
    raise TaskFolderError(f"{where} user must be a user name or a uid (optionally with "
                          f"':group'), got {value!r}")


def _unknown(config: Mapping[str, Any]) -> tuple[str, ...]:
    unknown = [k for k in config if k not in _KNOWN[""]]
    for section, known in _KNOWN.items():
        table = config.get(section) if section else None
        if isinstance(table, Mapping):
            unknown += [f"{section}.{k}" for k in table if k not in known]
    return tuple(sorted(unknown))


def _check_size(root: Path, folders: tuple[str, ...]) -> None:
    total = 0
    for folder in folders:
        for dirpath, _, filenames in os.walk(root / folder):
            for name in filenames:
                full = os.path.join(dirpath, name)
                if not os.path.islink(full):
                    total += os.path.getsize(full)
    if total > MAX_FOLDER_BYTES:
        raise TaskFolderError(f"{root}: tests/ and solution/ hold {total} bytes, over the "
                              f"{MAX_FOLDER_BYTES} a job copies")
