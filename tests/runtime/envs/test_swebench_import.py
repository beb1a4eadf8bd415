"""``import-swebench``: SWE-bench instances + local clones -> a ready task file, each instance
run through the real handler (test patch applies, FAIL_TO_PASS fails before and passes with the
gold patch), the broken ones reported with the reason."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.common import DATA_DIR
from rollout.runtime.envs.swe.handler import SweHandler
from rollout.runtime.envs.swe.taskenv import user_wheelhouses
from rollout.runtime.tasksets.shipped import fill_wheelhouse, load_tasks, main, read_task_file

pytestmark = pytest.mark.timeout(300)

TASKS = {t["instance_id"]: t for t in load_tasks("swe")}


def as_swebench(task: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """The instance as a SWE-bench export has it: no source path, no env, lists as JSON."""
    row = {k: v for k, v in task.items() if k not in ("repo_source", "test_env", "spec")}
    row["FAIL_TO_PASS"] = json.dumps(row["FAIL_TO_PASS"])
    row["PASS_TO_PASS"] = json.dumps(row["PASS_TO_PASS"])
    row["environment_setup_commit"] = row["base_commit"]
    row.update(changes)
    return row


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    repos = tmp_path / "repos"
    repos.mkdir()
    # One clone as owner__name, one as a bare bundle by name, one under owner/name.
    subprocess.run(["git", "clone", "-q", str(DATA_DIR / "swe_repos/textstats.bundle"),
                    str(repos / "rollout-service__textstats")], check=True)
    (repos / "intervals.bundle").write_bytes((DATA_DIR / "swe_repos/intervals.bundle")
                                             .read_bytes())
    (repos / "rollout-service").mkdir()
    subprocess.run(["git", "clone", "-q", str(DATA_DIR / "swe_repos/mdurl.bundle"),
                    str(repos / "rollout-service" / "mdurl")], check=True)
    textstats, intervals, mdurl = (TASKS[f"rollout__{n}-1"]
                                   for n in ("textstats", "intervals", "mdurl"))
    broken_patch = textstats["test_patch"].replace(" def test_char_count():",
                                                   " def test_chars():")
    assert broken_patch != textstats["test_patch"]
    instances = [
        as_swebench(textstats),
        as_swebench(intervals),
        as_swebench(mdurl),
        as_swebench(textstats, instance_id="bad__patch-1", test_patch=broken_patch),
        as_swebench(textstats, instance_id="bad__f2p-1",
                    FAIL_TO_PASS=json.dumps(textstats["PASS_TO_PASS"][:1])),
        as_swebench(textstats, instance_id="bad__gold-1", patch=""),
        as_swebench(textstats, instance_id="bad__repo-1", repo="nobody/nothing"),
    ]
    (tmp_path / "instances.jsonl").write_text("".join(json.dumps(i) + "\n" for i in instances))
    specs = {"rollout-service/mdurl": {"0.3": {**mdurl["spec"], "packages": "requirements.txt",
                                               "eval_commands": ["true"]}}}
    (tmp_path / "specs.json").write_text(json.dumps(specs))
    return tmp_path


def test_import_validates_and_reports(workdir: Path, capsys: pytest.CaptureFixture[str]
                                      ) -> None:
    try:
        fill_wheelhouse([TASKS["rollout__mdurl-1"]], user_wheelhouses()[0])
    except (RuntimeError, OSError) as e:
        pytest.skip(f"the wheelhouse could not be filled: {str(e)[:300]}")
    out = workdir / "tasks.jsonl"
    code = main(["import-swebench", str(workdir / "instances.jsonl"), "--repos",
                 str(workdir / "repos"), "--specs", str(workdir / "specs.json"), "--out",
                 str(out), "--state-dir", str(workdir / "state")])
    captured = capsys.readouterr()
    assert code == 0
    assert json.loads(captured.out.splitlines()[-1])["accepted"] == 3
    rejected = dict(line.removeprefix("rejected ").split(": ", 1)
                    for line in captured.err.splitlines() if line.startswith("rejected "))
    assert set(rejected) == {"bad__patch-1", "bad__f2p-1", "bad__gold-1", "bad__repo-1"}
    assert "test patch does not apply" in rejected["bad__patch-1"]
    assert "pass without the fix" in rejected["bad__f2p-1"]
    assert "gold patch" in rejected["bad__gold-1"]
    assert "no clone of 'nobody/nothing'" in rejected["bad__repo-1"]
    assert "note rollout__mdurl-1: spec keys not run here: eval_commands, packages" in captured.err

    tasks = read_task_file(out, "swe")
    assert [t["instance_id"] for t in tasks] == ["rollout__textstats-1", "rollout__intervals-1",
                                                 "rollout__mdurl-1"]
    for task in tasks:
        SweHandler().validate_task(task)
        assert isinstance(task["FAIL_TO_PASS"], list)
        assert Path(task["repo_source"]).is_absolute()
    assert tasks[2]["spec"] == TASKS["rollout__mdurl-1"]["spec"]
    assert "spec" not in tasks[0]
