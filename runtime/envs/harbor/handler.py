"""The ``harbor`` environment: a Harbor task folder (``instruction.md``, ``task.toml``,
``environment/``, ``tests/``, ``solution/``) run in its own image, judged by its own verifier.

Task format (``rollout tasks import-harbor DIR...`` writes these lines)::

    {
      "task_dir": "/data/tasks/hello-world",  # a task folder on the server, inside
                                              # server.task_path_roots
      "agent": "model",                       # optional: "model" (the built-in agent loop),
                                              # "oracle" (the task's solution/solve.sh) or
                                              # "noop" (nothing: what an idle policy earns)
      "digest": "3f2a...",                    # optional: the folder's hash at import time;
                                              # INIT refuses a folder changed since
      "name": "org/hello-world"               # optional, informational
    }

INIT opens the job's sandbox rooted at the task's image (``[environment].docker_image``, or
``environment/Dockerfile`` built daemonless; see :mod:`rollout.runtime.sandbox.images`), with a
copy-on-write layer of its own, so the agent may change any path (``/usr/local/bin``,
``/etc``) as in a container. ``task.toml``'s resources become the sandbox's limits
(:func:`sandbox_limits`); the sandbox has no network, whatever ``allow_internet`` says (see
docs/harbor.md): only the verifier's ``test.sh`` reaches the hosts of the server's
``sandbox.verifier_hosts`` (:mod:`~rollout.runtime.envs.grading.network`), unless the task
sets ``allow_internet = false``.

RUN is the built-in agent loop with bash, the editor and submit, started in the task's working
directory, the instruction as the user message (or, under the ``harness`` environment, any
harness preset; or the oracle's ``solve.sh``). The end of RUN kills every process the agent
started.

EVAL runs only after that: ``/logs/verifier`` and ``/tests`` are host directories bound into
the sandbox, emptied on the host once no process of the agent is left, and ``tests/`` is
copied in then (the agent saw an empty ``/tests``). ``tests/test.sh`` runs as the task says
(its own interpreter line, ``[verifier].env``, ``TEST_DIR=/tests``, the verifier's timeout, as
``[verifier].user``; the agent runs as ``[agent].user``; either unset: the image's USER) in
the agent's filesystem, since its checks read what the agent changed; every process it left is
killed before the reward files are read on the host, never through a program of the sandbox.
So the reward file is the verifier run's: one the agent wrote beforehand was removed, and no
process of the agent was alive to write one afterwards. :mod:`.verdict` reads it.

A multi-step task (``[[steps]]``; :mod:`.taskdir`) runs its steps in order in the one
sandbox. Each step: its ``workdir/`` is copied into the working directory and its
``setup.sh`` run there (as the agent's user), its healthcheck polled, then its agent runs with
the step's instruction in a conversation of its own (as Harbor starts its agent afresh per
step: the model sees the files earlier steps left, not their messages; each step's turns are a
segment of the one trajectory), then every process of the agent is killed and the step is
verified as above, with the task's ``tests/`` and the step's over them and the step's
``[verifier]`` settings; then ``/tests`` and ``/logs/verifier`` are emptied again before the
next step. A step under its ``min_reward``, or whose set-up or healthcheck fails (the earlier
steps' agent may have broken what it checks), ends the task. RUN verifies every step but the
last it ran, EVAL that one, and EVAL rolls the steps up (:func:`roll_up`): steps that did not
run count 0, so stopping early never pays more than going on.

A task (or step) with a separate verifier (``environment_mode = "separate"``) is verified in a
fresh sandbox of the verifier's image instead (:func:`_verify_separate`): only the task's
``artifacts`` and ``/logs/artifacts`` pass from the agent's sandbox to it, through
``in_sandbox/harbor_artifacts.py`` run in each (regular files, no link followed, bounded), and
the image's own ``/tests/test.sh`` runs on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.runtime.agent_loop import DEADLINE_MARGIN_S, TURNS_KEY, run_agent_loop
from rollout.runtime.envs.common import (
    IN_SANDBOX,
    SANDBOX_KEY,
    check_task_object,
    host_path,
    invalid,
    optional_choice,
    sandbox_of,
    sandbox_tools,
)
from rollout.runtime.envs.grading import network
from rollout.runtime.envs.grading.isolated import end_agent
from rollout.runtime.envs.harbor import taskdir, verdict
from rollout.runtime.envs.harbor.taskdir import (
    HarborStep,
    HarborTask,
    TaskFolderError,
    VerifierEnvironment,
)
from rollout.runtime.gateway import SEGMENTS_KEY
from rollout.runtime.handler import AgentHandler, HandlerError, JobContext, RunOutcome
from rollout.runtime.sandbox import hostfs
from rollout.runtime.sandbox.base import SandboxLimits, python_argv
from rollout.runtime.sandbox.images.user import UserRequest
from rollout.runtime.sandbox.reaper import owned_tempdir
from rollout.runtime.tools.submit import SubmitTool
from rollout.runtime.types import Reward, Segment, SegmentReason, TerminationReason, Turn

ENV = "harbor"
AGENTS = ("model", "oracle", "noop")
VERIFIER_DIR = "/logs/verifier"
TESTS_DIR = "/tests"
SOLUTION_DIR = "/solution"
ARTIFACTS_DIR = "/.rollout-artifacts"
"""A separate verifier's inputs: written in the agent's sandbox (emptied first, once no process
of the agent is left), read in the verifier's."""
ARTIFACTS_SOURCE = IN_SANDBOX / "harbor_artifacts.py"
MAX_ARTIFACT_BYTES = taskdir.MAX_FOLDER_BYTES
MAX_ARTIFACT_ENTRIES = 100_000
STEP_FILES_DIR = "/.rollout-harbor-step"
"""A multi-step task's current step's ``workdir/``, bound read-only for the copy into the
working directory (emptied once copied)."""
TASK_KEY = "harbor.task"
DIRS_KEY = "harbor.dirs"
WORKDIR_KEY = "harbor.workdir"
VERIFIER_USER_KEY = "harbor.verifier_user"
STEP_USERS_KEY = "harbor.step_verifier_users"
STEPS_KEY = "harbor.steps"
"""``ctx.state`` key: a multi-step task's verified steps so far (:class:`StepResult`)."""
PENDING_KEY = "harbor.pending_step"
"""``ctx.state`` key: the index of the step whose agent ran (or runs) and is not verified yet."""
_LOG_TAIL = 2000
_TASK_FIELDS = ("task_dir", "agent", "digest", "name")

