"""The ``swe`` environment: fix a bug in a repository, judged by hidden tests (SWE-bench style).

Task format: a SWE-bench instance plus where to find the repository without network::

    {
      "instance_id": "rollout__semver-1",
      "repo": "rollout-service/semver",          # informational
      "repo_source": "swe_repos/semver.bundle",  # git bundle, git directory, or .tar[.gz]
                                                 # archive of a clone (with its .git);
                                                 # relative = under runtime/envs/data
      "base_commit": "060baae...",               # the commit the agent starts from
      "problem_statement": "...",                # what the agent sees
      "patch": "diff --git ...",                 # gold fix (optional; never shown; for tests)
      "test_patch": "diff --git ...",            # hidden tests, applied only in EVAL
      "FAIL_TO_PASS": ["tests/test_v.py::test_x"],   # list, or a JSON string of one
      "PASS_TO_PASS": ["tests/test_v.py::test_y"],
      "test_env": {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},   # optional, for the test run
      "test_timeout_s": 300,                     # optional
      "test_runner": "pytest",                   # optional: or django, sympy, unittest
      "pytest_plugins": ["xdist"],               # optional: -p NAME for each
      "pytest_plugin_autoload": false,           # optional: entry-point plugins (default off)
      "version": "0.3",                          # with "spec": the task's own environment,
      "spec": {"pip_packages": ["pytest==8.3.5"], "install": "..."}   # see runtime.envs.swe.taskenv
    }                                            # (or "spec": {"image": "docker://..."} under
                                                 # Apptainer: one image per instance)

INIT builds or reuses the task's environment (when it has a ``spec``), copies the source into
the sandbox, checks out ``base_commit`` as branch ``main`` in the workspace and then deletes
every other ref and prunes unreachable objects, so the agent cannot read the fix from later
history. The agent gets bash, the editor and submit; the end of RUN kills every process it
started. The test patch stays on the host until EVAL, which grades where the agent cannot reach
(:mod:`rollout.runtime.envs.grading.isolated`): a fresh sandbox (its own uid when the server is
root) gets a copy of the agent's tree over a fresh ``.git`` at ``base_commit``; every file a
test runner loads by configuration, the test directories of the named tests and of the test
patch, the runner's own files and the test machinery they import are put back to
``base_commit``, the agent's changed files are screened for code that reaches into the test
framework or the grader, then the test patch applied, with honeypot tests planted in it
(:mod:`rollout.runtime.envs.in_sandbox.swe_grade_tree`, :mod:`...grading.honeypots`). Every
runner starts with the repository off ``sys.path`` until its fingerprints are taken, and a
module the agent added that shadows a standard-library or runner module refuses the run
(``runner_start.py``). pytest runs only the named tests (their node ids), with plugin
autoload off; their outcomes come from a report file
(:mod:`rollout.runtime.envs.in_sandbox.pytest_report_plugin`) read after every process of the
run is dead, never from stdout, and the plugin checks the runner's own functions while the
tests run. Django's ``tests/runtests.py``, SymPy's ``bin/test`` and plain ``unittest``
start through a recorder of unittest's results, their logs only a cross-check
(:mod:`rollout.runtime.envs.swe.runners`). One :class:`GradeReport` holds what the run left and
:func:`verdict` decides. Reward 1 iff every FAIL_TO_PASS and every PASS_TO_PASS test PASSED (an
expected failure or a skip does not) and no check found tampering;
docs/grading.md lists the checks and what they cannot stop. """

from __future__ import annotations

import asyncio
import functools
import json
import posixpath
import re
import secrets
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.runtime.agent_loop import run_agent_loop
from rollout.runtime.envs.common import (
    IN_SANDBOX,
    SANDBOX_KEY,
    check_task_object,
    host_path,
    invalid,
    optional_number,
    require_str,
    sandbox_of,
    sandbox_tools,
    string_env,
    write_private,
)
from rollout.runtime.envs.grading.honeypots import Planted, plant
from rollout.runtime.envs.grading.isolated import end_agent, open_grader
from rollout.runtime.envs.grading.pytest_log import files_of, outcome_of, parse_plugin_report
from rollout.runtime.envs.grading.verdict import GradeReport, Honeypots, Verdict, verdict
from rollout.runtime.envs.swe import images as swe_images
from rollout.runtime.envs.swe import runners as swe_runners
from rollout.runtime.envs.swe.repo_cut import cut_at_base
from rollout.runtime.envs.swe.runners import Runner, runner_outcome
from rollout.runtime.envs.swe.taskenv import EnvSpec, ensure_env, image_options, sandbox_options
from rollout.runtime.handler import AgentHandler, HandlerError, JobContext, RunOutcome
from rollout.runtime.sandbox.base import runtime_of
from rollout.runtime.sandbox.images import is_image_ref
from rollout.runtime.tools.submit import SubmitTool
from rollout.runtime.types import Reward

