"""The ``harness`` environment: an unmodified agent harness (mini-swe-agent, Codex CLI, your own)
works on an inner environment's task in the job's sandbox, and its model calls are the job's
trajectory.

Task format::

    {
      "environment": "swe",            # the inner environment: swe, code, math or harbor
      "task": {...},                   # its task, exactly as that environment takes it
      "harness": "mini-swe-agent",     # a preset (runtime/envs/harness/presets.py), or
                                       # {"preset": NAME, "env": {...}}, or a command spec
                                       # {"command": [...], "install": DIR, "env": {...},
                                       #  "files": {...}, "port": 4000}
      "model": "policy"                # optional: the model name the harness is told to use
    }

INIT is the inner environment's INIT (the swe checkout, the code or math workspace), with the
harness's install directory bound read-only at :data:`INSTALL_MOUNT` in the job's sandbox.

RUN opens a lease on the server's model gateway (:mod:`rollout.runtime.gateway`): a key for this
job alone and a Unix socket on the host. One launch of the sandbox gets the socket bound at
:data:`GATEWAY_SOCKET` and runs :mod:`harness_launch
<rollout.runtime.envs.in_sandbox.harness_launch>`,
which relays ``127.0.0.1:PORT`` of the launch's own network namespace to that socket and runs
the harness with ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` / ``ANTHROPIC_BASE_URL`` /
``ANTHROPIC_API_KEY`` set, under the RUN deadline. The sandbox has no other network: no host
loopback, no outside address, no host abstract socket (its network namespace is its own).
When the harness ends, or the deadline does, every process of the sandbox is killed, then the
lease is closed (its key refused from then on) and what the gateway captured becomes the
trajectory: the turns with their exact token ids, and the segments where the harness rewrote
its history.

EVAL is the inner environment's grader, unchanged (swe: the hidden tests in a fresh sandbox;
code: the hidden tests; math: the answer the harness wrote to ``answer.txt`` in its working
directory, else the last reply's text).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from rollout.runtime.agent_loop import DEADLINE_MARGIN_S, SEED_KEY, TURNS_KEY
from rollout.runtime.envs.common import (
    IN_SANDBOX,
    SANDBOX_KEY,
    check_task_object,
    invalid,
    sandbox_of,
)
from rollout.runtime.envs.grading.isolated import end_agent
from rollout.runtime.envs.harness import presets as harness_presets
from rollout.runtime.envs.harness.presets import HarnessSpec
from rollout.runtime.gateway import SEGMENTS_KEY, GatewayOptions, HarnessCapture
from rollout.runtime.handler import AgentHandler, HandlerError, JobContext, RunOutcome
from rollout.runtime.sandbox.base import (
    ExecResult,
    SandboxLimits,
    limits_of,
    python_argv,
    runtime_of,
)
from rollout.runtime.sandbox.images.errors import ImageError
from rollout.runtime.types import InvalidArgument, Reward, TerminationReason

ENV = "harness"
INNER = ("swe", "code", "math", "harbor")
INSTALL_MOUNT = "/.rollout-harness"
GATEWAY_SOCKET = "/.rollout-gateway.sock"
LAUNCH_SOURCE = IN_SANDBOX / "harness_launch.py"
PROGRAM_CHECK_SOURCE = IN_SANDBOX / "harness_program.py"
ANSWER_FILE = "answer.txt"
SPEC_KEY = "harness.spec"
LIMITS_KEY = "harness.limits"
"""``ctx.state`` key: the sandbox limits the preset asked for, clamped (None: the defaults)."""
CAPTURE_KEY = "harness.capture"
"""``ctx.state`` key: the gateway's capture of this job (for tests and metadata)."""
_LOG_TAIL = 2000
_MODEL_NAME = r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}"


def inner_handler(name: str) -> AgentHandler:
    """The inner environment's handler (imported on use: a math job never loads swe's)."""
    if name == "swe":
        from rollout.runtime.envs.swe.handler import SweHandler
        return SweHandler()
    if name == "code":
        from rollout.runtime.envs.code.handler import CodeHandler
        return CodeHandler()
    if name == "math":
        from rollout.runtime.envs.math.handler import MathHandler
        return MathHandler()
    if name == "harbor":
        from rollout.runtime.envs.harbor.handler import HarborHandler
        return HarborHandler()
    raise invalid(f"harness task field 'environment' must be one of {list(INNER)}, got "
                  f"{name!r}", "environment")


