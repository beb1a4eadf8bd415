"""swe tasks whose tests run under a runner of their own (Django's tests/runtests.py, SymPy's
bin/test, plain unittest), through the real handler and sandboxes: gold 1, no-op 0, a wrong
fix 0, and result lines the code under test prints itself earn nothing."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.grading.verdict import GradeReport, Verdict, verdict
from rollout.runtime.envs.swe import handler as swe_env
from rollout.runtime.envs.swe import runners as swe_runners
from rollout.runtime.envs.swe.handler import SweHandler
from rollout.runtime.tasksets.shipped import load_tasks
from rollout.runtime.types import InvalidArgument
from tests.runtime.envs.conftest import Rollout, call
from tests.runtime.envs.test_swe_exploits import ignore_exit_status, unprotect

pytestmark = pytest.mark.timeout(180)

TASKS = {t["instance_id"]: t for t in load_tasks("swe")}
DJANGO = TASKS["rollout__tinydj-1"]
SYMPY = TASKS["rollout__tinysym-1"]
SUBMIT = call("submit", answer="fixed")


def edit(path: str, old: str, new: str) -> str:
    return call("editor", command="str_replace", path=f"/workspace/{path}", old_str=old,
                new_str=new)


def apply(patch: str) -> str:
    return call("bash", command=f"git apply <<'PATCH_EOF'\n{patch}PATCH_EOF\n")


def as_unittest(task: dict[str, Any]) -> dict[str, Any]:
    """The Django-style task run by plain ``python -m unittest``: modules named from the
    repository root, and so are the tests."""
    def rename(name: str) -> str:
        return name.replace("(text_tests.", "(tests.text_tests.")
    return dict(task, instance_id="rollout__tinydj-unittest", test_runner="unittest",
                FAIL_TO_PASS=[rename(n) for n in task["FAIL_TO_PASS"]],
                PASS_TO_PASS=[rename(n) for n in task["PASS_TO_PASS"]])


UNITTEST = as_unittest(DJANGO)
# Plausible and wrong: the first strips the ends but keeps inner runs; the second still
# gives zero a sign.
WRONG = {
    "django": (DJANGO, edit("tinydj/text.py", 'return value.replace(" ", "-")',
                            'return value.replace(" ", "-").strip("-")')),
    "unittest": (UNITTEST, edit("tinydj/text.py", 'return value.replace(" ", "-")',
                                'return value.replace(" ", "-").strip("-")')),
    "sympy": (SYMPY, edit("tinysym/core.py", "return 1 if x > 0 else -1",
                          "return 1 if x >= 0 else -1")),
}


@pytest.mark.parametrize("runner", WRONG)
async def test_a_wrong_fix_earns_0(runner: str, rollout: Rollout) -> None:
    task, step = WRONG[runner]
    result = await rollout(SweHandler(), task, [step, SUBMIT])
    assert result.reward.value == 0.0, result.reward.info
    assert result.reward.info["runner"] == runner
    assert result.reward.info["failing"], result.reward.info
    assert "error" not in result.reward.info, result.reward.info


async def test_plain_unittest_gold_earns_1_and_no_op_0(rollout: Rollout) -> None:
    gold = await rollout(SweHandler(), UNITTEST, [apply(UNITTEST["patch"]), SUBMIT])
    assert gold.reward.value == 1.0, gold.reward.info
    assert gold.reward.info["parser"].startswith("recorder+builtin.parse_log_django")
    nothing = await rollout(SweHandler(), UNITTEST, [SUBMIT])
    assert nothing.reward.value == 0.0, nothing.reward.info
    assert set(nothing.reward.info["failing"].split(",")) == set(UNITTEST["FAIL_TO_PASS"])


async def test_a_runner_of_the_agents_own_is_not_the_one_that_runs(rollout: Rollout) -> None:
    """tests/runtests.py and bin/test are put back before the run, so a runner the agent
    rewrote to print passes earns nothing."""
    fake = ("import sys\n" + "".join(
        f"print({(n + ' ... ok')!r})\n" for n in DJANGO["FAIL_TO_PASS"] + DJANGO["PASS_TO_PASS"])
        + "sys.exit(0)\n")
    steps = [call("editor", command="create", path="/workspace/tests/runtests.py.new",
                  file_text=fake),
             call("bash", command="mv tests/runtests.py.new tests/runtests.py"), SUBMIT]
    result = await rollout(SweHandler(), DJANGO, steps)
    assert result.reward.value == 0.0, result.reward.info
    assert "tests/runtests.py" in result.reward.info["restored"].split(",")


# The package prints the result lines a fix would get when the interpreter exits: after the
# real ones, so a parser that keeps the last line reads them as passes.
PRINTED_AT_EXIT = {
    "django": (DJANGO, "tinydj/__init__.py", "print('{} ... ok')"),
    "sympy": (SYMPY, "tinysym/__init__.py", "print('{} ok')"),
}


def print_at_exit(task: dict[str, Any], path: str, line: str) -> str:
    names = task["FAIL_TO_PASS"] + task["PASS_TO_PASS"]
    body = "".join(f"    {line.format(n)}\n" for n in names)
    code = f"import atexit\n\n\n@atexit.register\ndef _passes():\n{body}"
    return call("bash", command=f"cat >> {path} <<'EOF'\n{code}EOF\n")


@pytest.mark.parametrize("runner", PRINTED_AT_EXIT)
async def test_result_lines_printed_by_the_code_under_test_earn_0(
        runner: str, rollout: Rollout) -> None:
    task, path, line = PRINTED_AT_EXIT[runner]
    result = await rollout(SweHandler(), task, [print_at_exit(task, path, line), SUBMIT])
    assert result.reward.value == 0.0, result.reward.info
    assert set(result.reward.info["failing"].split(",")) == set(task["FAIL_TO_PASS"])


@pytest.mark.parametrize("runner", PRINTED_AT_EXIT)
async def test_printed_result_lines_win_when_the_last_line_counts(
        runner: str, rollout: Rollout, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: read the way the harness's parsers read a log (the last line for a test
    wins) and without the exit-status check, the printed lines turn the bug into 1."""
    monkeypatch.setattr(swe_runners, "_worse", lambda old, new: new)
    ignore_exit_status(monkeypatch)
    task, path, line = PRINTED_AT_EXIT[runner]
    result = await rollout(SweHandler(), task, [print_at_exit(task, path, line), SUBMIT])
    assert result.reward.value == 1.0, result.reward.info


