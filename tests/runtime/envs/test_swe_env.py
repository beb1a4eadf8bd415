"""Every shipped swe task: the gold patch earns 1, no change or a wrong change 0; the test
patch and the fix's history stay hidden from the agent."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.common import DATA_DIR
from rollout.runtime.envs.swe.handler import SweHandler
from rollout.runtime.envs.swe.taskenv import user_wheelhouses
from rollout.runtime.handler import HandlerError, JobContext
from rollout.runtime.tasksets.shipped import fill_wheelhouse, load_tasks
from rollout.runtime.types import TerminationReason
from tests.runtime.envs.conftest import Rollout, call

pytestmark = pytest.mark.timeout(180)

TASKS = load_tasks("swe")
IDS = [t["instance_id"] for t in TASKS]
SUBMIT = call("submit", answer="fixed")
_WHEELHOUSE_PROBLEM: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def wheelhouse_for_task_environments() -> None:
    """Tasks with a ``spec`` install from the wheelhouse: fill the user's wheelhouse once per
    machine (registry access needed that first time only); environments are cached in the
    user's env cache under a key that covers the spec and the build recipe."""
    try:
        fill_wheelhouse(TASKS, user_wheelhouses()[0])
    except (RuntimeError, OSError) as e:
        _WHEELHOUSE_PROBLEM.append(str(e))


def needs_environment(task: dict[str, Any]) -> None:
    if "spec" in task and _WHEELHOUSE_PROBLEM:
        pytest.skip(f"the wheelhouse could not be filled: {_WHEELHOUSE_PROBLEM[0][:300]}")


def apply_with_bash(patch: str) -> str:
    return call("bash", command=f"cat > /tmp/fix.patch <<'PATCH_EOF'\n{patch}PATCH_EOF\n"
                                "git apply /tmp/fix.patch && git status --short")


@pytest.mark.parametrize("task", TASKS, ids=IDS)
async def test_gold_patch_earns_1(task: dict[str, Any], rollout: Rollout) -> None:
    needs_environment(task)
    result = await rollout(SweHandler(), task, [apply_with_bash(task["patch"]), SUBMIT])
    assert result.outcome.termination is TerminationReason.SUBMITTED
    assert result.reward.value == 1.0, result.reward.info
    assert result.reward.components == {"fail_to_pass": 1.0, "pass_to_pass": 1.0}
    # Honeypots were planted and, in an honest run, left the reward to the named tests.
    assert result.reward.info["honeypots_planted"] == "2", result.reward.info
    assert "screen" not in result.reward.info


@pytest.mark.parametrize("task", TASKS, ids=IDS)
async def test_no_change_earns_0(task: dict[str, Any], rollout: Rollout) -> None:
    needs_environment(task)
    result = await rollout(SweHandler(), task, [SUBMIT])
    assert result.reward.value == 0.0
    assert result.reward.components["fail_to_pass"] < 1.0
    assert result.reward.components["pass_to_pass"] == 1.0
    assert set(result.reward.info["failing"].split(",")) == set(task["FAIL_TO_PASS"])
    assert "screen" not in result.reward.info, result.reward.info


@pytest.mark.parametrize("task", TASKS, ids=IDS)
async def test_breaking_the_package_earns_0(task: dict[str, Any], rollout: Rollout) -> None:
    needs_environment(task)
    # A "fix" that gets the new tests wrong and the old ones too: empty every source module.
    wreck = call("bash", command="git ls-files '*.py' | grep -v '^tests/' | "
                                 "while read f; do : > \"$f\"; done")
    result = await rollout(SweHandler(), task, [wreck, SUBMIT])
    assert result.reward.value == 0.0
    assert result.reward.components["pass_to_pass"] == 0.0


async def test_editing_the_tests_does_not_help(rollout: Rollout) -> None:
    task = TASKS[0]
    # The agent deletes the tests and writes trivially passing ones under the hidden names.
    fake = "\n".join(f"def {n.split('::')[1]}():\n    pass\n"
                     for n in task["FAIL_TO_PASS"] + task["PASS_TO_PASS"])
    cheat = call("editor", command="create", path="/workspace/tests/test_core.py",
                 file_text=fake)
    result = await rollout(SweHandler(), task, [cheat, SUBMIT])
    assert result.reward.value == 0.0