def inner_context(ctx: JobContext) -> JobContext:
    """The job's context as the inner environment sees it: its own task; the same state,
    resources and outcome (so its stages find what the others left)."""
    task = ctx.spec.task
    spec = dataclasses.replace(ctx.spec, environment=task["environment"], task=task["task"])
    return dataclasses.replace(ctx, spec=spec)


class HarnessHandler(AgentHandler):
    name = ENV

    def validate_task(self, task: Mapping[str, Any]) -> None:
        check_task_object(task, ENV)
        inner = task.get("environment")
        if not isinstance(inner, str):
            raise invalid(f"harness task needs 'environment': one of {list(INNER)}",
                          "environment")
        handler = inner_handler(inner)
        if not isinstance(task.get("task"), Mapping):
            raise invalid(f"harness task needs 'task': the {inner} task object", "task")
        try:
            handler.validate_task(task["task"])
        except InvalidArgument as e:
            # The inner field lives one level down in this payload.
            field = e.field.removeprefix("task").lstrip(".")
            raise InvalidArgument(str(e), e.reason,
                                  "task.task" + (f".{field}" if field else "")) from None
        if "harness" not in task:
            raise invalid("harness task needs 'harness': a preset name ("
                          f"{', '.join(harness_presets.preset_names())}) or a command spec",
                          "harness")
        harness_presets.resolve(task["harness"])
        model = task.get("model", "policy")
        if not isinstance(model, str) or not re.fullmatch(_MODEL_NAME, model):
            raise invalid("harness task field 'model' must be a model name (letters, digits, "
                          "'_.:/-')", "model")
        unknown = sorted(set(task) - {"environment", "task", "harness", "model"})
        if unknown:
            raise invalid(f"harness task has unknown fields {unknown}", "")

    async def init(self, ctx: JobContext) -> None:
        self.validate_task(ctx.spec.task)
        harness = await asyncio.to_thread(harness_presets.resolve, ctx.spec.task["harness"])
        ctx.state[SPEC_KEY] = harness
        factory = ctx.sandbox_factory
        if factory is None:
            raise HandlerError("this server has no sandbox runtime configured", "NO_SANDBOX")
        runtime = runtime_of(factory)
        if runtime not in (None, "bwrap"):
            raise HandlerError(f"the harness environment needs the bwrap sandbox runtime (it "
                               f"binds the job's gateway socket into one launch); this server "
                               f"runs {runtime}", "INVALID_SANDBOX_OPTIONS")
        binds = ([(str(harness.install), INSTALL_MOUNT, False)]
                 if harness.install is not None else [])
        limits = sandbox_limits(harness, factory)
        ctx.state[LIMITS_KEY] = limits

        async def with_harness(**options: Any) -> Any:
            options["binds"] = [*options.get("binds", ()), *binds]
            if limits is not None:
                options["limits"] = limits
            return await factory(**options)

        inner = inner_context(ctx)
        await inner_handler(inner.spec.environment).init(
            dataclasses.replace(inner, sandbox_factory=with_harness))
        if SANDBOX_KEY not in ctx.state:  # math without tools opens none; a harness needs one
            ctx.state[SANDBOX_KEY] = await dataclasses.replace(
                ctx, sandbox_factory=with_harness).open_sandbox()
        await check_program(ctx, harness)

    async def run(self, ctx: JobContext) -> RunOutcome:
        sandbox = sandbox_of(ctx)
        harness: HarnessSpec = ctx.state.get(SPEC_KEY) or harness_presets.resolve(
            ctx.spec.task["harness"])
        gateway = ctx.gateway
        if gateway is None:
            raise HandlerError("this server runs no model gateway, which a harness job needs "
                               "(its harness calls the model over HTTP)", "NO_GATEWAY")
        if ctx.llm is None:
            raise HandlerError("this server has no model backend", "NO_LLM")
        deadline = time.monotonic() + max(0.0, ctx.spec.limits.run_timeout_s
                                          - DEADLINE_MARGIN_S)
        harbor, steps_run = None, 0
        lease = await gateway.open(ctx.spec, ctx.llm,
                                   options=GatewayOptions(side_calls=harness.side_calls))
        result = None
        try:
            # The live capture: a RUN cut by the scheduler still hands over these turns.
            live = gateway.capture(lease)
            ctx.state[TURNS_KEY], ctx.state[SEGMENTS_KEY] = live.turns, live.segments
            # The sandbox's user (a root server's sandbox uid, the image's user in a rootless
            # server's mapped namespace) must be able to connect to the 0600 socket; nobody
            # else on the host gets anything new.
            await asyncio.to_thread(sandbox.hand_over, [lease.socket_path])
            # In an image (a Harbor task, a SWE-bench instance) the agent starts in the task's
            # working directory, else in the workspace.
            workspace = ctx.state.get("harbor.workdir") or getattr(
                sandbox, "default_cwd", sandbox.workspace_in_sandbox)
            ctx.progress("harness", {"harness": harness.name, "port": harness.port})

            launches = [0]

            async def launch(prompt: str | None, until: float) -> Any:
                # A launch's socket bind leaves its mount point in an image's root: a later
                # launch (a multi-step task's next step) binds a name nobody could plant.
                socket = (GATEWAY_SOCKET if not launches[0] else
                          f"/.rollout-gateway-{secrets.token_hex(8)}.sock")
                launches[0] += 1
                spec = launch_spec(ctx, harness, lease.api_key, workspace,
                                   sandbox.env.get("HOME", "/tmp"), prompt=prompt,
                                   socket=socket)
                # In an image root the server's interpreter runs through the host's loader.
                return await sandbox.exec(
                    [*python_argv(sandbox), "-c", LAUNCH_SOURCE.read_text()],
                    stdin=json.dumps(spec).encode(), cwd=workspace,
                    timeout=max(1.0, until - time.monotonic()), max_output=256 << 10,
                    file_binds=[(lease.socket_path, socket)])

            harbor = _harbor_with_steps(ctx)
            if harbor is None:
                result = await launch(None, deadline)
            else:
                result, steps_run = await _run_harbor_steps(ctx, harbor, workspace, launch,
                                                            deadline)
        finally:
            # Every process of the harness dies before the key is revoked, so none of them
            # sees a refusal and acts on it (and none outlives RUN into EVAL).
            try:
                await end_agent(ctx)
            finally:
                capture = await gateway.close(lease)
        ctx.state[CAPTURE_KEY] = capture
        ctx.state[TURNS_KEY], ctx.state[SEGMENTS_KEY] = capture.turns, capture.segments
        if capture.seed is not None:
            ctx.state[SEED_KEY] = capture.seed
        metadata = {"harness": harness.name, "harness_requests": str(capture.requests),
                    **({"steps_run": str(steps_run)} if harbor is not None else {}),
                    "harness_segments": str(len(capture.segments)),
                    "harness_exit": str(result.exit_code),
                    **limits_metadata(ctx.state.get(LIMITS_KEY)),
                    "harness_log": result.output[-_LOG_TAIL:]}
        if capture.turns:
            metadata["final_text"] = await asyncio.to_thread(
                _decode, ctx.llm.tokenizer, capture.turns[-1].output_ids)
        ended = termination(result, capture, ctx.spec.limits.max_turns)
        await self._collect_answer(ctx)
        return RunOutcome(list(capture.turns), ended, metadata, segments=list(capture.segments))

    async def _collect_answer(self, ctx: JobContext) -> None:
        """math: the answer the harness wrote to ``answer.txt`` counts as submitted."""
        if ctx.spec.task["environment"] != "math":
            return
        from rollout.runtime.tools.submit import SUBMITTED_ANSWER_KEY

        try:
            raw = await sandbox_of(ctx).get_file(ANSWER_FILE)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, OSError):
            return
        answer = raw[:4096].decode("utf-8", "replace").strip()
        if answer:
            ctx.state[SUBMITTED_ANSWER_KEY] = answer

    async def eval(self, ctx: JobContext) -> Reward:
        inner = inner_context(ctx)
        reward = await inner_handler(inner.spec.environment).eval(inner)
        capture = ctx.state.get(CAPTURE_KEY)
        if capture is not None:
            reward.info.setdefault("harness_requests", str(capture.requests))
        return reward

    async def cleanup(self, ctx: JobContext) -> None:
        inner = inner_context(ctx)
        await inner_handler(inner.spec.environment).cleanup(inner)
        ctx.state.pop(SANDBOX_KEY, None)