ENV = "swe"
_ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")

INSTRUCTIONS = (
    "You are an expert software engineer working in a Linux sandbox. The repository is checked "
    "out in the current directory ({workspace}). Fix the issue described by the user by editing "
    "the source code with the tools; you may run the existing tests with "
    "`python -m pytest`. Do not edit the tests to make them pass. When the fix is complete, call "
    "`submit` (its answer is a one-line summary of the change).")

_CHECKOUT = r"""
set -euo pipefail
src=$1 kind=$2 base=$3
if [ "$kind" = archive ]; then
  tar -xf "$src" -C .
  if [ ! -e .git ]; then  # "name/.git": one top-level folder, as GitHub tarballs have
    set -- */.git
    if [ $# -eq 1 ] && [ -e "$1" ]; then
      top=${1%/.git}; shopt -s dotglob; mv -- "$top"/* .; rmdir -- "$top"
    fi
  fi
  [ -e .git ] || { echo "the archive holds no git repository (.git)" >&2; exit 3; }
else
  git init -q -b main
  git fetch -q "$src" '+refs/*:refs/rollout-src/*'
fi
git -c advice.detachedHead=false checkout -q --force -B main "$base"
git for-each-ref --format='%(refname)' | grep -v '^refs/heads/main$' \
  | while read -r ref; do git update-ref -d "$ref"; done
git reflog expire --expire=now --all
git gc -q --prune=now
git config user.name agent && git config user.email agent@localhost
# The source came through the EVAL-only directory: remove that directory whole, not just the
# file, so RUN never sees it (a background process can wait for it to mean "EVAL started").
rm -rf -- "$(dirname -- "$src")"
git rev-parse HEAD
"""

GRADE_TREE_SOURCE = IN_SANDBOX / "swe_grade_tree.py"
REPORT_PLUGIN_SOURCE = IN_SANDBOX / "pytest_report_plugin.py"
REPORT_PLUGIN = "rollout_pytest_report"
_PATCH_FAILED = 97
LAUNCH_SOURCE = IN_SANDBOX / "pytest_launch.py"
OPTIONS_KEY = "swe.sandbox_options"
"""``ctx.state`` key: the sandbox options INIT used (the task environment's binds), which the
grading sandbox needs as well."""
_MAX_REPORT = 8 << 20
_IMPORT_ERROR = re.compile(r"(?:ModuleNotFoundError|ImportError): [^\n]{1,300}")
_TEST_DIR = re.compile(r"tests?|testing|tests?_\w+|\w+_tests?")


@dataclass(frozen=True)
class TestRun:
    """What one run of the tests left, for the :class:`GradeReport`."""

    outcomes: Mapping[str, str]
    exit_status: int | None
    runner_status: int | None
    completed: bool
    timed_out: bool
    problems: tuple[str, ...]
    info: Mapping[str, str]
    docs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """First docstring line -> tests it describes (unittest-style runners)."""
    refused: tuple[str, ...] = ()
    """Why the runner's start refused to run the tests (``shadowed_module: NAME (PATH)``)."""


def _status(run: Any) -> int | None:
    return None if run.timed_out else int(run.exit_code)


def reward_of(decided: Verdict, info: Mapping[str, str]) -> Reward:
    """The reward and its ``info`` for a verdict (``info``: what the grader found on the
    way)."""
    out = dict(info)
    out["failing"] = ",".join(decided.failing)[:1000]
    if decided.reasons:
        out["error"] = "; ".join(decided.reasons)
    if decided.void:
        out["screen"] = (f"{decided.void}; {out['screen']}" if out.get("screen")
                         else decided.void)
        out["honeypots"] = "; ".join(decided.caught)[:1000]
    return Reward(decided.reward, {"fail_to_pass": decided.fail_to_pass,
                                   "pass_to_pass": decided.pass_to_pass}, out)