INSTRUCTIONS = (
    "You are an agent working in a Linux container; your working directory is {workdir}. "
    "Complete the task the user gives you with the tools: `bash` runs shell commands (you may "
    "change any file of the container, install what the task needs if it can be installed "
    "offline), `editor` views and edits files. There is no network. When the task is done, "
    "call `submit` with a one-line summary.")


class HarborHandler(AgentHandler):
    name = ENV

    def validate_task(self, task: Mapping[str, Any]) -> None:
        check_task_object(task, ENV)
        unknown = sorted(set(task) - set(_TASK_FIELDS))
        if unknown:
            raise invalid(f"harbor task has unknown fields {unknown}; known: "
                          f"{list(_TASK_FIELDS)}", "")
        optional_choice(task, "agent", AGENTS, env=ENV)
        for name in ("digest", "name"):
            if not isinstance(task.get(name, ""), str):
                raise invalid(f"harbor task field {name!r} must be a string", name)
        # At submit, on the server's event loop: the small files only.
        load_task(task, sizes=False)

    async def init(self, ctx: JobContext) -> None:
        task = ctx.spec.task
        self.validate_task(task)
        harbor = await asyncio.to_thread(load_task, task)
        if task.get("digest"):
            now = await asyncio.to_thread(taskdir.digest, harbor.path)
            if now != task["digest"]:
                raise HandlerError(f"the Harbor task folder {harbor.path} changed since it was "
                                   "imported (its digest differs): import it again",
                                   "INVALID_TASK")
        ctx.state[TASK_KEY] = harbor
        dirs, lock = await asyncio.to_thread(_job_dirs, harbor,
                                             task.get("agent", "model") == "oracle")
        ctx.resources.callback(os.close, lock)
        ctx.resources.callback(hostfs.rmtree, dirs["root"])
        ctx.state[DIRS_KEY] = {k: str(v) for k, v in dirs.items()}
        binds = [(str(dirs["verifier"]), VERIFIER_DIR, True), (str(dirs["tests"]), TESTS_DIR, True)]
        if "solution" in dirs:
            binds.append((str(dirs["solution"]), SOLUTION_DIR, False))
        if "step" in dirs:
            binds.append((str(dirs["step"]), STEP_FILES_DIR, False))
        if "artifacts" in dirs:
            binds.append((str(dirs["artifacts"]), ARTIFACTS_DIR, True))
        # [agent].user: every process of the agent (and the oracle) runs as that user of
        # the image, as Harbor's exec does; unset, the image's USER.
        user = ({"user": UserRequest(harbor.agent_user, named_by="task.toml [agent].user")}
                if harbor.agent_user is not None else {})
        sandbox = await ctx.open_sandbox(image=image_source(harbor), binds=binds,
                                         env=dict(harbor.environment_env), network="none",
                                         limits=sandbox_limits(harbor), **user)
        ctx.state[SANDBOX_KEY] = sandbox
        shared = harbor.separate is None and (
            not harbor.steps or any(step.separate is None for step in harbor.steps))
        if shared and (harbor.verifier_user is not None or harbor.agent_user is not None):
            # Resolved now, in the image as built (a passwd the agent edits cannot move the
            # verifier), so a user the image lacks fails INIT, before any agent ran. Unset,
            # it is the image's USER, which a sandbox made for [agent].user does not run as.
            # (A separate verifier's user is resolved in its own image.)
            user_for = getattr(sandbox, "user_for", None)
            if user_for is None:
                raise HandlerError(f"the Harbor task {harbor.name} sets a user in task.toml, "
                                   "which this server's sandbox runtime cannot apply (the "
                                   "bwrap runtime does)", "INVALID_TASK")
            ctx.state[VERIFIER_USER_KEY] = await asyncio.to_thread(
                user_for, harbor.verifier_user, named_by="task.toml [verifier].user")
        await _resolve_step_users(ctx, sandbox, harbor)
        # Writable by the agent's user (a root server's sandbox uid; the image's uid in a
        # rootless server's mapped namespace).
        await asyncio.to_thread(sandbox.hand_over, [dirs["verifier"], dirs["tests"]])
        # A separate verifier's image is pulled or built now, under INIT's time, as the
        # agent's is: a job must not find it missing in EVAL.
        for separate in harbor.verifier_environments:
            await (await ctx.open_sandbox(image=verifier_source(harbor, separate),
                                          network="none")).destroy()
        # The image's WorkingDir (Harbor's tasks rely on their Dockerfile's WORKDIR).
        ctx.state[WORKDIR_KEY] = harbor.workdir or getattr(sandbox, "default_cwd",
                                                           sandbox.workspace_in_sandbox)
        ctx.progress("environment", {"task": harbor.name, "image": harbor.image_source})

    async def run(self, ctx: JobContext) -> RunOutcome:
        sandbox = sandbox_of(ctx)
        harbor = task_of(ctx)
        agent = ctx.spec.task.get("agent", "model")
        workdir = ctx.state.get(WORKDIR_KEY, sandbox.workspace_in_sandbox)
        if harbor.steps:
            return await _run_steps(ctx, harbor, agent, workdir)
        budget = min(harbor.agent_timeout_s, ctx.spec.limits.run_timeout_s) - DEADLINE_MARGIN_S
        try:
            if agent == "model":
                tools = [*sandbox_tools(sandbox, ["bash", "editor"], ctx),
                         SubmitTool(ctx.state, answer_description="A one-line summary.")]
                messages = [{"role": "system", "content": INSTRUCTIONS.format(workdir=workdir)},
                            {"role": "user", "content": harbor.instruction}]
                return await run_agent_loop(ctx, tools, messages,
                                            deadline=time.monotonic() + max(1.0, budget))
            if agent == "oracle":
                return await _oracle(sandbox, harbor, workdir, max(1.0, budget))
            return RunOutcome([], TerminationReason.SUBMITTED, {"agent": "noop"})
        finally:
            await end_agent(ctx)

    async def eval(self, ctx: JobContext) -> Reward:
        harbor = task_of(ctx)
        if harbor.steps:
            pending = ctx.state.pop(PENDING_KEY, None)
            if pending is not None:
                step = harbor.steps[pending]
                ctx.progress("step_verifier", {"step": step.name})
                results = ctx.state.setdefault(STEPS_KEY, [])
                results.append(StepResult.of(step, await verify(ctx, harbor, step)))
            return roll_up(harbor, ctx.state.get(STEPS_KEY, []))
        return await verify(ctx, harbor, None)

    async def cleanup(self, ctx: JobContext) -> None:
        ctx.state.pop(SANDBOX_KEY, None)