async def check_program(ctx: JobContext, harness: HarnessSpec) -> None:
    """In a task's image: refuse at INIT, naming the task and the image, a harness whose
    program cannot start in that root because the image lacks what the kernel needs to load it
    (the dynamic loader it is linked against, glibc's in a busybox or musl image; the
    interpreter of its ``#!`` line). Started anyway it would exit 127 before its first request,
    which reads as the service's failure (``HARNESS_NOT_STARTED``) when it is the task's choice
    of image. A harness that brings its own runtime under :data:`INSTALL_MOUNT` passes; the
    host's view (no image) has the host's libraries and is not checked."""
    sandbox = sandbox_of(ctx)
    image = getattr(sandbox, "image", None)
    if image is None or not harness.command:
        return
    # The whole command: the script finds its program past ``env``/``exec`` prefixes and
    # looks a bare name up on the sandbox's PATH.
    words = [w.replace("{install}", INSTALL_MOUNT) for w in harness.command]
    result = await sandbox.exec(
        [*python_argv(sandbox), "-c", PROGRAM_CHECK_SOURCE.read_text(), *words], timeout=60,
        max_output=8192)
    try:
        verdict = json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError, RecursionError):
        return  # the check itself could not run: RUN's own start says what is wrong
    missing, needed_by = verdict.get("missing"), verdict.get("needed_by")
    if not missing or needed_by == "the harness command":
        return  # a missing program is the install's (HARNESS_NOT_STARTED at RUN)
    ref = str(getattr(getattr(image, "image", None), "ref", "") or "the task's image")
    # The pipeline names the task in front of an ImageError's message.
    raise ImageError(
        f"harness {harness.name!r} cannot start "
        f"in image {ref}: its program {needed_by} needs {missing}, which the image does not "
        "have (an image without glibc, such as busybox or a musl one?). Use a harness that "
        "brings its own runtime (docs/bring-your-own-agent.md) or an image that has it.",
        "IMAGE_REJECTED", ref=ref)