class SweHandler(AgentHandler):
    name = ENV

    def __init__(self, *, honeypots: bool = True) -> None:
        self.honeypots = honeypots
        """Plant honeypot tests at every evaluation (:mod:`...grading.honeypots`); off only
        for measuring what they cost and for the controls of the tests."""

    def validate_task(self, task: Mapping[str, Any]) -> None:
        check_task_object(task, ENV)
        if swe_images.is_image_instance(task):  # the repository is the image's /testbed
            swe_images.validate(task)
            return
        for name in ("instance_id", "problem_statement", "test_patch"):
            require_str(task, name, env=ENV)
        base = require_str(task, "base_commit", env=ENV)
        if not re.fullmatch(r"[0-9a-f]{7,64}", base):
            raise invalid(f"swe task field 'base_commit' must be a hex commit id, got {base!r}",
                          "base_commit")
        if "repo_source" not in task:
            raise invalid(swe_images.no_repository(task), "repo_source")
        source = resolve_source(require_str(task, "repo_source", env=ENV))
        if not source.exists():
            raise invalid(f"swe task 'repo_source' {source} does not exist on the server",
                          "repo_source")
        if source.is_file() and not (source.suffix == ".bundle"
                                     or source.name.endswith(_ARCHIVE_SUFFIXES)):
            raise invalid("swe task 'repo_source' must be a git bundle (.bundle), a git "
                          f"directory or a .tar/.tar.gz archive, got {source.name!r}",
                          "repo_source")
        if not named_tests(task, "FAIL_TO_PASS"):
            raise invalid("swe task needs at least one FAIL_TO_PASS test", "FAIL_TO_PASS")
        named_tests(task, "PASS_TO_PASS")
        string_env(task, "test_env", env=ENV)
        optional_number(task, "test_timeout_s", 300.0, env=ENV)
        EnvSpec.of(task)
        plugins = task.get("pytest_plugins", [])
        if not isinstance(plugins, list) or not all(
                isinstance(p, str) and re.fullmatch(r"[A-Za-z_][\w.]*", p) for p in plugins):
            raise invalid("swe task field 'pytest_plugins' must be a list of plugin module "
                          "names (passed to pytest as -p NAME)", "pytest_plugins")
        if not isinstance(task.get("pytest_plugin_autoload", False), bool):
            raise invalid("swe task field 'pytest_plugin_autoload' must be true or false",
                          "pytest_plugin_autoload")
        try:
            task_runner(task)
        except ValueError as e:
            raise invalid(str(e), "test_runner") from None
        if "patch" in task and not isinstance(task["patch"], str):
            raise invalid("swe task field 'patch' must be a string", "patch")

    async def init(self, ctx: JobContext) -> None:
        task = ctx.spec.task
        self.validate_task(task)
        if swe_images.is_image_instance(task):
            await swe_images.init(ctx)
            return
        timeout = ctx.spec.limits.init_timeout_s
        kind, data = await cut_at_base(
            *await asyncio.to_thread(read_source, resolve_source(task["repo_source"])),
            task["base_commit"], ctx.sandbox_factory, timeout=timeout)

        async def checkout(sandbox: Any) -> None:
            await check_out(sandbox, task, kind, data, timeout)

        options: dict[str, Any] = {}
        spec = EnvSpec.of(task)
        factory = ctx.sandbox_factory
        if spec is not None and factory is None:
            raise HandlerError("this server has no sandbox runtime configured", "NO_SANDBOX")
        if spec is not None and spec.image:
            # The image carries the environment: no venv; sandbox and grader both start it.
            runtime = runtime_of(factory)
            if runtime not in (None, "apptainer") and not is_image_ref(spec.image):
                raise HandlerError(f"the task's image {spec.image} needs the apptainer sandbox "
                                   f"runtime; this server runs {runtime}",
                                   "INVALID_SANDBOX_OPTIONS")
            options = await asyncio.to_thread(image_options, spec, runtime)
            ctx.progress("environment", {"image": spec.image, "start": options["image"]})
        elif spec is not None and factory is not None:
            env_dir, built = await ensure_env(spec, factory, checkout, timeout=timeout)
            options = sandbox_options(env_dir)
            ctx.progress("environment", {"key": spec.key, "built": built})
        ctx.state[OPTIONS_KEY] = options
        sandbox = await ctx.open_sandbox(**options)
        ctx.state[SANDBOX_KEY] = sandbox
        await checkout(sandbox)

    async def run(self, ctx: JobContext) -> RunOutcome:
        sandbox = sandbox_of(ctx)
        tools = [*sandbox_tools(sandbox, ["bash", "editor"], ctx),
                 SubmitTool(ctx.state, answer_description="A one-line summary of your fix.")]
        messages = [
            {"role": "system",
             "content": INSTRUCTIONS.format(workspace=swe_images.TESTBED
                                            if swe_images.is_image_instance(ctx.spec.task)
                                            else sandbox.workspace_in_sandbox)},
            {"role": "user", "content": ctx.spec.task["problem_statement"]}]
        outcome = await run_agent_loop(ctx, tools, messages)
        await end_agent(ctx)
        return outcome

    async def eval(self, ctx: JobContext) -> Reward:
        task = ctx.spec.task
        if swe_images.is_image_instance(task):
            return await swe_images.evaluate(ctx)
        f2p, p2p = named_tests(task, "FAIL_TO_PASS"), named_tests(task, "PASS_TO_PASS")
        kind, data = await cut_at_base(
            *await asyncio.to_thread(read_source, resolve_source(task["repo_source"])),
            task["base_commit"], ctx.sandbox_factory, timeout=ctx.spec.limits.eval_timeout_s)
        grader = await open_grader(ctx, skip=frozenset({".git"}),
                                   **ctx.state.get(OPTIONS_KEY, {}))
        try:
            return await self._grade(ctx, grader, kind, data, f2p, p2p)
        finally:
            await grader.destroy()

    async def _grade(self, ctx: JobContext, grader: Any, kind: str, data: bytes,
                     f2p: list[str], p2p: list[str]) -> Reward:
        task = ctx.spec.task
        runner = task_runner(task)
        zero = {"fail_to_pass": 0.0, "pass_to_pass": 0.0}
        src = await write_private(grader, "repo-source", data)
        planted = (plant(task["test_patch"], runner.name, f2p + p2p) if self.honeypots
                   else Planted(task["test_patch"], Honeypots(), ()))
        patch = await write_private(grader, "test.patch", planted.patch)
        tree = await write_private(grader, "swe_grade_tree.py", GRADE_TREE_SOURCE.read_bytes())
        # The files the agent added, for the runner's start: only a module the agent added
        # can shadow one of the runner's (a repository may be the runner itself).
        added = posixpath.join(posixpath.dirname(tree), "added.json")
        inserts = []
        if planted.inserts:
            inserts = ["honeypots:" + await write_private(grader, "honeypots.json", json.dumps(
                [i.as_json() for i in planted.inserts]))]
        prepared = await grader.exec(
            [getattr(grader, "python", "python3"), tree, src, kind, task["base_commit"], patch,
             *protected_paths(task, runner, f2p + p2p),
             *(f"imports:{p}" for p in import_roots(task, runner, f2p + p2p)),
             f"added:{added}", *inserts],
            timeout=min(120.0, ctx.spec.limits.eval_timeout_s),
            cwd=grader.workspace_in_sandbox)
        if not prepared.ok:
            why = ("the test patch does not apply" if prepared.exit_code == _PATCH_FAILED
                   else "building the grading tree failed")
            return Reward(0.0, zero, {"error": why, "log": prepared.output[-1000:]})
        tree_report = json.loads(prepared.stdout or "{}")
        planted = planted.without({i.path for i in planted.inserts}
                                  - set(tree_report.get("honeypots_in", [])))
        info = {"restored": ",".join(tree_report.get("restored", []))[:1000],
                "runner": runner.name}
        problems: list[str] = []
        if tree_report.get("screen"):
            problems.append("the change reaches into the test framework or the grader")
            info["screen"] = "; ".join(tree_report["screen"])[:2000]
        timeout = min(float(task.get("test_timeout_s", 300.0)), ctx.spec.limits.eval_timeout_s)
        paths = import_paths(task, tree_report.get("import_paths", []))
        if paths:
            info["import_paths"] = ",".join(paths)
        paths = [posixpath.join(grader.workspace_in_sandbox, p) for p in paths]
        if runner.name == "pytest":
            run = await self._run_pytest(grader, task, [*f2p, *p2p, *planted.run_also],
                                         timeout, paths, added)
        else:
            run = await self._run_logged(grader, task, runner, timeout, paths, added)
        if run.refused:
            problems.append("the repository shadows a module of the test runner or the "
                            "standard library, or ran code before the runner started")
            found = "; ".join(run.refused)
            info["screen"] = f"{info['screen']}; {found}"[:2000] if info.get("screen") \
                else found[:2000]
        info.update(run.info)
        info["honeypots_planted"] = str(len(planted.honeypots.names))
        report = GradeReport(tuple(f2p), tuple(p2p), run.outcomes, run.exit_status,
                             run.runner_status, run.completed, run.timed_out,
                             (*problems, *run.problems), planted.honeypots,
                             lookup=outcome_of if runner.name == "pytest" else functools.partial(
                                 runner_outcome, docs=run.docs))
        return reward_of(verdict(report), info)

    async def _run_pytest(self, grader: Any, task: Mapping[str, Any], named: list[str],
                          timeout: float, paths: list[str],  # noqa: ASYNC109
                          added: str) -> TestRun:
        plugin_dir = posixpath.dirname(await write_private(
            grader, f"plugins/{REPORT_PLUGIN}.py", REPORT_PLUGIN_SOURCE.read_bytes()))
        # A fresh, unguessable path in the grading sandbox's own /tmp: nothing of the agent
        # ever ran there, and the plugin refuses to write over a file that exists.
        report = f"/tmp/.rollout-report-{secrets.token_hex(8)}.json"
        run = await grader.exec(
            [*test_command(task, grader.workspace_in_sandbox), *named],
            timeout=timeout, cwd=grader.workspace_in_sandbox,
            env=test_env(task, plugin_dir, report, paths, grader.workspace_in_sandbox, added),
            max_output=1 << 20)
        # What the tests left running must not touch the report between the run and the read.
        await grader.stop_processes()
        raw = await grader.exec(["head", "-c", str(_MAX_REPORT), "--", report], timeout=30.0,
                                max_output=_MAX_REPORT + 1)
        data = parse_plugin_report(raw.stdout) if raw.ok else None
        info = {"pytest_exit": str(run.exit_code), "exit_status": str(run.exit_code)}
        problems: list[str] = []
        refused = tuple(swe_runners.refusals(run.exit_code, run.output))
        if data is None or refused:
            info["log"] = run.output[-1000:]
            return TestRun({}, _status(run), None, False, run.timed_out, (), info,
                           refused=refused)
        if data.foreign_hooks:
            problems.append("the code under test registered pytest hooks that decide outcomes")
            info["hooks"] = "; ".join(data.foreign_hooks)[:1000]
        if data.tampered:
            problems.append("the code under test replaced the test runner's functions while "
                            "the tests ran")
            info["tampered"] = "; ".join(data.tampered)[:1000]
        if named and all(outcome_of(n, data.outcomes) in ("ERROR", "MISSING") for n in named):
            # Nothing ran: say why when it is an import, never a silent 0.
            missing = _IMPORT_ERROR.search(run.output)
            if missing is not None:
                problems.append(f"the tests could not import their code: {missing.group(0)}")
        return TestRun(data.outcomes, _status(run), data.exitstatus, True, run.timed_out,
                       tuple(problems), info)

    async def _run_logged(self, grader: Any, task: Mapping[str, Any], runner: Runner,
                          timeout: float, paths: list[str],  # noqa: ASYNC109
                          added: str) -> TestRun:
        """A runner that reports only through its log (Django, SymPy, unittest)."""
        spec = EnvSpec.of(task)
        options = spec.test_cmd if spec is not None and spec.test_runner == runner.name \
            else None
        env = string_env(task, "test_env", env=ENV)
        # One stream, unbuffered: the log is read in the order it was written, which decides
        # the outcome of a test whose result runs over several lines.
        env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
        files = patched_files(task["test_patch"])
        set_start_env(env, paths, grader.workspace_in_sandbox, added,
                      trace=[f for f in files if f.endswith(".py")]
                      if runner.name == "sympy" else [])
        argv = swe_runners.command(runner, spec.run_python if spec else "python",
                                   grader.workspace_in_sandbox, options,
                                   swe_runners.directives(runner, files))
        report = f"/tmp/.rollout-report-{secrets.token_hex(8)}.json"
        env[swe_runners.REPORT_VAR] = report
        run = await grader.exec(
            ["bash", "-c", 'exec "$@" 2>&1', "run-tests", *argv],
            timeout=timeout, cwd=grader.workspace_in_sandbox, env=env, max_output=4 << 20)
        await grader.stop_processes()
        raw = await grader.exec(["head", "-c", str(_MAX_REPORT), "--", report], timeout=30.0,
                                max_output=_MAX_REPORT + 1)
        record = swe_runners.parse_record(raw.stdout) if raw.ok else None
        logged, parser = swe_runners.parse_log(runner, run.output)
        info = {"exit_status": str(run.exit_code), "parser": parser}
        problems: list[str] = []
        refused = tuple(swe_runners.refusals(run.exit_code, run.output))
        if record is None or refused:
            info["log"] = run.output[-1000:]
            return TestRun({}, _status(run), None, False, run.timed_out, (), info,
                           refused=refused)
        if record.tampered:
            problems.append("the code under test replaced the test runner's functions while "
                            "the tests ran")
            info["tampered"] = "; ".join(record.tampered)[:1000]
        outcomes = swe_runners.cross_checked(record, logged)
        info["parser"] = f"recorder+{parser}"
        if not outcomes:
            info["log"] = run.output[-1000:]
            problems.append(f"the {runner.name} runner recorded no test")
        return TestRun(outcomes, _status(run), record.exitstatus, True, run.timed_out,
                       tuple(problems), info, record.docs)

    async def cleanup(self, ctx: JobContext) -> None:
        ctx.state.pop(SANDBOX_KEY, None)


