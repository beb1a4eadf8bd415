"""SWE-bench-style image instances: the repository at ``/testbed`` of the instance's own image,
set up and graded there with the image's interpreter and the official harness's test spec.

A ``swe`` task is one when its ``spec`` names an image (or, as SWE-bench 5's data sets spell it,
the instance has a top-level ``image``; SWE-rebench's spell it ``docker_image``) and it has no
``repo_source`` (the image carries the repository, as SWE-bench, SWE-Gym, SWE-smith and
SWE-rebench images do)::

    {"instance_id": "psf__requests-2317", "repo": "psf/requests", "version": "2.4",
     "base_commit": "091991be...", "problem_statement": "...", "test_patch": "diff --git ...",
     "FAIL_TO_PASS": [...], "PASS_TO_PASS": [...], "patch": "...",     # gold, never shown
     "spec": {"image": "docker://swebench/sweb.eval.x86_64.psf_1776_requests-2317:latest"}}

INIT opens the job's sandbox on the image (a copy-on-write layer of its own; see
:mod:`rollout.runtime.sandbox.images`), checks that ``/testbed`` is at ``base_commit`` and
removes what could show the fix: every ref but ``main``, the reflogs, and (when a ref or
reflog reached past the base) the objects only they reached. The agent works in ``/testbed``
with bash, the editor and submit; RUN's end kills every process it started.

INIT asks the official ``swebench`` package (its own venv, scripts/setup_swebench.sh; see
:mod:`.swebench_helper`) for the instance's eval script, so an instance the harness cannot grade
fails before the agent runs: the environment activation, the test files reset to the base
commit, the test patch applied, the repository's test command with the instance's test
directives (from 4.x's per-repository tables, or the table entry the instance brings: ``spec``'s
``test_cmd`` and ``log_parser``, or a SWE-rebench row's ``install_config``, whose other keys
say how its image was built and are not needed), or the instance's own ``eval_script``,
``log_parser`` and ``eval_type`` (SWE-bench 5's format, graded with swebench 5: any repository
in any of the harness's languages). The agent's change is taken as ``git diff`` of
``/testbed`` (what the harness grades: a patch) and graded where the agent cannot reach: a
fresh sandbox on the same image, the patch applied over the pristine ``/testbed``, then the
``swe`` grader's integrity layer (:mod:`rollout.runtime.envs.in_sandbox.swe_grade_tree`: a
fresh ``.git`` at the base, the files the test runner loads by configuration and the test
files put back, added bytecode removed, the change screened for code that reaches into the
test machinery), then the harness's eval script as it is. The log is read by the harness's
parser and judged by its FAIL_TO_PASS / PASS_TO_PASS report: reward 1 iff ``RESOLVED_FULL``
and the screen found nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollout.runtime.envs.common import (
    SANDBOX_KEY,
    check_task_object,
    invalid,
    require_str,
    sandbox_of,
    write_private,
)
from rollout.runtime.envs.grading.isolated import end_agent
from rollout.runtime.envs.swe import smith
from rollout.runtime.handler import HandlerError, JobContext, PolicyFault
from rollout.runtime.sandbox.base import python_argv
from rollout.runtime.types import Reward, TerminationReason

TESTBED = "/testbed"
SWEBENCH_PYTHON_VAR = "ROLLOUT_SWEBENCH_PYTHON"
HELPER = Path(__file__).with_name("swebench_helper.py")
IMAGE_KEY = "swe.image"
EVAL_SPEC_KEY = "swe.eval_spec"
EVAL_TYPES = ("pass_and_fail", "fail_only")
"""SWE-bench 5's ``eval_type`` values (``swebench.harness.constants.EvalType``)."""
START_MARKER = ">>>>> Start Test Output"
HARNESS_SPEC_KEYS = ("test_cmd", "log_parser", "eval_commands", "install")
"""What ``spec`` may give beside ``image``: the SWE-bench harness's table entry for a
repository its tables lack (:mod:`.swebench_helper`)."""
INSTALL_CONFIG = "install_config"
"""A SWE-rebench row's table entry for its repository and version (SWE-rebench's fork of the
harness reads it in place of the 4.x tables): ``HARNESS_SPEC_KEYS`` are what grading uses; the
rest (``python``, ``packages``, ``pip_packages``, ``pre_install``, ``reqs_path``, ...) built
the row's image and are not read."""
IMAGE_FIELDS = ("image", "docker_image")
"""Where a row without ``spec`` names its image: SWE-bench 5's ``image``, SWE-rebench's
``docker_image`` (registry references without a transport)."""
MAX_PATCH = 16 << 20
END_MARKER = ">>>>> End Test Output"
"""The harness's end-of-test-output marker (``swebench.harness.constants.END_TEST_OUTPUT``)."""
_LOG_TAIL = 2000
_AGENT_PATCH_FAILED = 96
_PATCH_FAILED = 97
_GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
            "GIT_TERMINAL_PROMPT": "0"}
