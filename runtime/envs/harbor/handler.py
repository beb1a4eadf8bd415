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
docs/harbor.md).

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
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollout.runtime.agent_loop import DEADLINE_MARGIN_S, run_agent_loop
from rollout.runtime.envs.common import (
    SANDBOX_KEY,
    check_task_object,
    host_path,
    invalid,
    optional_choice,
    sandbox_of,
    sandbox_tools,
)
from rollout.runtime.envs.grading.isolated import end_agent
from rollout.runtime.envs.harbor import taskdir, verdict
from rollout.runtime.envs.harbor.taskdir import HarborTask, TaskFolderError
from rollout.runtime.handler import AgentHandler, HandlerError, JobContext, RunOutcome
from rollout.runtime.sandbox import hostfs
from rollout.runtime.sandbox.base import SandboxLimits
from rollout.runtime.sandbox.images.user import UserRequest
from rollout.runtime.sandbox.reaper import owned_tempdir
from rollout.runtime.tools.submit import SubmitTool
from rollout.runtime.types import Reward, TerminationReason

ENV = "harbor"
AGENTS = ("model", "oracle", "noop")
VERIFIER_DIR = "/logs/verifier"
TESTS_DIR = "/tests"
SOLUTION_DIR = "/solution"
TASK_KEY = "harbor.task"
DIRS_KEY = "harbor.dirs"
WORKDIR_KEY = "harbor.workdir"
VERIFIER_USER_KEY = "harbor.verifier_user"
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
        dirs, lock = await asyncio.to_thread(
            _job_dirs, harbor if task.get("agent", "model") == "oracle" else None)
        ctx.resources.callback(os.close, lock)
        ctx.resources.callback(hostfs.rmtree, dirs["root"])
        ctx.state[DIRS_KEY] = {k: str(v) for k, v in dirs.items()}
        binds = [(str(dirs["verifier"]), VERIFIER_DIR, True), (str(dirs["tests"]), TESTS_DIR, True)]
        if "solution" in dirs:
            binds.append((str(dirs["solution"]), SOLUTION_DIR, False))
        # [agent].user: every process of the agent (and the oracle) runs as that user of
        # the image, as Harbor's exec does; unset, the image's USER.
        user = ({"user": UserRequest(harbor.agent_user, named_by="task.toml [agent].user")}
                if harbor.agent_user is not None else {})
        sandbox = await ctx.open_sandbox(image=image_source(harbor), binds=binds,
                                         env=dict(harbor.environment_env), network="none",
                                         limits=sandbox_limits(harbor), **user)
        ctx.state[SANDBOX_KEY] = sandbox
        if harbor.verifier_user is not None or harbor.agent_user is not None:
            # Resolved now, in the image as built (a passwd the agent edits cannot move the
            # verifier), so a user the image lacks fails INIT, before any agent ran. Unset,
            # it is the image's USER, which a sandbox made for [agent].user does not run as.
            user_for = getattr(sandbox, "user_for", None)
            if user_for is None:
                raise HandlerError(f"the Harbor task {harbor.name} sets a user in task.toml, "
                                   "which this server's sandbox runtime cannot apply (the "
                                   "bwrap runtime does)", "INVALID_TASK")
            ctx.state[VERIFIER_USER_KEY] = await asyncio.to_thread(
                user_for, harbor.verifier_user, named_by="task.toml [verifier].user")
        # Writable by the agent's user (a root server's sandbox uid; the image's uid in a
        # rootless server's mapped namespace).
        await asyncio.to_thread(sandbox.hand_over, [dirs["verifier"], dirs["tests"]])
        # The image's WorkingDir (Harbor's tasks rely on their Dockerfile's WORKDIR).
        ctx.state[WORKDIR_KEY] = harbor.workdir or getattr(sandbox, "default_cwd",
                                                           sandbox.workspace_in_sandbox)
        ctx.progress("environment", {"task": harbor.name, "image": harbor.image_source})

    async def run(self, ctx: JobContext) -> RunOutcome:
        sandbox = sandbox_of(ctx)
        harbor = task_of(ctx)
        agent = ctx.spec.task.get("agent", "model")
        workdir = ctx.state.get(WORKDIR_KEY, sandbox.workspace_in_sandbox)
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
        sandbox = sandbox_of(ctx)
        harbor = task_of(ctx)
        dirs = {k: Path(v) for k, v in ctx.state[DIRS_KEY].items()}
        # Nothing of the agent runs from here on; what it left in the verifier's and the
        # tests' folders goes, and the tests arrive only now.
        await end_agent(ctx)
        shared = [dirs["verifier"], dirs["tests"]]
        await asyncio.to_thread(sandbox.take_back, shared)
        await asyncio.to_thread(_refill, dirs, harbor)
        # The verifier's user writes its reward file and may write beside its tests.
        await asyncio.to_thread(sandbox.hand_over, shared, ctx.state.get(VERIFIER_USER_KEY))
        timeout = max(1.0, min(harbor.verifier_timeout_s, ctx.spec.limits.eval_timeout_s - 5.0))
        env = {**harbor.verifier_env, "TEST_DIR": TESTS_DIR}
        as_user = ({"user": ctx.state[VERIFIER_USER_KEY]}
                   if VERIFIER_USER_KEY in ctx.state else {})
        run = await sandbox.exec([f"{TESTS_DIR}/test.sh"], timeout=timeout,
                                 cwd=ctx.state.get(WORKDIR_KEY), env=env, max_output=1 << 20,
                                 **as_user)
        # Whatever the verifier left running must not touch the reward after this point.
        await sandbox.stop_processes()
        # Readable on the host whatever mode the verifier gave its files.
        await asyncio.to_thread(sandbox.take_back, shared)
        files = await asyncio.to_thread(_reward_files, dirs["verifier"])
        found = verdict.read(files)
        info = {"task": harbor.name, "verifier_exit": str(run.exit_code),
                "reward_file": found.source, "log": run.output[-_LOG_TAIL:]}
        if run.timed_out:
            info["error"] = f"the verifier (tests/test.sh) ran past its {timeout:g} s timeout"
            return Reward(0.0, {}, info)
        if found.problem:
            info["error"] = found.problem
        return Reward(found.value, found.components, info)

    async def cleanup(self, ctx: JobContext) -> None:
        ctx.state.pop(SANDBOX_KEY, None)


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
    base = SandboxLimits()
    longest = max(harbor.agent_timeout_s, harbor.verifier_timeout_s)
    return SandboxLimits(
        cpu_seconds=max(60, math.ceil(longest * harbor.cpus) + 60),
        address_space_bytes=max(1 << 30, harbor.memory_mb << 20),
        processes=base.processes, open_files=base.open_files,
        file_size_bytes=max(16 << 20, harbor.storage_mb << 20),
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


def _job_dirs(oracle: HarborTask | None) -> tuple[dict[str, Path], int]:
    """Host folders bound into the job's sandbox: the verifier's output and the tests (empty
    until EVAL), and for the oracle a copy of the task's ``solution/``; with the fd of the lock
    their root holds for the job's life, so that a crashed server's are swept by the next
    start-up (``reap_stale``) and a live one's are not."""
    root, lock = owned_tempdir("rollout-harbor-")
    try:
        os.chmod(root, 0o711)
        dirs = {"root": root}
        for name in ("verifier", "tests"):
            (root / name).mkdir(mode=0o755)
            dirs[name] = root / name
        if oracle is not None and oracle.has_solution:
            dirs["solution"] = root / "solution"
            shutil.copytree(oracle.path / taskdir.SOLUTION, dirs["solution"], symlinks=True)
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


def _refill(dirs: Mapping[str, Path], harbor: HarborTask) -> None:
    _empty(dirs["verifier"])
    _empty(dirs["tests"])
    hostfs.copy_tree(harbor.path / taskdir.TESTS, dirs["tests"],
                     max_bytes=taskdir.MAX_FOLDER_BYTES)
    script = dirs["tests"] / "test.sh"
    with contextlib.suppress(OSError):
        os.chmod(script, 0o755)


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