async def check_out(sandbox: Any, task: Mapping[str, Any], kind: str, data: bytes,
                    timeout: float) -> None:  # noqa: ASYNC109
    """The task's repository at ``base_commit`` in the sandbox's workspace, history after it
    and every other ref gone."""
    src = await write_private(sandbox, "repo-source", data)
    result = await sandbox.exec(["bash", "-c", _CHECKOUT, "checkout", src, kind,
                                 task["base_commit"]],
                                timeout=timeout, cwd=sandbox.workspace_in_sandbox)
    head = result.stdout.strip().splitlines()[-1:] if result.ok else []
    if not head or not head[0].startswith(task["base_commit"]):
        raise HandlerError(f"could not check out {task['base_commit']} from "
                           f"{task['repo_source']}: {result.output[-800:]}",
                           "REPO_CHECKOUT_FAILED")


def import_paths(task: Mapping[str, Any], found: list[str]) -> list[str]:
    """Folders of the checkout the tests need on the path: a task without an environment of
    its own runs from the checkout, where a src/ layout (``found`` by the grading tree) is
    importable only with src/ on the path; a task with a spec installs its package."""
    return [] if EnvSpec.of(task) is not None else [p for p in found if p == "src"]


def task_runner(task: Mapping[str, Any]) -> Runner:
    """The runner of a task that validated (see :mod:`.swe_runners`)."""
    spec = EnvSpec.of(task)
    return swe_runners.runner_of(task, spec.test_runner if spec is not None else "")