SANDBOX_ENV = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "safe.directory",
               "GIT_CONFIG_VALUE_0": "*"}
"""Every process of the job's and the grader's sandboxes: the image's files belong to its
root user, a root server's sandbox runs as a uid of its own, and git refuses a repository
owned by another user unless told it is safe (in configuration only the command line or the
environment may give)."""

_CUT = r"""
set -euo pipefail
base=$1
cd /testbed
head=$(git rev-parse HEAD)
case "$head" in
  "$base"*) ;;
  *) echo "/testbed is at $head, not at base_commit $base" >&2; exit 3;;
esac
base=$head
reach_all=$(git rev-list --all --reflog 2>/dev/null | wc -l)
reach_base=$(git rev-list "$base" | wc -l)
git symbolic-ref HEAD refs/heads/main
git update-ref refs/heads/main "$base"
git for-each-ref --format='%(refname)' | grep -v '^refs/heads/main$' \
  | while read -r ref; do git update-ref -d "$ref"; done
git remote | while read -r r; do git remote remove "$r"; done
git reflog expire --expire=now --all
if [ "$reach_all" != "$reach_base" ]; then git gc -q --prune=now; fi
git config user.name agent && git config user.email agent@localhost
git rev-parse HEAD
"""

_DIFF = r"""
set -euo pipefail
cd /testbed
git -c core.fsmonitor= -c core.hooksPath=/dev/null add -A
git -c core.fsmonitor= -c core.hooksPath=/dev/null diff --cached --binary --no-color \
  --no-ext-diff "$1"
"""

# In the fresh grading sandbox: the pristine repository's history up to the base as a bundle
# (the grading tree's fresh .git comes from it), the agent's patch over the pristine tree, then
# the image's .git gone, so nothing of the image's own git set-up takes part.
_PREPARE = r"""
set -uo pipefail
priv=$1 base=$2
cd /testbed || exit 3
export GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null
git update-ref refs/rollout/base "$base" && git bundle create -q "$priv/repo.bundle" \
  refs/rollout/base || exit 3
if [ -s "$priv/agent.patch" ]; then
  git apply --binary --whitespace=nowarn "$priv/agent.patch" || exit 96
fi
rm -rf .git
"""


def is_image_instance(task: Mapping[str, Any]) -> bool:
    """A task whose image carries its repository at ``/testbed`` (no ``repo_source``): named
    by ``spec.image``, or by a top-level ``image`` where there is no ``spec``."""
    if smith.is_smith_instance(task):
        return True
    if "repo_source" in task:
        return False
    spec = task.get("spec")
    if spec is None:
        return _image_field(task) is not None
    return isinstance(spec, Mapping) and bool(spec.get("image"))


def _image_field(task: Mapping[str, Any]) -> str | None:
    """The top-level field that names the image of a row without ``spec``, if any."""
    for name in IMAGE_FIELDS:
        value = task.get(name)
        if isinstance(value, str) and value.strip():
            return name
    return None


def no_repository(task: Mapping[str, Any]) -> str:
    """What to say of a ``swe`` task that names neither a clone nor an image: the ways to name
    one, and why a row that looks like a known format's is not one."""
    said = ("swe task is missing the required field 'repo_source' (a clone on the server), or "
            "an image that carries the repository at /testbed: 'spec.image', 'image' "
            "(SWE-bench 5's rows), 'docker_image' (SWE-rebench's), or 'image_name' with the "
            "bug's 'patch' and no 'base_commit' (SWE-smith's)")
    if isinstance(task.get("image_name"), str) and "base_commit" in task:
        said += ("; a row with 'image_name' and 'base_commit' (SWE-rebench V2's: the repository "
                 "at /<name>, graded by its own harness's parsers) is not a format this server "
                 "reads")
    return said