async def verify(ctx: JobContext, harbor: HarborTask, step: HarborStep | None, *,
                 time_left: float | None = None) -> Reward:
    """Run the task's verifier (a multi-step task's: ``step``'s) on what the agent left, and
    read its reward. Nothing of the agent runs from here on; what it left in the verifier's
    and the tests' folders goes, and the tests arrive only now. ``time_left``: the stage's
    remaining seconds, when less than the eval limit."""
    separate = step.separate if step is not None else harbor.separate
    if separate is not None:
        return await _verify_separate(ctx, harbor, step, separate, time_left)
    sandbox = sandbox_of(ctx)
    dirs = _dirs(ctx)
    await end_agent(ctx)
    shared = [dirs["verifier"], dirs["tests"]]
    await asyncio.to_thread(sandbox.take_back, shared)
    await asyncio.to_thread(_refill, dirs, harbor, step)
    users = ctx.state.get(STEP_USERS_KEY, {})
    if step is not None and step.name in users:
        as_user = {"user": users[step.name]}
    else:
        as_user = ({"user": ctx.state[VERIFIER_USER_KEY]}
                   if VERIFIER_USER_KEY in ctx.state else {})
    # The verifier's user writes its reward file and may write beside its tests.
    await asyncio.to_thread(sandbox.hand_over, shared, as_user.get("user"))
    limit = step.verifier_timeout_s if step is not None else harbor.verifier_timeout_s
    room = ctx.spec.limits.eval_timeout_s - 5.0 if time_left is None else time_left
    timeout = max(1.0, min(limit, room))
    env = {**(step.verifier_env if step is not None else harbor.verifier_env),
           "TEST_DIR": TESTS_DIR}
    tested = await _run_tests(sandbox, harbor.allow_internet, dirs["root"], timeout=timeout,
                              cwd=ctx.state.get(WORKDIR_KEY), env=env,
                              user=as_user.get("user"))
    # Whatever the verifier left running must not touch the reward after this point.
    await sandbox.stop_processes()
    # Readable on the host whatever mode the verifier gave its files.
    await asyncio.to_thread(sandbox.take_back, shared)
    files = await asyncio.to_thread(_reward_files, dirs["verifier"])
    return _judged(tested, files, timeout, {"task": harbor.name})


@dataclass
class _Tested:
    """A run of ``test.sh`` and what its network refused or could not reach."""

    run: Any
    refused: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()


