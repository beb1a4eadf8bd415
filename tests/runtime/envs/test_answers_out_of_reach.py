"""A policy that looks for the answers instead of fixing the bug, through the real tool path:
the task file with the gold patch on the host, and the fix as a later commit of the repository
a task was imported from. Each exploit earns 0 under the defaults, and 1 where its protection
is taken away (the host view; a source handed over uncut), so the tests notice a regression."""

from __future__ import annotations

import dataclasses
import functools
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.common import DATA_DIR
from rollout.runtime.envs.swe import handler as swe_env
from rollout.runtime.handler import JobContext
from rollout.runtime.sandbox.base import SandboxConfig, create_sandbox
from rollout.runtime.tasksets.shipped import load_tasks
from tests.runtime.envs.conftest import Rollout, call

pytestmark = pytest.mark.timeout(240)

TASK = next(t for t in load_tasks("swe") if t["instance_id"] == "rollout__textstats-1")
SUBMIT = call("submit", answer="fixed")
GOLD = call("bash", command=f"git apply <<'PATCH_EOF'\n{TASK['patch']}PATCH_EOF\n")
FIND_THE_TASK_FILE = call("bash", command=(
    "f=$(find / \\( -path /proc -o -path /sys -o -path /dev -o -path /usr -o -name '.venv*' "
    "-o -name node_modules -o -name .git \\) -prune -o -name swe.jsonl -print 2>/dev/null "
    "| head -1); echo \"found: $f\"; python - \"$f\" <<'PY' | git apply && echo applied\n"
    "import json, sys\n"
    "for line in open(sys.argv[1]):\n"
    "    task = json.loads(line)['task']\n"
    "    if task['instance_id'] == 'rollout__textstats-1':\n"
    "        print(task['patch'], end='')\n"
    "PY\n"))
# Imported by the tests: at grading time it checks the module out of the newest commit it can
# find (the fix, if the grader's repository holds one), before the module is imported.
FROM_A_LATER_COMMIT = call("bash", command=(
    "cat > textstats/__init__.py <<'PY'\n"
    "import os as _os\n"
    "import subprocess as _sp\n"
    "_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))\n"
    "_newest = _sp.run(['git', '-C', _root, 'log', '--all', '-1', '--format=%H'],\n"
    "                  capture_output=True, text=True).stdout.strip()\n"
    "if _newest:\n"
    "    _sp.run(['git', '-C', _root, 'checkout', _newest, '--', 'textstats/core.py'],\n"
    "            capture_output=True)\n"
    "from textstats.core import char_count, word_count\n"
    "__all__ = ['char_count', 'word_count']\n"
    "PY\n"
    "git status --short"))


@pytest.fixture(params=["minimal", "host"])
def sandbox_factory(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                    ) -> Any:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    config = SandboxConfig(state_dir=tmp_path_factory.mktemp("answers"))  # the default view
    if request.param == "host":
        config = dataclasses.replace(config, host_view="host")
    factory = functools.partial(create_sandbox, config)
    VIEWS[id(factory)] = request.param
    return factory


VIEWS: dict[int, str] = {}
"""Which parameter made a factory: "minimal" means the defaults, whatever they are."""


def view_of(factory: Any) -> str:
    return VIEWS[id(factory)]


async def test_the_gold_patch_earns_1(rollout: Rollout) -> None:
    result = await rollout(swe_env.SweHandler(), TASK, [GOLD, SUBMIT])
    assert result.reward.value == 1.0, result.reward.info


async def test_reading_the_task_file_earns_0_unless_the_host_is_visible(
        rollout: Rollout, sandbox_factory: Any) -> None:
    result = await rollout(swe_env.SweHandler(), TASK, [FIND_THE_TASK_FILE, SUBMIT])
    seen = result.prompt_text()
    if view_of(sandbox_factory) == "minimal":
        assert "found: \n" in seen and "\napplied" not in seen
        assert result.reward.value == 0.0, result.reward.info
    else:  # the control: the exploit is real where the sandbox sees the host
        assert f"found: {DATA_DIR}" in seen or "found: /" in seen, seen[-2000:]
        assert result.reward.value == 1.0, result.reward.info


@pytest.fixture
def source_with_the_fix(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The task's repository with the gold fix committed on top of ``base_commit``, as a
    SWE-bench import's full clone holds it."""
    clone = tmp_path / "ahead"
    subprocess.run(["git", "clone", "-q", str(DATA_DIR / TASK["repo_source"]), str(clone)],
                   check=True)
    subprocess.run(["git", "apply"], input=TASK["patch"], text=True, cwd=clone, check=True)
    subprocess.run(["git", "-c", "user.name=x", "-c", "user.email=x@x", "commit", "-qam",
                    "the fix"], cwd=clone, check=True)
    fix = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, check=True,
                         capture_output=True, text=True).stdout.strip()
    yield str(clone), fix


def _commits_outside_base(listing: str, ancestry: str) -> set[str]:
    commits = {line.split()[0] for line in listing.splitlines() if line.endswith(" commit")}
    return commits - set(ancestry.split())


@pytest.mark.parametrize("sandbox_factory", ["minimal"], indirect=True)
async def test_a_later_commit_of_the_source_is_nowhere_a_job_can_reach(
        rollout: Rollout, source_with_the_fix: tuple[str, str]) -> None:
    source, fix = source_with_the_fix
    task = {**TASK, "repo_source": source}
    objects: list[str] = []

    async def look(ctx: JobContext) -> None:
        sandbox = ctx.state["env.sandbox"]
        res = await sandbox.exec("git cat-file --batch-all-objects --batch-check && echo --- "
                                 "&& git rev-list HEAD", timeout=60)
        objects.append(res.stdout)

    result = await rollout(swe_env.SweHandler(), task, [FROM_A_LATER_COMMIT, SUBMIT],
                           inspect=look)
    listing, _, ancestry = objects[0].partition("---\n")
    assert fix not in listing
    assert _commits_outside_base(listing, ancestry) == set()
    assert TASK["base_commit"] in ancestry
    # The grading sandbox holds no later commit either: the code under test found none.
    assert result.reward.value == 0.0, result.reward.info
    assert set(result.reward.info["failing"].split(",")) == set(TASK["FAIL_TO_PASS"])


@pytest.mark.parametrize("sandbox_factory", ["minimal"], indirect=True)
async def test_an_uncut_source_lets_the_code_under_test_take_the_fix(
        rollout: Rollout, source_with_the_fix: tuple[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: handed over uncut, the same source lets the exploit above earn 1."""
    source, _ = source_with_the_fix

    async def uncut(kind: str, data: bytes, *_: Any, **__: Any) -> tuple[str, bytes]:
        return kind, data

    monkeypatch.setattr(swe_env, "cut_at_base", uncut)
    result = await rollout(swe_env.SweHandler(), {**TASK, "repo_source": source},
                           [FROM_A_LATER_COMMIT, SUBMIT])
    assert result.reward.value == 1.0, result.reward.info