async def test_a_log_in_which_all_passed_and_a_failing_exit_status_earns_0(
        rollout: Rollout, monkeypatch: pytest.MonkeyPatch) -> None:
    """The package hides the failures from the log (a filtered stderr): the recorder's
    outcomes are not the log's, and even read from the log alone, the runner's exit status
    (unittest still exits 1) gives it away."""
    hide = ("import sys\n\n\nclass _Filter:\n"
            "    def __init__(self, stream):\n        self.stream = stream\n"
            "    def write(self, text):\n"
            "        text = 'ok' if text == 'FAIL' else text.replace('FAIL:', 'note:')\n"
            "        return self.stream.write(text)\n"
            "    def __getattr__(self, name):\n        return getattr(self.stream, name)\n\n\n"
            "sys.stderr = _Filter(sys.stderr)\n")
    step = call("bash", command=f"cat >> tinydj/__init__.py <<'EOF'\n{hide}EOF\n")
    result = await rollout(SweHandler(honeypots=False), UNITTEST, [step, SUBMIT])
    assert result.reward.value == 0.0, result.reward.info
    assert set(result.reward.info["failing"].split(",")) == set(UNITTEST["FAIL_TO_PASS"])
    monkeypatch.setattr(swe_runners, "cross_checked", lambda record, logged: logged)
    result = await rollout(SweHandler(honeypots=False), UNITTEST, [step, SUBMIT])
    assert result.reward.value == 0.0, result.reward.info
    assert "the runner's exit status (1) disagrees" in result.reward.info["error"], \
        result.reward.info