def protected_paths(task: Mapping[str, Any], runner: Runner, named: list[str]) -> list[str]:
    """What the grading tree puts back to ``base_commit`` beside the files pytest loads by
    configuration: the files of the test patch and of the named tests, the runner's own
    files, and (a trailing ``/``) each test directory they are in, from its topmost folder
    named like one (``tests``, ``test_*``, ``*_tests``; ``testing`` only at the root, as
    pytest's own: ``sympy/testing`` is a package of the library): a directory's
    ``__init__.py``, helper modules and data are the tests' as much as the test files are."""
    files = [*patched_files(task["test_patch"]), *runner.protect]
    if runner.name == "pytest":
        files += files_of(named)
    out = set(files)
    for path in files:
        parts = path.split("/")[:-1]
        for i, part in enumerate(parts):
            if _TEST_DIR.fullmatch(part) and (part != "testing" or i == 0):
                out.add("/".join(parts[:i + 1]) + "/")
                break
    return sorted(out)


def import_roots(task: Mapping[str, Any], runner: Runner, named: list[str]) -> list[str]:
    """Files whose imports lead to the test machinery the grading tree restores: the runner's
    script and the test files (of the test patch and of the named pytest tests)."""
    files = [runner.script] if runner.script else []
    files += [f for f in patched_files(task["test_patch"]) if f.endswith(".py")]
    if runner.name == "pytest":
        files += files_of(named)
    return list(dict.fromkeys(files))


