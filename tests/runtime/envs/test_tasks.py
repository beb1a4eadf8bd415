"""Shipped task sets, job lines for `rollout submit`, task validation, pytest log parsing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.code.handler import CodeHandler
from rollout.runtime.envs.common import DATA_DIR
from rollout.runtime.envs.grading.pytest_log import judge, parse_pytest_report
from rollout.runtime.envs.math.handler import MathHandler
from rollout.runtime.envs.swe.handler import SweHandler, patched_files
from rollout.runtime.handler import HandlerRegistry
from rollout.runtime.tasksets.shipped import job_lines, load_tasks, main, read_task_file
from rollout.runtime.types import InvalidArgument

pytestmark = pytest.mark.timeout(60)

HANDLERS = {"math": MathHandler(), "code": CodeHandler(), "swe": SweHandler()}
REPO_ROOT = Path(__file__).resolve().parents[3]


def test_shipped_sets_have_the_promised_sizes_and_validate() -> None:
    sizes = {env: len(load_tasks(env)) for env in HANDLERS}
    assert sizes["math"] >= 20 and sizes["code"] >= 10 and sizes["swe"] >= 5
    for env, handler in HANDLERS.items():
        tasks = load_tasks(env)
        keys = [t.get("id") or t.get("instance_id") for t in tasks]
        assert len(set(keys)) == len(keys), f"duplicate ids in {env}"
        for task in tasks:
            handler.validate_task(task)


def test_shipped_lines_are_submit_ready_job_lines() -> None:
    for env in HANDLERS:
        for line in (DATA_DIR / f"{env}.jsonl").read_text().splitlines():
            row = json.loads(line)
            assert set(row) == {"environment", "task"} and row["environment"] == env


def test_entry_points_name_the_handlers() -> None:
    registry = HandlerRegistry()
    for env, handler in HANDLERS.items():
        registry.register(env, type(handler))
        assert registry.get(env).name == env


def test_bare_task_files_and_job_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    bare = tmp_path / "mine.jsonl"
    bare.write_text('{"question": "1+1?", "answer": "2"}\n\n{"question": "2+2?", "answer": "4"}\n')
    tasks = read_task_file(bare)
    assert [t["answer"] for t in tasks] == ["2", "4"]
    lines = job_lines("math", tasks, samples=2, job_id_prefix="run1-",
                      sampling={"temperature": 0.7})
    assert [line.get("job_id") for line in lines] == ["run1-0-0", "run1-0-1", "run1-1-0",
                                                      "run1-1-1"]
    assert lines[0] == {"environment": "math", "task": tasks[0], "job_id": "run1-0-0",
                        "sampling": {"temperature": 0.7}}
    assert main(["swe", "--job-id-prefix", "t-"]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert out[0]["job_id"] == "t-rollout__textstats-1-0" and out[0]["environment"] == "swe"


BAD_TASKS: list[tuple[str, dict[str, Any], str]] = [
    ("math", {"answer": "1"}, "task.question"),
    ("math", {"question": "q", "answer": 3}, "task.answer"),
    ("math", {"question": "q", "answer": "1", "tools": ["rm"]}, "task.tools"),
    ("code", {"prompt": "p"}, "task.tests"),
    ("code", {"prompt": "p", "mode": "function", "tests": [{"code": "1"}]}, "task.entry_point"),
    ("code", {"prompt": "p", "mode": "gui", "tests": []}, "task.mode"),
    ("code", {"prompt": "p", "tests": [{"code": "assert 1"}]}, "task.tests[0]"),
    ("code", {"prompt": "p", "solution_file": "../x.py", "tests": [{"input": "", "output": ""}]},
     "task.solution_file"),
    ("code", {"prompt": "p", "reward_mode": "best", "tests": [{"input": "", "output": ""}]},
     "task.reward_mode"),
    ("swe", {}, "task.instance_id"),
    ("swe", {"base_commit": "xyz"}, "task.base_commit"),
    ("swe", {"repo_source": "swe_repos/nope.bundle"}, "task.repo_source"),
    ("swe", {"FAIL_TO_PASS": []}, "task.FAIL_TO_PASS"),
    ("swe", {"PASS_TO_PASS": "not json"}, "task.PASS_TO_PASS"),
]


@pytest.mark.parametrize(("env", "change", "field"), BAD_TASKS)
def test_invalid_tasks_name_the_field(env: str, change: dict[str, Any], field: str) -> None:
    base: dict[str, Any] = dict(load_tasks(env)[0]) if env == "swe" else {}
    task = {**base, **change}
    if env == "swe" and not change:
        task.pop("instance_id")
    with pytest.raises(InvalidArgument) as err:
        HANDLERS[env].validate_task(task)
    assert err.value.reason == "INVALID_TASK"
    assert err.value.field == field, str(err.value)
    assert field.removeprefix("task.").split("[")[0] in str(err.value)


def test_non_object_task_is_rejected() -> None:
    for handler in HANDLERS.values():
        with pytest.raises(InvalidArgument, match="JSON object"):
            handler.validate_task(["not", "a", "dict"])  # type: ignore[arg-type]


def test_swe_bench_json_string_lists_are_accepted() -> None:
    task = dict(load_tasks("swe")[0])
    task["FAIL_TO_PASS"] = json.dumps(task["FAIL_TO_PASS"])
    SweHandler().validate_task(task)


PYTEST_LOG = """
tests/test_a.py::test_x PASSED
=========================== short test summary info ============================
PASSED tests/test_a.py::test_ok
PASSED tests/test_a.py::test_param[a - b]
FAILED tests/test_a.py::test_bad - AssertionError: assert 1 == 2
ERROR tests/test_a.py::test_fixture - RuntimeError: boom
XFAIL tests/test_a.py::test_expected - reason
XPASS tests/test_a.py::test_surprise
SKIPPED [1] tests/test_a.py:10: no network
ERROR tests/test_broken.py - ImportError: nope
FAILED tests/test_a.py::test_ok - teardown failed
"""


def test_parse_pytest_report() -> None:
    outcomes = parse_pytest_report(PYTEST_LOG)
    assert outcomes == {
        "tests/test_a.py::test_ok": "FAILED", "tests/test_a.py::test_param[a": "PASSED",
        "tests/test_a.py::test_bad": "FAILED", "tests/test_a.py::test_fixture": "ERROR",
        "tests/test_a.py::test_expected": "XFAIL", "tests/test_a.py::test_surprise": "XPASS",
        "tests/test_broken.py": "ERROR"}
    verdict = judge(outcomes, ["tests/test_a.py::test_expected"],
                    ["tests/test_a.py::test_param[a", "tests/test_broken.py::test_y"])
    assert verdict.pass_to_pass["tests/test_broken.py::test_y"] == "ERROR"
    assert not verdict.resolved
    # Only a pass passes: an expected failure does not (code under test can call xfail()).
    assert not judge(outcomes, ["tests/test_a.py::test_expected"], []).resolved
    assert judge(outcomes, ["tests/test_a.py::test_gone"], []).fail_to_pass == {
        "tests/test_a.py::test_gone": "MISSING"}


def test_patched_files_of_a_diff() -> None:
    task = load_tasks("swe")[0]
    assert patched_files(task["test_patch"]) == ["tests/test_core.py"]
    assert patched_files(task["patch"]) == ["textstats/core.py"]


@pytest.mark.timeout(120)
def test_swe_repo_generator_is_deterministic() -> None:
    """Rebuilding the repositories from the script gives the shipped swe.jsonl exactly."""
    proc = subprocess.run([sys.executable, "scripts/build_swe_repos.py", "--check"],
                          cwd=REPO_ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