def test_runner_of_a_task() -> None:
    assert swe_runners.runner_of({"repo": "django/django"}).name == "django"
    assert swe_runners.runner_of({"repo": "sympy/sympy"}).name == "sympy"
    assert swe_runners.runner_of({"repo": "psf/requests"}).name == "pytest"
    assert swe_runners.runner_of({"repo": "x/y", "test_runner": "unittest"}).name == "unittest"
    assert swe_runners.split_test_cmd(
        "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1") == (
        "django", ("--verbosity", "2", "--settings=test_sqlite", "--parallel", "1"))
    assert swe_runners.split_test_cmd("bin/test -C --verbose") == ("sympy", ("-C", "--verbose"))
    assert swe_runners.split_test_cmd("python -m unittest -v") == ("unittest", ("-v",))
    # The harness's SymPy command starts with an assignment: it runs through env.
    runner, options = swe_runners.split_test_cmd(
        "PYTHONWARNINGS='ignore::UserWarning' bin/test -C --verbose")
    assert (runner, options) == ("sympy", ("PYTHONWARNINGS=ignore::UserWarning", "-C",
                                           "--verbose"))
    recorder = swe_runners.launcher(swe_runners.RECORDER)
    assert swe_runners.command(swe_runners.SPECS["sympy"], "python", "/w", options, ["t.py"]) \
        == ["env", "PYTHONWARNINGS=ignore::UserWarning", "python", "-c", recorder, "/w",
            "script", "bin/test", "-C", "--verbose", "t.py"]
    assert swe_runners.split_test_cmd("pytest -rA") == ("pytest", ("-rA",))
    with pytest.raises(ValueError, match="must run pytest"):
        swe_runners.split_test_cmd("tox -e py311")
    with pytest.raises(InvalidArgument, match="test_runner"):
        SweHandler().validate_task(dict(DJANGO, test_runner="nose"))


def test_test_directories_put_back_whole() -> None:
    task = {"test_patch": "".join(f"diff --git a/{f} b/{f}\n" for f in (
        "tests/admin_views/tests.py", "sympy/testing/tests/test_pytest.py",
        "testing/test_runner.py", "pkg/test_inline.py"))}
    assert swe_env.protected_paths(task, swe_runners.SPECS["pytest"], []) == [
        "pkg/test_inline.py", "sympy/testing/tests/", "sympy/testing/tests/test_pytest.py",
        "testing/", "testing/test_runner.py", "tests/", "tests/admin_views/tests.py"]


def test_directives_as_the_harness_names_them() -> None:
    files = ["tests/admin_views/tests.py", "tests/admin_views/models.py", "docs/x.txt"]
    django = swe_runners.SPECS["django"]
    assert swe_runners.directives(django, files) == ["admin_views.tests", "admin_views.models"]
    assert swe_runners.directives(swe_runners.SPECS["sympy"], ["sympy/core/tests/test_x.py"]) \
        == ["sympy/core/tests/test_x.py"]
    assert swe_runners.directives(swe_runners.SPECS["unittest"], ["tests/test_a.py"]) == \
        ["tests.test_a"]


DJANGO_LOG = """\
test_ok (app.tests.T) ... ok
test_new_style (app.tests.T.test_new_style) ... ok
test_noisy (app.tests.T) ... some output
ok
test_skip (app.tests.T) ... skipped 'no db'
test_bad (app.tests.T) ... FAIL
test_boom (app.tests.T) ... ERROR

======================================================================
FAIL: test_bad (app.tests.T)
----------------------------------------------------------------------
test_bad (app.tests.T) ... ok
"""