async def _run_tests(sandbox: Any, allow_internet: bool, folder: Path, *,
                     timeout: float,  # noqa: ASYNC109 - the command's deadline
                     cwd: str | None, env: Mapping[str, str], user: Any) -> _Tested:
    """``/tests/test.sh`` in ``sandbox`` as ``user``: behind the server's verifier network
    (:mod:`~rollout.runtime.envs.grading.network`; the allow-listing proxy's socket in
    ``folder``) unless the task sets ``allow_internet = false`` or the runtime cannot relay
    one launch."""
    argv = [f"{TESTS_DIR}/test.sh"]
    hosts = network.verifier_hosts(sandbox)
    as_user = {"user": user} if user is not None else {}
    if hosts is None or not allow_internet:
        return _Tested(await sandbox.exec(argv, timeout=timeout, cwd=cwd, env=env,
                                          max_output=1 << 20, **as_user))
    done = await network.exec_networked(sandbox, argv, hosts=hosts, folder=folder,
                                        timeout=timeout, env=env, cwd=cwd, user=user)
    return _Tested(done.run, done.refused, done.failed)


def _judged(tested: _Tested, files: dict[str, bytes | None], timeout: float,
            info: dict[str, str]) -> Reward:
    """The reward of a verifier run from the files it left (:mod:`.verdict`); 0 with the
    reason when it ran past its timeout or its files say nothing usable. The hosts its
    network refused are in ``network_refused``, the listed ones it could not reach (with
    why) in ``network_failed``."""
    found = verdict.read(files)
    run = tested.run
    info.update({"verifier_exit": str(run.exit_code), "reward_file": found.source,
                 "log": run.output[-_LOG_TAIL:]})
    if tested.refused:
        info["network_refused"] = ", ".join(tested.refused)[:1000]
    if tested.failed:
        info["network_failed"] = "; ".join(tested.failed)[:1000]
    if run.timed_out:
        info["error"] = f"the verifier (tests/test.sh) ran past its {timeout:g} s timeout"
        return Reward(0.0, {}, info)
    if found.problem:
        info["error"] = found.problem
    return Reward(found.value, found.components, info)


async def _verify_separate(ctx: JobContext, harbor: HarborTask, step: HarborStep | None,
                           env: VerifierEnvironment, time_left: float | None) -> Reward:
    """Harbor's separate verifier: the task's artifacts (and ``/logs/artifacts``) copied out
    of the agent's sandbox once no process of the agent is left, then a fresh sandbox of the
    verifier's image gets them at the same paths and runs the image's ``/tests/test.sh``.
    Nothing else of the agent's environment (a replaced interpreter, a planted test or reward,
    a process) reaches the verifier."""
    agent = sandbox_of(ctx)
    dirs = _dirs(ctx)
    started = time.monotonic()
    room = ctx.spec.limits.eval_timeout_s - 5.0 if time_left is None else time_left
    limit = step.verifier_timeout_s if step is not None else harbor.verifier_timeout_s
    info = {"task": harbor.name, "verifier_environment": "separate"}
    await end_agent(ctx)
    store = dirs["artifacts"]
    await asyncio.to_thread(agent.take_back, [store])
    await asyncio.to_thread(_empty, store)
    await asyncio.to_thread(agent.hand_over, [store])
    paths = ["/logs/artifacts", *(step.artifacts if step is not None else harbor.artifacts)]
    collect = await agent.exec(
        [*python_argv(agent), "-I", "-c", ARTIFACTS_SOURCE.read_text(), "collect",
         ARTIFACTS_DIR, str(MAX_ARTIFACT_BYTES), str(MAX_ARTIFACT_ENTRIES), *paths],
        timeout=max(10.0, min(300.0, room / 2)), max_output=64 << 10)
    await agent.stop_processes()
    await asyncio.to_thread(agent.take_back, [store])
    if collect.exit_code != 0 or collect.timed_out:
        # What the policy left (too much, or what cannot be read) is its own doing.
        info["error"] = f"collecting the artifacts failed: {_last_line(collect)}"
        return Reward(0.0, {}, info)
    info["artifacts"] = _last_line(collect)[:500]
    await asyncio.to_thread(_readable, store)
    await asyncio.to_thread(_empty, dirs["verifier"])
    verifier = await ctx.open_sandbox(
        image=verifier_source(harbor, env), network="none", env=dict(env.env),
        binds=[(str(dirs["verifier"]), VERIFIER_DIR, True), (str(store), ARTIFACTS_DIR, False)],
        limits=_limits(env.cpus, env.memory_mb, env.storage_mb, limit))
    try:
        restore = await verifier.exec(
            [*python_argv(verifier), "-I", "-c", ARTIFACTS_SOURCE.read_text(), "restore",
             ARTIFACTS_DIR], timeout=300, max_output=64 << 10)
        if restore.exit_code != 0 or restore.timed_out:
            info["error"] = f"restoring the artifacts failed: {_last_line(restore)}"
            return Reward(0.0, {}, info)
        user_spec = step.verifier_user if step is not None else harbor.verifier_user
        as_user: dict[str, Any] = {}
        if user_spec is not None:
            as_user = {"user": await asyncio.to_thread(
                verifier.user_for, user_spec, named_by="task.toml [verifier].user")}
        # Whatever the copy put there is gone; the verifier's user writes its reward.
        await asyncio.to_thread(_empty, dirs["verifier"])
        await asyncio.to_thread(verifier.hand_over, [dirs["verifier"]], as_user.get("user"))
        timeout = max(1.0, min(limit, room - (time.monotonic() - started)))
        tested = await _run_tests(
            verifier, env.allow_internet, dirs["root"], timeout=timeout,
            cwd=env.workdir or getattr(verifier, "default_cwd", None),
            env={**(step.verifier_env if step is not None else harbor.verifier_env),
                 "TEST_DIR": TESTS_DIR}, user=as_user.get("user"))
        await verifier.stop_processes()
        await asyncio.to_thread(verifier.take_back, [dirs["verifier"]])
        files = await asyncio.to_thread(_reward_files, dirs["verifier"])
    finally:
        await verifier.destroy()
    return _judged(tested, files, timeout, info)