def test_command(task: Mapping[str, Any], workspace: str) -> list[str]:
    """pytest through :data:`LAUNCH_SOURCE` (``python`` is the task environment's when it has one,
    the image's own with ``spec.image``), the options of the task's ``spec.test_cmd`` and the
    grader's: the report plugin, no cache, the task's plugins. The named node ids follow."""
    spec = EnvSpec.of(task)
    env, options = swe_runners.split_assignments(spec.test_cmd if spec else ())
    args = [*(["env", *env] if env else []),
            spec.run_python if spec else "python", "-c", swe_runners.launcher(LAUNCH_SOURCE),
            workspace,
            *options,
            "-p", REPORT_PLUGIN, "-p", "no:cacheprovider", "-q", "--tb=short"]
    for plugin in task.get("pytest_plugins", []):
        args += ["-p", plugin]
    return args


def test_env(task: Mapping[str, Any], plugin_dir: str, report: str,
             paths: Sequence[str] = (), workspace: str = "/workspace",
             added: str = "") -> dict[str, str]:
    """Environment of the test run: plugin autoload off unless the task asks for it (the
    server's or the environment's stray plugins change outcomes and cost seconds); ``paths``
    (a src/ layout's folder) after the plugin's on PYTHONPATH, for the tests only
    (:func:`start_env`)."""
    env = string_env(task, "test_env", env=ENV)
    if not task.get("pytest_plugin_autoload", False):
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    set_start_env(env, [plugin_dir, *paths], workspace, added)
    env["ROLLOUT_PYTEST_REPORT"] = report
    return env


