"""SWE-smith instances: a bug made in a repository's image, graded by SWE-smith's own profile of
that repository. An instance as SWE-smith's data sets ship it::

    {"instance_id": "getmoto__moto.694ce1f4.func_pm_op_swap__x1", "problem_statement": "...",
     "repo": "swesmith/getmoto__moto.694ce1f4",
     "image_name": "jyangballin/swesmith.x86_64.getmoto_1776_moto.694ce1f4",
     "patch": "diff --git ...",              # the bug: applied to the image's clean /testbed
     "FAIL_TO_PASS": [...], "PASS_TO_PASS": [...]}

It has no ``base_commit`` and no ``test_patch``: the image holds the repository clean at
``/testbed``, ``patch`` is the change that introduces the bug, and the tests that must pass
are already in the repository (the bug breaks them). SWE-smith itself checks out a branch per
instance from its GitHub mirror; here nothing is fetched: INIT applies ``patch`` to the image's
``/testbed`` and makes the result the repository's only commit (the bug is nowhere in its
history: ``git log -p`` cannot show the fix), with fixed author, committer and dates, so the
grader makes the same commit, with the same id, from the same image.

Everything else is the image instances' machinery (:mod:`.images`): the agent's change is
``git diff`` from that commit, graded in a fresh sandbox on the image where the grading
tree's integrity layer runs, then the test command. The test command and the log parser are
SWE-smith's profile of the repository (the ``swesmith`` package, installed beside the SWE-bench
harness in its venv; :mod:`.swebench_helper`): the profile's command over the test files of the
named tests, the profile's parser, SWE-smith's FAIL_TO_PASS / PASS_TO_PASS report.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout.runtime.envs.common import check_task_object, invalid, require_str
from rollout.runtime.handler import HandlerError, JobContext

BASE_KEY = "swe.smith_base"
BUG_FAILED = 98

# $1: the bug's patch file ('-': standard input). Applied to the index and the tree, then
# committed as the only commit (an orphan: the clean history would hold the fix); every other
# ref, remote and reflog goes, and the objects only they reached.
_BASE = r"""
set -euo pipefail
cd /testbed
export GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null
# An image's files carry other stat data than its index recorded: refresh it, or every file
# "does not match index".
git update-index -q --refresh >/dev/null || true
git apply --index --whitespace=nowarn "$1" || exit 98
export GIT_AUTHOR_NAME=rollout GIT_AUTHOR_EMAIL=rollout@localhost
export GIT_COMMITTER_NAME=rollout GIT_COMMITTER_EMAIL=rollout@localhost
export GIT_AUTHOR_DATE="2000-01-01T00:00:00+0000" GIT_COMMITTER_DATE="2000-01-01T00:00:00+0000"
git checkout -q --orphan rollout-base
git -c core.hooksPath=/dev/null -c commit.gpgSign=false commit -q --no-verify -m "base"
git for-each-ref --format='%(refname)' | grep -v '^refs/heads/rollout-base$' \
  | while read -r ref; do git update-ref -d "$ref"; done
git branch -q -M rollout-base main
git remote | while read -r r; do git remote remove "$r"; done
git reflog expire --expire=now --all
git gc -q --prune=now
git config user.name agent && git config user.email agent@localhost
git rev-parse HEAD
"""


def is_smith_instance(task: Mapping[str, Any]) -> bool:
    """A SWE-smith row: an ``image_name`` and the bug's ``patch``, no ``base_commit``, no
    ``test_patch`` and no ``repo_source``."""
    return (isinstance(task.get("image_name"), str) and isinstance(task.get("patch"), str)
            and not any(k in task for k in ("base_commit", "test_patch", "repo_source")))


def validate(task: Mapping[str, Any]) -> None:
    from rollout.runtime.envs.swe.handler import named_tests
    from rollout.runtime.sandbox.images import ImageError, parse_image_ref, with_transport

    check_task_object(task, "swe")
    for name in ("instance_id", "problem_statement", "repo", "patch"):
        require_str(task, name, env="swe")
    if not task["patch"].lstrip().startswith(("diff ", "--- ")):
        raise invalid("a SWE-smith instance's 'patch' must be the diff that makes the bug",
                      "patch")
    try:
        parse_image_ref(with_transport(require_str(task, "image_name", env="swe")))
    except ImageError as e:
        raise invalid(f"swe task field 'image_name': {e}", "image_name") from None
    if not named_tests(task, "FAIL_TO_PASS"):
        raise invalid("swe task needs at least one FAIL_TO_PASS test", "FAIL_TO_PASS")
    named_tests(task, "PASS_TO_PASS")


def image(task: Mapping[str, Any]) -> str:
    from rollout.runtime.sandbox.images import with_transport

    return with_transport(str(task["image_name"]))


def fields(task: Mapping[str, Any]) -> dict[str, Any]:
    """What SWE-smith's profile reads of an instance."""
    return {k: task[k] for k in ("instance_id", "repo", "patch", "FAIL_TO_PASS", "PASS_TO_PASS",
                                 "image_name") if k in task}


async def make_base(sandbox: Any, task: Mapping[str, Any], *, patch_file: str = "-") -> str:
    """Apply the bug in ``sandbox``'s ``/testbed`` and make it the repository's only commit;
    its id. A bug that does not apply is the task's fault (``INVALID_TASK``)."""
    from rollout.runtime.envs.swe.images import SANDBOX_ENV

    stdin = task["patch"].encode("utf-8", "surrogateescape") if patch_file == "-" else None
    made = await sandbox.exec(["bash", "-c", _BASE, "base", patch_file], stdin=stdin,
                              timeout=300.0, cwd="/testbed", env=SANDBOX_ENV)
    if made.exit_code == BUG_FAILED:
        raise HandlerError(f"the bug of {task['instance_id']} (its 'patch') does not apply to "
                           f"/testbed of {image(task)}: {made.output[-600:]}", "INVALID_TASK")
    head = made.stdout.strip().splitlines()[-1:] if made.ok else []
    if not head or len(head[0]) < 40:
        raise HandlerError(f"making the starting point of {task['instance_id']} in "
                           f"{image(task)} failed: {made.output[-600:]}", "REPO_CHECKOUT_FAILED")
    return head[0]


def graded_task(ctx: JobContext) -> dict[str, Any]:
    """The instance as the image instances' grader reads it: the commit INIT made as
    ``base_commit``, no test patch."""
    return {**ctx.spec.task, "base_commit": ctx.state[BASE_KEY], "test_patch": ""}