def _dirs(ctx: JobContext) -> dict[str, Path]:
    """The job's host folders (:func:`_job_dirs`) as INIT recorded them."""
    return {k: Path(v) for k, v in ctx.state[DIRS_KEY].items()}


def _last_line(run: Any) -> str:
    lines = run.output.strip().splitlines()
    return lines[-1] if lines else f"exit {run.exit_code}"


def _readable(folder: Path) -> None:
    """Every entry of ``folder`` readable by every uid (the verifier's sandbox reads it
    read-only, as another user than the one that wrote it)."""
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o755)
        for name in filenames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                os.chmod(full, os.stat(full).st_mode & 0o777 | 0o444)


def verifier_source(harbor: HarborTask, env: VerifierEnvironment) -> Any:
    """What roots a separate verifier's sandbox: its prebuilt image, or the tests' folder
    built daemonless (cached by its content, as the agent's image is)."""
    from rollout.runtime.sandbox.images import BuildSpec, with_transport

    if env.docker_image:
        return with_transport(env.docker_image)
    return BuildSpec(context=harbor.path / env.context, dockerfile="Dockerfile",
                     timeout_s=env.build_timeout_s, label=f"{harbor.name} (verifier)")


@dataclass
class StepResult:
    """One step of a multi-step task as verified (or as it failed to start)."""

    name: str
    value: float
    components: dict[str, float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    stop: str = ""
    """Why the steps after this one did not run ('' = they did, or it was the last)."""

    @classmethod
    def of(cls, step: HarborStep, reward: Reward) -> StepResult:
        return cls(step.name, reward.value, dict(reward.components), dict(reward.info),
                   step.below_minimum(reward.components or {"reward": reward.value}))


def roll_up(harbor: HarborTask, results: Sequence[StepResult]) -> Reward:
    """The task's reward from its steps' (``multi_step_reward_strategy``): ``mean`` averages
    each entry over the steps (an entry a step lacks is 0 there), ``final`` takes the last
    step's as they are. A step that did not run (the task stopped before it) counts 0 in the
    mean and, as the last step, makes ``final`` 0. Harbor's own report leaves unrun steps out
    of the mean instead; here that would pay a policy for failing a step early (a 0.4 under a
    0.5 ``min_reward`` would skip the steps it would score worse on), so they count."""
    by_name = {r.name: r for r in results}
    n = len(harbor.steps)
    if harbor.reward_strategy == "final":
        last = by_name.get(harbor.steps[-1].name)
        value = last.value if last is not None else 0.0
        components = dict(last.components) if last is not None else {}
    else:
        value = sum(r.value for r in results) / n
        keys = sorted({k for r in results for k in r.components})
        components = {k: sum(r.components.get(k, 0.0) for r in results) / n for k in keys}
    for step in harbor.steps:
        done = by_name.get(step.name)
        components[f"step:{step.name}"] = done.value if done is not None else 0.0
    stopped = next((r.stop for r in results if r.stop), "")
    last_info = results[-1].info if results else {}
    info = {"task": harbor.name, "reward_strategy": harbor.reward_strategy,
            "steps_verified": str(len(results)), "steps": str(n),
            "step_results": json.dumps([{"step": r.name, "reward": r.value, "stop": r.stop,
                                         **{k: v for k, v in r.info.items()
                                            if k in ("verifier_exit", "reward_file", "error")}}
                                        for r in results]),
            "log": last_info.get("log", "")}
    if stopped:
        info["stopped"] = stopped
    errors = [f"step {r.name!r}: {r.info['error']}" for r in results if r.info.get("error")]
    if errors:
        info["error"] = "; ".join(errors)[:2000]
    return Reward(value, components, info)


class _StepSegments:
    """The live segments of a multi-step run: one per step that has turns (a step's
    conversation starts afresh, sharing only the system message with the step before), so a
    RUN cut mid-step hands over well-formed segments."""

    def __init__(self, turns: list[Turn]) -> None:
        self.turns = turns
        self.starts: list[int] = []

    def __iter__(self) -> Iterator[Segment]:
        kept: list[int] = []
        for start in self.starts:
            if start < len(self.turns):
                if kept and kept[-1] == start:
                    kept.pop()  # the step before ran no turn
                kept.append(start)
        for index, start in enumerate(kept):
            yield (Segment(start, SegmentReason.FIRST) if index == 0 else
                   Segment(start, SegmentReason.HISTORY_REWRITTEN, parent=index - 1))


async def run_steps(ctx: JobContext, harbor: HarborTask, workdir: str,
                    agent_step: Callable[[HarborStep, float], Awaitable[None]]) -> int:
    """Drive a multi-step task's RUN (see the module's docstring): each step's set-up, its
    agent (``await agent_step(step, deadline)``, a ``time.monotonic()`` deadline), the end of
    every process of the agent, and the step's verifier for every step but the last one run
    (EVAL's). Returns how many steps' agents ran. The ``harness`` environment drives a
    harness preset through it."""
    run_end = time.monotonic() + ctx.spec.limits.run_timeout_s - DEADLINE_MARGIN_S
    results: list[StepResult] = ctx.state.setdefault(STEPS_KEY, [])
    last = len(harbor.steps) - 1
    ran = 0
    for index, step in enumerate(harbor.steps):
        ctx.progress("step", {"step": step.name, "index": index, "steps": last + 1})
        problem = await _prepare_step(ctx, harbor, step, workdir)
        if problem:
            results.append(StepResult(step.name, 0.0, {}, {"error": problem}, stop=problem))
            break
        ctx.state[PENDING_KEY] = index
        ran += 1
        try:
            await agent_step(step, min(time.monotonic() + step.agent_timeout_s, run_end))
        finally:
            await end_agent(ctx)
        if index == last:
            break  # EVAL verifies it
        if time.monotonic() >= run_end:
            break  # no time for the rest: EVAL verifies this one, the others count 0
        ctx.progress("step_verifier", {"step": step.name})
        result = StepResult.of(step, await verify(ctx, harbor, step,
                                                  time_left=run_end - time.monotonic()))
        ctx.state.pop(PENDING_KEY, None)
        results.append(result)
        if result.stop:
            break
        await asyncio.to_thread(_hide_tests, ctx)
    return ran


async def _run_steps(ctx: JobContext, harbor: HarborTask, agent: str,
                     workdir: str) -> RunOutcome:
    """A multi-step task's RUN with the built-in agent, the oracle or the no-op: each step's
    turns one segment of the job's trajectory."""
    turns: list[Turn] = []
    segments = _StepSegments(turns)
    ctx.state[TURNS_KEY], ctx.state[SEGMENTS_KEY] = turns, segments
    ended = [TerminationReason.SUBMITTED]
    metadata: dict[str, str] = {"agent": agent}

    async def agent_step(step: HarborStep, deadline: float) -> None:
        segments.starts.append(len(turns))
        outcome = await _step_agent(ctx, harbor, step, agent, workdir, deadline, turns)
        ended[0] = outcome.termination
        for key, value in outcome.metadata.items():
            if key in ("oracle_exit", "oracle_log") and metadata.get("oracle_exit", "0") != "0":
                continue  # the first failing step's solve.sh is the one to show
            metadata[key] = value

    metadata["steps_run"] = str(await run_steps(ctx, harbor, workdir, agent_step))
    return RunOutcome(list(turns), ended[0], metadata, segments=list(segments))


async def _step_agent(ctx: JobContext, harbor: HarborTask, step: HarborStep, agent: str,
                      workdir: str, deadline: float, turns: list[Turn]) -> RunOutcome:
    sandbox = sandbox_of(ctx)
    if agent == "model":
        left = ctx.spec.limits.max_turns - len(turns)
        if left <= 0:
            return RunOutcome([], TerminationReason.MAX_TURNS, {})
        tools = [*sandbox_tools(sandbox, ["bash", "editor"], ctx),
                 SubmitTool(ctx.state, answer_description="A one-line summary.")]
        messages = [{"role": "system", "content": INSTRUCTIONS.format(workdir=workdir)},
                    {"role": "user", "content": step.instruction}]
        return await run_agent_loop(ctx, tools, messages, max_turns=left, turns=turns,
                                    deadline=max(deadline, time.monotonic() + 1.0))
    if agent == "oracle":
        if not step.has_solution:
            return RunOutcome([], TerminationReason.SUBMITTED, {"agent": "oracle"})
        dirs = _dirs(ctx)
        await asyncio.to_thread(_fill, dirs["solution"],
                                harbor.path / taskdir.STEPS / step.name / taskdir.SOLUTION)
        return await _oracle(sandbox, harbor, workdir, max(1.0, deadline - time.monotonic()))
    return RunOutcome([], TerminationReason.SUBMITTED, {"agent": "noop"})


async def _prepare_step(ctx: JobContext, harbor: HarborTask, step: HarborStep,
                        workdir: str) -> str:
    """Before a step's agent: its ``workdir/`` copied into the working directory, its
    ``setup.sh`` run there, its healthcheck passed. Returns '' or why the step cannot start."""
    sandbox = sandbox_of(ctx)
    if step.has_workdir:
        dirs = _dirs(ctx)
        source = harbor.path / taskdir.STEPS / step.name / taskdir.WORKDIR
        await asyncio.to_thread(_fill, dirs["step"], source)
        # Copied by the agent's user, so the files are the agent's to change, as uploaded
        # files are in Harbor's container.
        run = await sandbox.exec(["sh", "-c", 'mkdir -p "$1" && cp -R "$0"/. "$1"/',
                                  STEP_FILES_DIR, workdir], timeout=120, max_output=8192)
        await asyncio.to_thread(_fill, dirs["step"], None)
        if run.exit_code != 0 or run.timed_out:
            return (f"step {step.name!r}: copying its workdir/ into {workdir} failed: "
                    f"{run.output[-500:]}")
        if (source / taskdir.SETUP_SCRIPT).is_file():
            setup = await sandbox.exec(
                ["sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash ./setup.sh; "
                             "else exec sh ./setup.sh; fi"],
                cwd=workdir, timeout=max(1.0, min(step.agent_timeout_s, 600.0)),
                max_output=64 << 10)
            if setup.exit_code != 0 or setup.timed_out:
                why = "ran past its timeout" if setup.timed_out else f"exited {setup.exit_code}"
                return (f"step {step.name!r}: its workdir/setup.sh {why}: "
                        f"{setup.output[-_LOG_TAIL:]}")
    if step.healthcheck is not None:
        return await _healthcheck(sandbox, step, workdir)
    return ""


async def _healthcheck(sandbox: Any, step: HarborStep, workdir: str) -> str:
    """Poll the step's healthcheck as Docker polls a HEALTHCHECK: failures within the start
    period do not count; ``retries`` failures in a row after it fail the step."""
    check = step.healthcheck
    assert check is not None
    started = time.monotonic()
    failures = 0
    while True:
        run = await sandbox.exec(["sh", "-c", check.command], cwd=workdir,
                                 timeout=check.timeout_s, max_output=4096)
        if run.exit_code == 0 and not run.timed_out:
            return ""
        starting = time.monotonic() - started < check.start_period_s
        if not starting:
            failures += 1
            if failures >= check.retries:
                why = "timed out" if run.timed_out else f"exited {run.exit_code}"
                return (f"step {step.name!r}: its healthcheck {check.command!r} failed "
                        f"{failures} time(s), the last {why}: {run.output[-500:]}")
        await asyncio.sleep(check.start_interval_s if starting else check.interval_s)


async def _resolve_step_users(ctx: JobContext, sandbox: Any, harbor: HarborTask) -> None:
    """Steps that name their own verifier user get it resolved now, as the task's is (a
    step's agent user is the task's: :mod:`.taskdir` refuses another)."""
    users: dict[str, Any] = {}
    for step in harbor.steps:
        if step.verifier_user != harbor.verifier_user and step.separate is None:
            user_for = getattr(sandbox, "user_for", None)
            if user_for is None:
                raise HandlerError(f"the Harbor task {harbor.name} sets a user in task.toml, "
                                   "which this server's sandbox runtime cannot apply (the "
                                   "bwrap runtime does)", "INVALID_TASK")
            users[step.name] = await asyncio.to_thread(
                user_for, step.verifier_user,
                named_by=f"task.toml [steps.verifier].user of step {step.name!r}")
    if users:
        ctx.state[STEP_USERS_KEY] = users


def _hide_tests(ctx: JobContext) -> None:
    """After a step's verifier: ``/tests`` and ``/logs/verifier`` empty again, and the agent's,
    before the next step's agent starts."""
    sandbox = sandbox_of(ctx)
    dirs = _dirs(ctx)
    _empty(dirs["verifier"])
    _empty(dirs["tests"])
    sandbox.hand_over([dirs["verifier"], dirs["tests"]])


def load_task(task: Mapping[str, Any], *, sizes: bool = True) -> HarborTask:
    """The task folder a job names, inside the server's allowed roots, read and checked
    (``sizes=False``: without summing its tests and solution, as a submit does)."""
    value = task.get("task_dir")
    if not isinstance(value, str) or not value.strip():
        raise invalid("harbor task needs 'task_dir': the path of a Harbor task folder on the "
                      "server", "task_dir")
    path = host_path(value, "task_dir", env=ENV)
    try:
        return taskdir.load(path, sizes=sizes)
    except (TaskFolderError, OSError) as e:
        raise invalid(f"harbor task folder {value!r}: {e}", "task_dir") from None


def task_of(ctx: JobContext) -> HarborTask:
    harbor = ctx.state.get(TASK_KEY)
    return harbor if isinstance(harbor, HarborTask) else load_task(ctx.spec.task)


def sandbox_limits(harbor: HarborTask) -> SandboxLimits:
    """``task.toml``'s resources as the sandbox's per-process limits: memory as the address
    space, storage as the largest file, CPUs as CPU seconds over the longest stage (a
    process cannot use more than ``cpus`` cores for that long)."""
    return _limits(harbor.cpus, harbor.memory_mb, harbor.storage_mb,
                   max(harbor.agent_timeout_s, harbor.verifier_timeout_s))


def _limits(cpus: float, memory_mb: int, storage_mb: int, longest_s: float) -> SandboxLimits:
    base = SandboxLimits()
    return SandboxLimits(
        cpu_seconds=max(60, math.ceil(longest_s * cpus) + 60),
        address_space_bytes=max(1 << 30, memory_mb << 20),
        processes=base.processes, open_files=base.open_files,
        file_size_bytes=max(16 << 20, storage_mb << 20),
        default_timeout_s=base.default_timeout_s)


def image_source(harbor: HarborTask) -> Any:
    """What roots the task's sandbox (``create_sandbox(image=...)``): the prebuilt
    ``docker_image`` (a registry reference; the server's registries.conf mirrors apply), else
    ``environment/`` built daemonless, cached by its content, under the task's build
    timeout. The sandbox runtime fetches or builds it when the cache lacks it."""
    from rollout.runtime.sandbox.images import BuildSpec, with_transport

    if harbor.docker_image:
        return with_transport(harbor.docker_image)
    return BuildSpec(context=harbor.path / taskdir.ENVIRONMENT, dockerfile="Dockerfile",
                     timeout_s=harbor.build_timeout_s, label=harbor.name)


async def _oracle(sandbox: Any, harbor: HarborTask, workdir: str,
                  timeout: float) -> RunOutcome:  # noqa: ASYNC109
    """Harbor's oracle agent: the task's own ``solution/solve.sh``, bound read-only at
    ``/solution``, with ``[solution].env``."""
    if not harbor.has_solution:
        raise HandlerError(f"the Harbor task {harbor.name} has no solution/solve.sh for the "
                           "oracle agent", "INVALID_TASK")
    run = await sandbox.exec(["bash", f"{SOLUTION_DIR}/solve.sh"], cwd=workdir,
                             env=dict(harbor.solution_env), timeout=timeout,
                             max_output=256 << 10)
    termination = (TerminationReason.DEADLINE if run.timed_out else
                   TerminationReason.SUBMITTED if run.exit_code == 0 else TerminationReason.ERROR)
    return RunOutcome([], termination, {"agent": "oracle", "oracle_exit": str(run.exit_code),
                                        "oracle_log": run.output[-_LOG_TAIL:]})


def _job_dirs(harbor: HarborTask | None, oracle: bool = False) -> tuple[dict[str, Path], int]:
    """Host folders bound into the job's sandbox: the verifier's output and the tests (empty
    until EVAL), for the oracle the task's ``solution/`` (a multi-step task's: each step's, in
    turn), for a multi-step task its steps' ``workdir/`` in turn; with the fd of the lock
    their root holds for the job's life, so that a crashed server's are swept by the next
    start-up (``reap_stale``) and a live one's are not."""
    root, lock = owned_tempdir("rollout-harbor-")
    try:
        os.chmod(root, 0o711)
        dirs = {"root": root}
        names = ["verifier", "tests"]
        if harbor is not None and harbor.verifier_environments:
            names.append("artifacts")
        if harbor is not None and harbor.steps:
            names += ["step", "solution"] if oracle else ["step"]
        for name in names:
            (root / name).mkdir(mode=0o755)
            dirs[name] = root / name
        if harbor is not None and not harbor.steps and oracle and harbor.has_solution:
            dirs["solution"] = root / "solution"
            shutil.copytree(harbor.path / taskdir.SOLUTION, dirs["solution"], symlinks=True)
            os.chmod(dirs["solution"], 0o755)
    except BaseException:
        hostfs.rmtree(root)
        os.close(lock)
        raise
    return dirs, lock


def _empty(path: Path) -> None:
    """Remove everything in ``path`` (links themselves, never their targets) and leave it an
    empty folder (the server's, until :meth:`~rollout.runtime.sandbox.base.Sandbox.hand_over`
    gives it to the verifier's user)."""
    hostfs.rmtree(path)
    path.mkdir(mode=0o755)


def _fill(folder: Path, source: Path | None) -> None:
    """``folder`` emptied, then holding a copy of ``source`` (None: left empty), readable by
    every uid (it is bound read-only into the sandbox)."""
    _empty(folder)
    if source is not None and source.is_dir() and not source.is_symlink():
        hostfs.copy_tree(source, folder, max_bytes=taskdir.MAX_FOLDER_BYTES)
        _readable(folder)


def _refill(dirs: Mapping[str, Path], harbor: HarborTask, step: HarborStep | None) -> None:
    """The verifier's folder emptied; the tests' holding the task's ``tests/`` and, for a
    step, the step's ``tests/`` over them (its files win; folders in both are merged)."""
    _empty(dirs["verifier"])
    _empty(dirs["tests"])
    shared = harbor.path / taskdir.TESTS
    if step is not None and step.has_tests:
        hostfs.copy_tree(harbor.path / taskdir.STEPS / step.name / taskdir.TESTS, dirs["tests"],
                         max_bytes=taskdir.MAX_FOLDER_BYTES)
        if shared.is_dir() and not shared.is_symlink():
            _merge_under(shared, dirs["tests"])
    elif shared.is_dir() and not shared.is_symlink():
        hostfs.copy_tree(shared, dirs["tests"], max_bytes=taskdir.MAX_FOLDER_BYTES)
    script = dirs["tests"] / "test.sh"
    with contextlib.suppress(OSError):
        os.chmod(script, 0o755)


def _merge_under(source: Path, target: Path) -> None:
    """Copy into ``target`` what ``source`` has and ``target`` lacks; a folder both have is
    merged the same way (``target``'s entries win)."""
    present = frozenset(os.listdir(target))
    hostfs.copy_tree(source, target, skip=present, max_bytes=taskdir.MAX_FOLDER_BYTES)
    for name in present:
        below, into = source / name, target / name
        if below.is_dir() and not below.is_symlink() and into.is_dir() and not into.is_symlink():
            _merge_under(below, into)


def _reward_files(folder: Path) -> dict[str, bytes | None]:
    """The reward files the verifier left, read on the host without following links; one
    too large reads as its first bytes (and then fails to parse), a FIFO or other special
    file as absent."""
    files: dict[str, bytes | None] = {}
    for name in (verdict.REWARD_JSON, verdict.REWARD_TXT):
        try:
            files[name] = hostfs.read_beneath(folder, name, verdict.MAX_REWARD_FILE)
        except hostfs.FileTooLarge:
            files[name] = b"<over the size limit>"
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError):
            files[name] = None
    return files