SYMPY_LOG = """\
sympy/core/tests/test_a.py[3]
test_one ok
test_two F
test_three E

________________________________________________________________________________
___________ sympy/core/tests/test_a.py:test_two ___________
test_two ok
"""


def test_logs_are_read_with_the_worse_outcome_kept() -> None:
    outcomes, parser = swe_runners.parse_log(swe_runners.SPECS["django"], DJANGO_LOG)
    assert parser.startswith("builtin.parse_log_django")
    assert outcomes == {
        "test_ok (app.tests.T)": "PASSED", "test_new_style (app.tests.T)": "PASSED",
        "test_noisy (app.tests.T)": "PASSED", "test_skip (app.tests.T)": "SKIPPED",
        "test_bad (app.tests.T)": "FAILED", "test_boom (app.tests.T)": "ERROR"}
    outcomes, _ = swe_runners.parse_log(swe_runners.SPECS["sympy"], SYMPY_LOG)
    assert outcomes["test_one"] == "PASSED"
    assert outcomes["test_two"] == "FAILED"  # the later "ok" does not undo it
    assert outcomes["test_three"] == "ERROR"


# Finding 4: the failures filtered out of the log, then a hang at exit, so the run times out
# with a log in which every test passed and no exit status to contradict it.
FILTER_AND_HANG = (
    "import atexit, sys, time\n\n\nclass _Filter:\n"
    "    def __init__(self, stream):\n        self.stream = stream\n"
    "    def write(self, text):\n"
    "        text = 'ok' if text == 'FAIL' else text.replace('FAIL:', 'note:')\n"
    "        return self.stream.write(text)\n"
    "    def __getattr__(self, name):\n        return getattr(self.stream, name)\n\n\n"
    "sys.stderr = _Filter(sys.stderr)\n"
    "atexit.register(time.sleep, 600)\n")


async def test_a_timed_out_run_earns_0_whatever_its_log_says(rollout: Rollout) -> None:
    step = call("bash", command=f"cat >> tinydj/__init__.py <<'EOF'\n{FILTER_AND_HANG}EOF\n")
    task = dict(UNITTEST, test_timeout_s=8)
    result = await rollout(SweHandler(), task, [step, SUBMIT])
    assert result.reward.value == 0.0, result.reward.info
    assert "timed out" in result.reward.info["error"], result.reward.info