def _harbor_with_steps(ctx: JobContext) -> Any:
    """The job's Harbor task when it is a multi-step one (else None)."""
    if ctx.spec.task["environment"] != "harbor":
        return None
    from rollout.runtime.envs.harbor.handler import task_of

    harbor = task_of(inner_context(ctx))
    return harbor if harbor.steps else None


async def _run_harbor_steps(ctx: JobContext, harbor: Any, workspace: str,
                            launch: Callable[[str | None, float], Awaitable[Any]],
                            deadline: float) -> tuple[Any, int]:
    """A multi-step Harbor task under a harness: the harness is started once per step with
    the step's instruction, in the one gateway lease (each step's conversation becomes its
    own chain there), the harbor environment's step driver around it (set-up, verifier,
    ``min_reward``). Returns the last launch's result and how many steps ran."""
    from rollout.runtime.envs.harbor.handler import run_steps

    results: list[Any] = []

    async def agent_step(step: Any, step_deadline: float) -> None:
        results.append(await launch(step.instruction, min(step_deadline, deadline)))

    ran = await run_steps(inner_context(ctx), harbor, workspace, agent_step)
    if not results:  # the first step's set-up failed: no harness ran, and it is no failure
        return ExecResult(0, "", "no step's agent ran (see the reward's info)"), ran
    return results[-1], ran


def task_prompt(ctx: JobContext, workspace: str) -> str:
    """The task in the inner environment's words, for a harness that brings its own system
    prompt and tools (so none of the built-in loop's tool instructions)."""
    task = ctx.spec.task["task"]
    inner = ctx.spec.task["environment"]
    if inner == "swe":
        return str(task["problem_statement"])
    if inner == "code":
        from rollout.runtime.envs.code.handler import task_prompt as code_prompt
        return code_prompt(task, workspace)
    if inner == "harbor":
        from rollout.runtime.envs.harbor.handler import load_task
        return load_task(task).instruction
    return (f"{task['question']}\n\nWhen you have the final answer, write it (the answer "
            f"alone) to the file {workspace.rstrip('/')}/{ANSWER_FILE}.")