def image_of(task: Mapping[str, Any]) -> str:
    """The instance's image reference: ``spec.image`` as given, or the top-level ``image`` of
    SWE-bench 5's data sets (``docker_image`` of SWE-rebench's, ``image_name`` of SWE-smith's),
    a registry reference without its transport (``swebench/sweb.eval.x86_64.<id>:latest`` is
    ``docker://`` that)."""
    if smith.is_smith_instance(task):
        return smith.image(task)
    spec = task.get("spec")
    if isinstance(spec, Mapping):
        return str(spec["image"])
    from rollout.runtime.sandbox.images import with_transport

    return with_transport(str(task[_image_field(task) or "image"]))


def harness_entry(task: Mapping[str, Any]) -> dict[str, Any]:
    """The table entry the instance brings for the harness (``spec``'s, or a SWE-rebench row's
    ``install_config``'s), only the keys grading reads; {} when it brings none. A key whose
    value is null is absent (a data set's table gives every row every key of every row)."""
    spec = task.get("spec")
    given = spec if isinstance(spec, Mapping) else task.get(INSTALL_CONFIG)
    if not isinstance(given, Mapping):
        return {}
    return {k: given[k] for k in HARNESS_SPEC_KEYS if given.get(k) is not None}


def validate(task: Mapping[str, Any]) -> None:
    from rollout.runtime.envs.swe.handler import named_tests
    from rollout.runtime.sandbox.images import ImageError, parse_image_ref

    if smith.is_smith_instance(task):
        smith.validate(task)
        return
    check_task_object(task, "swe")
    for name in ("instance_id", "problem_statement", "test_patch", "repo"):
        require_str(task, name, env="swe")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", task["repo"]):
        raise invalid("swe task field 'repo' must be owner/name, as SWE-bench names it", "repo")
    if not isinstance(task.get("version"), str | int | float) or isinstance(
            task.get("version"), bool) or not str(task.get("version")).strip():
        raise invalid("a swe image instance needs 'version' (the repository version the "
                      "SWE-bench harness keys its test command by)", "version")
    base = require_str(task, "base_commit", env="swe")
    if not re.fullmatch(r"[0-9a-f]{7,64}", base):
        raise invalid(f"swe task field 'base_commit' must be a hex commit id, got {base!r}",
                      "base_commit")
    if not named_tests(task, "FAIL_TO_PASS"):
        raise invalid("swe task needs at least one FAIL_TO_PASS test", "FAIL_TO_PASS")
    named_tests(task, "PASS_TO_PASS")
    spec = task.get("spec")
    where = "spec.image" if spec is not None else (_image_field(task) or "image")
    if spec is not None:
        unknown = sorted(set(spec) - {"image", *HARNESS_SPEC_KEYS})
        if unknown:
            raise invalid(f"a swe image instance's 'spec' takes only 'image' and the SWE-bench "
                          f"harness's entry for a repository its tables lack "
                          f"({', '.join(HARNESS_SPEC_KEYS)}): the image carries the "
                          f"environment; got {unknown}", "spec")
        if INSTALL_CONFIG in task:
            raise invalid(f"a swe image instance gives its harness entry either in 'spec' or "
                          f"in '{INSTALL_CONFIG}' (a SWE-rebench row's), not both",
                          INSTALL_CONFIG)
        _validate_harness_spec(task, spec, "spec")
    elif INSTALL_CONFIG in task:
        entry = harness_entry(task)
        if not isinstance(task[INSTALL_CONFIG], Mapping) or not entry:
            raise invalid(f"swe task field '{INSTALL_CONFIG}' must be the repository's entry "
                          f"for the SWE-bench harness (a SWE-rebench row's: at least "
                          f"'test_cmd' and 'log_parser')", INSTALL_CONFIG)
        _validate_harness_spec(task, entry, INSTALL_CONFIG)
    try:
        parse_image_ref(image_of(task))
    except ImageError as e:
        raise invalid(f"swe task field {where!r}: {e}", where) from None
    _validate_own_eval_script(task)
    if "patch" in task and not isinstance(task["patch"], str):
        raise invalid("swe task field 'patch' must be a string", "patch")