def set_start_env(env: dict[str, str], paths: Sequence[str], workspace: str, added: str,
                  trace: Sequence[str] = ()) -> None:
    """``PYTHONPATH`` and ``ROLLOUT_START`` of a test run, set in ``env``: ``paths`` in front
    of the task's ``PYTHONPATH``, of which the interpreter itself gets only the entries outside the
    repository (so no module of the repository is found while it starts); the whole list
    reaches the tests through ``runner_start.py`` once the runner's fingerprints are taken,
    with ``added`` (the grading tree's list of the files the agent added) and ``trace`` (the
    test files whose functions SymPy's runner calls)."""
    full = [p for p in (*paths, *env.get("PYTHONPATH", "").split(":")) if p]
    outside = [p for p in full if posixpath.isabs(p) and p != workspace
               and not p.startswith(workspace.rstrip("/") + "/")]
    env[swe_runners.START_VAR] = json.dumps({"pythonpath": full, "added": added,
                                             "trace": list(trace)})
    env.pop("PYTHONPATH", None)
    if outside:
        env["PYTHONPATH"] = ":".join(outside)


def named_tests(task: Mapping[str, Any], name: str) -> list[str]:
    """FAIL_TO_PASS / PASS_TO_PASS as a list (SWE-bench exports store them as JSON strings)."""
    value = task.get(name, [])
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise invalid(f"swe task field {name!r} is a string but not a JSON list",
                          name) from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise invalid(f"swe task field {name!r} must be a list of pytest node ids", name)
    return list(value)


def patched_files(patch: str) -> list[str]:
    """Paths a unified git diff touches (both sides of renames), in order."""
    files: dict[str, None] = {}
    for m in re.finditer(r"^diff --git a/(\S+) b/(\S+)$", patch, re.MULTILINE):
        files.setdefault(m.group(1), None)
        files.setdefault(m.group(2), None)
    return list(files)


def resolve_source(repo_source: str) -> Path:
    """Only inside the server's allowed roots (``server.task_path_roots``), links resolved."""
    return host_path(repo_source, "repo_source", env=ENV)


def read_source(path: Path) -> tuple[str, bytes]:
    """("bundle" | "archive", bytes) for the sandbox; a git directory is bundled first."""
    if path.is_dir():
        with tempfile.TemporaryDirectory(prefix="rollout-swe-") as tmp:
            bundle = Path(tmp) / "repo.bundle"
            proc = subprocess.run(["git", "-C", str(path), "bundle", "create", "-q",
                                   str(bundle), "--all"], capture_output=True, text=True)
            if proc.returncode != 0:
                raise HandlerError(f"could not bundle the git directory {path}: "
                                   f"{proc.stderr[-500:]}", "REPO_SOURCE_INVALID")
            return "bundle", bundle.read_bytes()
    kind = "archive" if path.name.endswith(_ARCHIVE_SUFFIXES) else "bundle"
    return kind, path.read_bytes()