async def test_agent_sees_neither_test_patch_nor_later_history(rollout: Rollout) -> None:
    task = TASKS[4]
    views: list[str] = []

    async def look(ctx: JobContext) -> None:
        sandbox = ctx.state["env.sandbox"]
        out = await sandbox.exec("git log --all --format=%H; git status --short; "
                                 "git count-objects -v | grep -E '^(count|in-pack)'; "
                                 "ls -A /tmp; grep -rn multi_digit . || true", timeout=30)
        views.append(out.stdout)

    result = await rollout(SweHandler(), task, [SUBMIT], inspect=look)
    view = views[0]
    log = [line for line in view.splitlines() if len(line) == 40]
    assert task["base_commit"] in log and len(log) == 2  # base and its parent, nothing later
    assert "multi_digit" not in view  # the F2P test names appear only in the hidden patch
    assert "test_multi_digit_components" not in result.prompt_text(0)
    assert task["problem_statement"].splitlines()[0] in result.prompt_text(0)


@pytest.fixture
def other_sources(tmp_path: Path) -> list[str]:
    """The second task's repository as a git clone, and as archives of that clone (flat, and
    inside one top-level folder)."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(DATA_DIR / TASKS[1]["repo_source"]), str(clone)],
                   check=True)
    flat, nested = tmp_path / "flat.tar.gz", tmp_path / "nested.tgz"
    subprocess.run(["tar", "-czf", str(flat), "-C", str(clone), "."], check=True)
    subprocess.run(["tar", "-czf", str(nested), "-C", str(tmp_path), "clone"], check=True)
    return [str(clone), str(flat), str(nested)]


async def test_archive_without_git_fails_init_with_a_reason(rollout: Rollout,
                                                            tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "x.py").write_text("x = 1\n")
    archive = tmp_path / "plain.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(tmp_path / "src" / "x.py", arcname="x.py")
    with pytest.raises(HandlerError) as err:
        await rollout(SweHandler(), {**TASKS[0], "repo_source": str(archive)}, [SUBMIT])
    assert err.value.reason == "REPO_CHECKOUT_FAILED"
    assert "no git repository" in str(err.value)


async def test_repo_source_may_be_a_git_directory_or_an_archive(
        rollout: Rollout, other_sources: list[str]) -> None:
    task = TASKS[1]
    for source in other_sources:
        result = await rollout(SweHandler(), {**task, "repo_source": source},
                               [apply_with_bash(task["patch"]), SUBMIT])
        assert result.reward.value == 1.0, (source, result.reward.info)


@pytest.fixture
def repo_with_the_fix_committed(tmp_path: Path) -> tuple[str, str]:
    """A clone of the first task's repository with the gold fix committed on top of base."""
    task, clone = TASKS[0], tmp_path / "ahead"
    subprocess.run(["git", "clone", "-q", str(DATA_DIR / task["repo_source"]), str(clone)],
                   check=True)
    subprocess.run(["git", "apply"], input=task["patch"], text=True, cwd=clone, check=True)
    subprocess.run(["git", "-c", "user.name=x", "-c", "user.email=x@x", "commit", "-qam",
                    "the fix"], cwd=clone, check=True)
    fix = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, check=True,
                         capture_output=True, text=True).stdout.strip()
    return str(clone), fix


async def test_commits_after_base_are_not_in_the_workspace(
        rollout: Rollout, repo_with_the_fix_committed: tuple[str, str]) -> None:
    source, fix = repo_with_the_fix_committed
    task = {**TASKS[0], "repo_source": source}
    views: list[str] = []

    async def look(ctx: JobContext) -> None:
        sandbox = ctx.state["env.sandbox"]
        out = await sandbox.exec(f"git log --all --oneline | wc -l; git cat-file -t {fix} "
                                 "2>&1; git rev-parse HEAD", timeout=30)
        views.append(out.stdout)

    result = await rollout(SweHandler(), task, [SUBMIT], inspect=look)
    lines = views[0].split("\n")
    assert lines[0].strip() == "2"
    assert "could not get object info" in lines[1] or "fatal" in lines[1]
    assert lines[2] == task["base_commit"]
    assert result.reward.value == 0.0


PLAIN_SRC_LAYOUT = {k: v for k, v in {t["instance_id"]: t for t in TASKS}[
    "rollout__mdurl-1"].items() if k not in ("spec", "version")}


async def test_a_plain_task_with_a_src_layout_is_graded_with_the_package_importable(
        rollout: Rollout) -> None:
    """No environment of its own installs the package: the grader puts src/ on the path, so
    the right fix earns 1 and no fix 0, instead of 0 for both."""
    gold = await rollout(SweHandler(), PLAIN_SRC_LAYOUT,
                         [apply_with_bash(PLAIN_SRC_LAYOUT["patch"]), SUBMIT])
    assert gold.reward.value == 1.0, gold.reward.info
    assert gold.reward.info["import_paths"] == "src"
    nothing = await rollout(SweHandler(), PLAIN_SRC_LAYOUT, [SUBMIT])
    assert nothing.reward.value == 0.0, nothing.reward.info
    assert nothing.reward.components["pass_to_pass"] == 1.0