def launch_spec(ctx: JobContext, harness: HarnessSpec, api_key: str, workspace: str,
                home: str, *, prompt: str | None = None,
                socket: str = GATEWAY_SOCKET) -> dict[str, Any]:
    """What :mod:`harness_launch` reads on stdin: placeholders filled in (``prompt``: the
    task's own unless given, as a multi-step task's step gives its instruction)."""
    origin = f"http://127.0.0.1:{harness.port}"
    prompt = task_prompt(ctx, workspace) if prompt is None else prompt
    prompt_file = "/tmp/.rollout-harness-prompt.txt"
    values = {"install": INSTALL_MOUNT, "base_url": f"{origin}/v1", "origin": origin,
              "api_key": api_key, "model": str(ctx.spec.task.get("model", "policy")),
              "prompt": prompt, "prompt_file": prompt_file, "workspace": workspace,
              "home": home, "max_steps": str(ctx.spec.limits.max_turns),
              "max_tokens": str(ctx.spec.sampling.max_tokens_per_turn)}
    env = {"OPENAI_BASE_URL": values["base_url"], "OPENAI_API_BASE": values["base_url"],
           "OPENAI_API_KEY": api_key, "ANTHROPIC_BASE_URL": origin,
           "ANTHROPIC_API_KEY": api_key, "NO_PROXY": "127.0.0.1,localhost",
           "no_proxy": "127.0.0.1,localhost"}
    env.update({k: harness_presets.render(v, values) for k, v in harness.env.items()})
    files = {prompt_file: prompt}
    files.update({harness_presets.render(p, values): harness_presets.render(t, values)
                  for p, t in harness.files.items()})
    return {"socket": socket, "port": harness.port, "cwd": workspace, "env": env,
            "files": files,
            "argv": [harness_presets.render(a, values) for a in harness.command]}


def sandbox_limits(harness: HarnessSpec, factory: Any) -> SandboxLimits | None:
    """The sandbox limits the harness's preset asks for, each clamped to the server's ceiling
    (a preset written for a bigger server still runs); None when it asks for none."""
    if not harness.limits:
        return None
    defaults, ceilings = limits_of(factory)
    return dataclasses.replace(defaults, **{
        name: min(value, getattr(ceilings, name)) for name, value in harness.limits.items()})


def limits_metadata(limits: SandboxLimits | None) -> dict[str, str]:
    if limits is None:
        return {}
    return {"harness_limits": f"address_space_bytes={limits.address_space_bytes} "
                              f"processes={limits.processes} open_files={limits.open_files}"}


def termination(result: Any, capture: HarnessCapture, max_steps: int) -> TerminationReason:
    """Why the harness stopped, as far as the outside can tell. Whatever it is, the workspace
    is graded (docs/failures.md): the deadline, its step limit (as many requests as
    ``limits.max_turns``, or the gateway refused one more), the job's token budget or the
    model's context (the gateway refused the prompt), a clean exit (it finished), or another
    exit (:attr:`TerminationReason.HARNESS_ERROR`).

    Only a harness that exits non-zero before its first model request is the service's
    failure (a missing install, a broken preset, a launcher that cannot run it): nothing the
    policy produced can have caused it, so :class:`HandlerError` ``HARNESS_NOT_STARTED``.
    """
    if result is None or result.timed_out:
        return TerminationReason.DEADLINE
    if result.exit_code != 0 and capture.requests == 0 and not capture.refused:
        raise HandlerError(f"the harness exited with status {result.exit_code} before its "
                           "first model request (is it installed, is its preset right?): "
                           f"{result.output[-_LOG_TAIL:]}", "HARNESS_NOT_STARTED")
    if capture.refused == "max_turns" or capture.requests >= max_steps:
        return TerminationReason.MAX_TURNS
    if result.exit_code == 0:
        return TerminationReason.SUBMITTED
    if capture.refused == "token_budget":
        return TerminationReason.TOKEN_BUDGET
    if capture.refused == "context_length":
        return TerminationReason.CONTEXT_LENGTH
    return TerminationReason.HARNESS_ERROR


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=True))