async def test_a_timed_out_run_wins_when_graded_on_its_partial_log(
        rollout: Rollout, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control (no honeypots): graded on the partial log with the exit-status check skipped (the
    previous release), the filtered log and the hang earn 1. The screen is off: it sees the
    ``sys.stderr`` assignment."""
    def as_if_it_ended(report: GradeReport) -> Verdict:
        return verdict(dataclasses.replace(report, timed_out=False, exit_status=0,
                                           runner_status=None, problems=()))
    monkeypatch.setattr(swe_env, "verdict", as_if_it_ended)
    # The log alone, as before the recorder (which is not fooled by the filtered log).
    monkeypatch.setattr(swe_runners, "cross_checked", lambda record, logged: logged)
    step = call("bash", command=f"cat >> tinydj/__init__.py <<'EOF'\n{FILTER_AND_HANG}EOF\n")
    task = dict(UNITTEST, test_timeout_s=8)
    result = await rollout(SweHandler(honeypots=False), task, [step, SUBMIT])
    assert result.reward.value == 1.0, result.reward.info


def with_docstrings(task: dict[str, Any]) -> dict[str, Any]:
    """The Django task with its new tests named by their docstrings, as SWE-bench names some
    Django tests (the verbose log prints a test's docstring instead of its method name)."""
    docs = {"test_repeated_spaces_and_hyphens": "Runs of spaces and hyphens become one.",
            "test_surrounding_separators": "Separators at either end are dropped."}
    patch = task["test_patch"]
    for method, doc in docs.items():
        line = f"+    def {method}(self):\n"
        assert line in patch
        patch = patch.replace(line, f'{line}+        """{doc}"""\n')
    patch = re.sub(r"^@@ -(\d+),(\d+) \+(\d+),(\d+) @@",
                   lambda m: f"@@ -{m[1]},{m[2]} +{m[3]},{int(m[4]) + len(docs)} @@", patch,
                   count=1, flags=re.MULTILINE)
    return dict(task, instance_id="rollout__tinydj-docstrings", test_patch=patch,
                FAIL_TO_PASS=list(docs.values()))


DOCSTRINGS = with_docstrings(DJANGO)
# Finding 2: the library prints "ok" while a test runs, which completes the runner's
# "<docstring> ... " line; the FAIL that follows names only the method.
PRINTS_OK = edit("tinydj/text.py", 'return value.replace(" ", "-")',
                 'print("ok")\n    return value.replace(" ", "-")')


async def test_a_docstring_named_test_is_found_by_its_method_both_ways(
        rollout: Rollout) -> None:
    gold = await rollout(SweHandler(), DOCSTRINGS, [apply(DOCSTRINGS["patch"]), SUBMIT])
    assert gold.reward.value == 1.0, gold.reward.info
    forged = await rollout(SweHandler(), DOCSTRINGS, [PRINTS_OK, SUBMIT])
    assert forged.reward.value == 0.0, forged.reward.info
    assert set(forged.reward.info["failing"].split(",")) == set(DOCSTRINGS["FAIL_TO_PASS"])


async def test_control_read_from_the_log_a_printed_ok_forges_a_docstring_named_test(
        rollout: Rollout, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: outcomes from the log alone (the previous release) and the printed ``ok``
    earns 1 with the runner exiting 1."""
    monkeypatch.setattr(swe_runners, "cross_checked", lambda record, logged: logged)
    forged = await rollout(SweHandler(honeypots=False), DOCSTRINGS, [PRINTS_OK, SUBMIT])
    assert forged.reward.value == 1.0, forged.reward.info
    assert forged.reward.info["exit_status"] == "1"


# Finding 5: the shipped SymPy-style runner's own module is not in the hand list of runner
# files; made to run no test, every test "passes" and the runner exits 0.
RUNNER_RUNS_NOTHING = [
    edit("tinysym/testing/runtests.py", "            try:\n                func()\n",
         "            try:\n                pass\n"),
    edit("tinysym/testing/pytest.py", "def raises(expected, code):\n",
         "def raises(expected, code):  # helper\n"),
]
NO_DERIVED_SUPPORT = ("tree", "    support = support_modules(base, roots, patch, in_base)\n",
                      "    support = set()\n")


async def test_test_machinery_the_runner_imports_is_restored(
        rollout: Rollout, monkeypatch: pytest.MonkeyPatch) -> None:
    # The honeypots and the record of the test functions would catch it too: off, so the
    # restore alone decides.
    monkeypatch.setattr(swe_runners, "cross_checked", lambda record, logged: logged)
    result = await rollout(SweHandler(honeypots=False), SYMPY, [*RUNNER_RUNS_NOTHING, SUBMIT])
    assert result.reward.value == 0.0, result.reward.info
    restored = result.reward.info["restored"].split(",")
    assert {"tinysym/testing/runtests.py", "tinysym/testing/pytest.py"} <= set(restored)


async def test_control_a_runner_module_left_as_the_agent_made_it_earns_1(
        rollout: Rollout, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    unprotect(monkeypatch, tmp_path, NO_DERIVED_SUPPORT)
    monkeypatch.setattr(swe_runners, "cross_checked", lambda record, logged: logged)
    result = await rollout(SweHandler(honeypots=False), SYMPY, [*RUNNER_RUNS_NOTHING, SUBMIT])
    assert result.reward.value == 1.0, result.reward.info