def _validate_harness_spec(task: Mapping[str, Any], spec: Mapping[str, Any], where: str) -> None:
    """``spec.test_cmd`` and friends (``where`` = ``spec``, or a SWE-rebench row's
    ``install_config``): a repository the harness's tables lack, given its entry (a test
    command and a parser, as SWE-Gym's and SWE-rebench's forks of the harness add them)."""
    if not set(spec) & set(HARNESS_SPEC_KEYS):
        return
    if "eval_script" in task:
        raise invalid(f"a swe image instance gives either its own 'eval_script' (SWE-bench 5's "
                      f"format) or the harness's entry in '{where}' (test_cmd, log_parser), "
                      f"not both", where)
    cmd = spec.get("test_cmd")
    if not (isinstance(cmd, str) and cmd.strip()):
        raise invalid(f"swe task field '{where}.test_cmd' must be the repository's test command "
                      f"(the harness appends the test files of the test patch)",
                      f"{where}.test_cmd")
    parser = spec.get("log_parser")
    if not isinstance(parser, str) or not re.fullmatch(r"parse_log_[A-Za-z0-9_]+", parser):
        raise invalid(f"swe task field '{where}.log_parser' must name one of the SWE-bench "
                      f"harness's log parsers (such as 'parse_log_pytest')",
                      f"{where}.log_parser")
    extra = spec.get("eval_commands", [])
    if not isinstance(extra, list) or not all(isinstance(c, str) for c in extra):
        raise invalid(f"swe task field '{where}.eval_commands' must be a list of shell commands",
                      f"{where}.eval_commands")
    if not isinstance(spec.get("install", ""), str):
        raise invalid(f"swe task field '{where}.install' must be a shell command",
                      f"{where}.install")


def _validate_own_eval_script(task: Mapping[str, Any]) -> None:
    """SWE-bench 5's per-instance fields, checked as far as the server can without the
    harness (the parser's name is checked against its registry at INIT)."""
    fields = [name for name in ("eval_script", "log_parser", "eval_type") if name in task]
    if not fields:
        return
    script, parser = task.get("eval_script"), task.get("log_parser")
    if not isinstance(script, str) or not script.strip():
        raise invalid("swe task field 'eval_script' must be the instance's eval script (SWE-bench "
                      "5's format: it comes with 'log_parser' and 'eval_type')", "eval_script")
    if START_MARKER not in script or END_MARKER not in script:
        raise invalid(f"swe task field 'eval_script' must print the harness's markers "
                      f"{START_MARKER!r} and {END_MARKER!r} around the test command (the log "
                      f"parser reads what is between them)", "eval_script")
    if not isinstance(parser, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", parser):
        raise invalid("swe task field 'log_parser' must name one of the SWE-bench harness's "
                      "log parsers (such as 'parse_log_pytest'); an instance with its own "
                      "'eval_script' needs one", "log_parser")
    eval_type = task.get("eval_type", EVAL_TYPES[0])
    if eval_type not in EVAL_TYPES:
        raise invalid(f"swe task field 'eval_type' must be one of {list(EVAL_TYPES)}, got "
                      f"{eval_type!r}", "eval_type")


async def init(ctx: JobContext) -> None:
    task = ctx.spec.task
    validate(task)
    if smith.is_smith_instance(task):
        ctx.state[EVAL_SPEC_KEY] = await ask_swebench("smith-spec",
                                                      {"instance": smith.fields(task)})
        image = ctx.state[IMAGE_KEY] = image_of(task)
        sandbox = await ctx.open_sandbox(image=image, env=SANDBOX_ENV)
        ctx.state[SANDBOX_KEY] = sandbox
        ctx.state[smith.BASE_KEY] = await smith.make_base(sandbox, task)
        ctx.progress("environment", {"image": image, "repository": TESTBED})
        return
    image = image_of(task)
    # Before any sandbox: an instance the harness cannot grade fails here, not after its RUN.
    ctx.state[EVAL_SPEC_KEY] = await ask_swebench("eval-script",
                                                  {"instance": instance_fields(task)})
    ctx.state[IMAGE_KEY] = image
    sandbox = await ctx.open_sandbox(image=image, env=SANDBOX_ENV)
    ctx.state[SANDBOX_KEY] = sandbox
    cut = await sandbox.exec(["bash", "-c", _CUT, "cut", task["base_commit"]],
                             timeout=ctx.spec.limits.init_timeout_s, cwd=TESTBED,
                             env=_GIT_ENV)
    head = cut.stdout.strip().splitlines()[-1:] if cut.ok else []
    if not head or not head[0].startswith(task["base_commit"]):
        raise HandlerError(f"the image {image} of {task['instance_id']} has no git repository "
                           f"at {TESTBED} checked out at base_commit: {cut.output[-600:]}",
                           "REPO_CHECKOUT_FAILED")
    ctx.progress("environment", {"image": image, "repository": TESTBED})


async def evaluate(ctx: JobContext) -> Reward:
    from rollout.runtime.envs.swe import handler as swe
    bug = smith.is_smith_instance(ctx.spec.task)
    task = smith.graded_task(ctx) if bug else ctx.spec.task
    image = ctx.state.get(IMAGE_KEY) or image_of(ctx.spec.task)
    f2p, p2p = swe.named_tests(task, "FAIL_TO_PASS"), swe.named_tests(task, "PASS_TO_PASS")
    agent = sandbox_of(ctx)
    await end_agent(ctx)
    diff = await agent.exec(["bash", "-c", _DIFF, "diff", task["base_commit"]], timeout=120.0,
                            cwd=TESTBED, env=_GIT_ENV, max_output=MAX_PATCH)
    zero = {"fail_to_pass": 0.0, "pass_to_pass": 0.0}
    if diff.truncated:
        raise PolicyFault(f"the change to {TESTBED} is over {MAX_PATCH} bytes",
                          TerminationReason.WORKSPACE_TOO_LARGE)
    if not diff.ok:
        return Reward(0.0, zero, {"error": f"git could not read the change to {TESTBED}",
                                  "log": diff.output[-_LOG_TAIL:]})
    spec = ctx.state.get(EVAL_SPEC_KEY) or await ask_swebench(
        "smith-spec" if bug else "eval-script",
        {"instance": smith.fields(task) if bug else instance_fields(task)})
    grader = await ctx.open_sandbox(image=image, env=SANDBOX_ENV)
    try:
        return await _grade(ctx, grader, diff.stdout, spec, f2p, p2p, task)
    finally:
        await grader.destroy()


async def _grade(ctx: JobContext, grader: Any, patch: str, spec: Mapping[str, Any],
                 f2p: list[str], p2p: list[str], task: Mapping[str, Any]) -> Reward:
    """``task``: the instance as graded (a SWE-smith one's made base as ``base_commit``)."""
    from rollout.runtime.envs.swe import handler as swe
    from rollout.runtime.envs.swe import runners as swe_runners
    bug = smith.is_smith_instance(ctx.spec.task)
    zero = {"fail_to_pass": 0.0, "pass_to_pass": 0.0}
    if bug:  # the same starting point as the agent's, from the pristine image
        made = await smith.make_base(grader, task, patch_file=await write_private(
            grader, "bug.patch", task["patch"].encode("utf-8", "surrogateescape")))
        if made != task["base_commit"]:
            raise HandlerError(f"the grader's starting point of {task['instance_id']} ({made}) "
                               f"is not the agent's ({task['base_commit']})", "HANDLER_ERROR")
    await write_private(grader, "agent.patch", patch.encode("utf-8", "surrogateescape"))
    test_patch = await write_private(grader, "test.patch", task["test_patch"])
    tree = await write_private(grader, "swe_grade_tree.py", swe.GRADE_TREE_SOURCE.read_bytes())
    nonce = secrets.token_hex(8)
    eval_script = await write_private(grader, "eval.sh",
                                      with_exit_status(spec["eval_script"], nonce))
    private = os.path.dirname(test_patch)
    prepared = await grader.exec(["bash", "-c", _PREPARE, "prepare", private,
                                  task["base_commit"]], timeout=300.0, cwd=TESTBED)
    if prepared.exit_code == _AGENT_PATCH_FAILED:
        return Reward(0.0, zero, {"error": "the agent's change does not apply to the image's "
                                           "repository", "log": prepared.output[-_LOG_TAIL:]})
    if not prepared.ok:
        raise HandlerError(f"preparing the grading tree in {ctx.state.get(IMAGE_KEY)} failed: "
                           f"{prepared.output[-600:]}", "HANDLER_ERROR")
    runner = swe_runners.runner_of(task)
    python = python_argv(grader) if getattr(grader, "python_launcher", ()) else ["python3"]
    built = await grader.exec(
        [*python, tree, f"{private}/repo.bundle", "bundle", task["base_commit"], test_patch,
         *swe.protected_paths(task, runner, f2p + p2p)],
        timeout=min(300.0, ctx.spec.limits.eval_timeout_s), cwd=TESTBED,
        env={"PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1", **_GIT_ENV})
    if not built.ok:
        why = ("the test patch does not apply" if built.exit_code == _PATCH_FAILED
               else "building the grading tree failed")
        return Reward(0.0, zero, {"error": why, "log": built.output[-_LOG_TAIL:]})
    tree_report = json.loads(built.stdout.strip().splitlines()[-1] or "{}")
    info: dict[str, str] = {"restored": ",".join(tree_report.get("restored", []))[:1000],
                            "grader": "swesmith" if bug else "swebench",
                            "parser": str(spec.get("parser", "")),
                            "test_cmd": str(spec.get("test_cmd", "")),
                            "harness": str(spec.get("harness", ""))}
    if spec.get("eval_type"):
        info["eval_type"] = str(spec["eval_type"])
    if applies_test_patch(spec["eval_script"], task["test_patch"]):
        # The harness's eval script applies the test patch itself: take it back off first.
        undone = await grader.exec(["git", "apply", "-R", "--whitespace=nowarn", test_patch],
                                   timeout=60.0, cwd=TESTBED, env=_GIT_ENV)
        if not undone.ok:
            raise HandlerError(f"could not take the test patch back off: "
                               f"{undone.output[-400:]}", "HANDLER_ERROR")
    timeout = min(float(task.get("test_timeout_s", 1800.0)), ctx.spec.limits.eval_timeout_s)
    run = await grader.exec(["bash", "-c", 'exec bash "$1" 2>&1', "eval", eval_script],
                            timeout=timeout, cwd=TESTBED, max_output=8 << 20)
    # Whatever the tests left running must not outlive the run into the verdict.
    await grader.stop_processes()
    found_exit = re.search(rf"^ROLLOUT_EXIT_{nonce}=(\d+)$", run.output, re.MULTILINE)
    info["exit_status"] = found_exit.group(1) if found_exit else "unknown"
    if run.timed_out:
        info["error"] = f"the eval script timed out after {timeout:g} s"
        return Reward(0.0, zero, info)
    verdict = await ask_swebench("smith-grade" if bug else "grade", {
        "instance": smith.fields(task) if bug else instance_fields(task), "log": run.output})
    components = {"fail_to_pass": float(verdict.get("fail_to_pass", 0.0)),
                  "pass_to_pass": float(verdict.get("pass_to_pass", 0.0))}
    info["resolution"] = str(verdict.get("resolution", ""))
    report = verdict.get("report") or {}
    failing = [t for key in ("FAIL_TO_PASS", "PASS_TO_PASS")
               for t in report.get(key, {}).get("failure", [])]
    info["failing"] = ",".join(failing)[:1000]
    info["log"] = run.output[-_LOG_TAIL:]
    if not verdict.get("found"):
        info["error"] = "the harness's parser found no test results in the eval log"
        return Reward(0.0, components, info)
    if tree_report.get("screen"):
        info["error"] = "the change reaches into the test framework or the grader"
        info["screen"] = "; ".join(tree_report["screen"])[:2000]
        return Reward(0.0, components, info)
    if not exit_status_agrees(verdict.get("status_map") or {}, info["exit_status"]):
        info["error"] = (f"the test command's exit status ({info['exit_status']}) disagrees "
                         "with the log, in which every test passed")
        return Reward(0.0, components, info)
    return Reward(1.0 if verdict.get("resolution") == "RESOLVED_FULL" else 0.0, components,
                  info)


def applies_test_patch(script: str, test_patch: str) -> bool:
    """Whether the eval script applies the test patch itself (the harness's scripts carry it
    in a here-document); one that does not expects it in the tree already."""
    body = test_patch.strip()
    return bool(body) and body in script


def with_exit_status(script: str, nonce: str) -> str:
    """The harness's eval script with the test command's exit status recorded: kept right
    after the command (the end marker, a ``:`` in the harness's own scripts, would reset it)
    and printed after the marker under a name the code under test never saw, so a log whose
    every test passed can be checked against a runner that failed. A script that records the
    status itself (``VAR=$?`` right before the marker, as swebench 5 writes) gets the capture
    before that line: after it, ``$?`` is the assignment's 0."""
    lines = script.split("\n")
    for i, line in enumerate(lines):
        if END_MARKER in line and i > 0:
            at = i - 1 if i > 1 and re.fullmatch(r"\s*[A-Za-z_]\w*=\$\?\s*", lines[i - 1]) else i
            return "\n".join([*lines[:at], "rollout_exit=$?", *lines[at:i + 1],
                               f'echo "ROLLOUT_EXIT_{nonce}=$rollout_exit"', *lines[i + 1:]])
    return script


def exit_status_agrees(status_map: Mapping[str, str], exit_status: str) -> bool:
    """False when every test the log names passed and the test command still failed (or its
    status is missing): a line printed by the code under test (at exit, say) rewrote the
    record."""
    return not (status_map and all(v == "PASSED" for v in status_map.values())
                and exit_status != "0")


def instance_fields(task: Mapping[str, Any]) -> dict[str, Any]:
    """What the harness's test spec reads of an instance (SWE-bench 5's own eval script,
    parser and eval type where the instance has them)."""
    fields = {k: task[k] for k in ("instance_id", "repo", "version", "base_commit", "test_patch",
                                   "FAIL_TO_PASS", "PASS_TO_PASS", "eval_script", "log_parser",
                                   "eval_type") if k in task}
    entry = harness_entry(task)
    if entry:
        fields["harness_spec"] = entry
    return {**fields, "image": image_of(task)}


def swebench_python() -> Path:
    """The interpreter of the ``swebench`` venv: ``$ROLLOUT_SWEBENCH_PYTHON``, else the one
    scripts/setup_swebench.sh made under the set-up cache."""
    from rollout.runtime.envs.harness.presets import setup_cache

    given = os.environ.get(SWEBENCH_PYTHON_VAR)
    path = Path(given) if given else setup_cache() / "current-swebench" / "bin" / "python"
    if not path.is_file():
        raise HandlerError(f"grading a SWE-bench image instance needs the official swebench "
                           f"package, and {path} does not exist: run `bash "
                           f"scripts/setup_swebench.sh` on the server (or set "
                           f"{SWEBENCH_PYTHON_VAR})", "SWEBENCH_MISSING")
    return path


async def ask_swebench(command: str, request: Mapping[str, Any],
                       timeout: float = 120.0) -> dict[str, Any]:  # noqa: ASYNC109
    """One request to :mod:`.swebench_helper` in the ``swebench`` venv (a process of its own,
    started off the event loop)."""
    python = swebench_python()

    def call() -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(python), "-I", str(HELPER), command],
                              input=json.dumps(request), capture_output=True, text=True,
                              timeout=timeout, env={"PATH": os.environ.get("PATH", ""),
                                                    "HOME": os.environ.get("HOME", "/")})

    try:
        proc = await asyncio.to_thread(call)
    except subprocess.TimeoutExpired:
        raise HandlerError(f"the swebench helper ({command}) took over {timeout:g} s",
                           "SWEBENCH_FAILED") from None
    if proc.returncode != 0:
        raise HandlerError(f"the swebench helper ({command}) failed: {proc.stderr[-800:]}",
                           "SWEBENCH_FAILED")
    result: dict[str, Any] = json.loads(proc.stdout)
    if "error" in result:
        raise HandlerError(f"the SWE-bench harness cannot grade this instance: "
                           f"{result['error']}", "INVALID_TASK")
    return result
