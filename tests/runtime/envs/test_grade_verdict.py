"""The one grading decision, driven by hand-made reports: every reason for a 0 is a field of
:class:`GradeReport`, and :func:`verdict` weighs them all."""

from __future__ import annotations

import dataclasses

from rollout.runtime.envs.code.handler import runner_results
from rollout.runtime.envs.grading.verdict import GradeReport, Honeypots, verdict
from rollout.runtime.envs.swe.runners import parse_record, runner_outcome

F2P, P2P = ("t.py::test_new",), ("t.py::test_old",)
ALL_PASSED = {"t.py::test_new": "PASSED", "t.py::test_old": "PASSED"}
GOOD = GradeReport(F2P, P2P, ALL_PASSED, exit_status=0, runner_status=0)


def test_a_finished_run_in_which_the_named_tests_passed_earns_1() -> None:
    decided = verdict(GOOD)
    assert (decided.reward, decided.reasons, decided.failing) == (1.0, (), ())


def test_a_failing_named_test_earns_0_without_a_reason() -> None:
    decided = verdict(dataclasses.replace(
        GOOD, outcomes={**ALL_PASSED, "t.py::test_new": "FAILED"}, exit_status=1,
        runner_status=1))
    assert decided.reward == 0.0 and decided.reasons == ()
    assert decided.failing == F2P and decided.fail_to_pass == 0.0


def test_a_timed_out_run_earns_0_whatever_its_record_says() -> None:
    """Finding 4: a filtered log and a hang at exit left a record in which all passed."""
    decided = verdict(dataclasses.replace(GOOD, timed_out=True, exit_status=None,
                                          runner_status=None))
    assert decided.reward == 0.0
    assert "timed out" in decided.reasons[0]
    # Control: the same record from a run that ended earns 1.
    assert verdict(dataclasses.replace(GOOD, runner_status=None)).reward == 1.0


def test_a_run_that_did_not_reach_the_runners_end_earns_0() -> None:
    decided = verdict(dataclasses.replace(GOOD, completed=False))
    assert decided.reward == 0.0 and "own end" in decided.reasons[0]


def test_exit_statuses_must_agree_with_the_record() -> None:
    assert "disagrees" in verdict(
        dataclasses.replace(GOOD, exit_status=1, runner_status=None)).reasons[0]
    assert "not the one it recorded" in verdict(
        dataclasses.replace(GOOD, runner_status=1)).reasons[0]
    failed_but_0 = dataclasses.replace(GOOD, outcomes={**ALL_PASSED, "x": "FAILED"},
                                       runner_status=None)
    assert "exited 0" in verdict(failed_but_0).reasons[0]


def test_problems_found_outside_the_outcomes_earn_0() -> None:
    decided = verdict(dataclasses.replace(GOOD, problems=("the screen found x",)))
    assert decided.reward == 0.0 and decided.reasons == ("the screen found x",)


HONEY = Honeypots(must_fail=("t.py::test_spaces_blank",), must_pass=("t.py::test_new_tabs",))
HONEST = dataclasses.replace(GOOD, honeypots=HONEY, exit_status=1, runner_status=1, outcomes={
    **ALL_PASSED, "t.py::test_spaces_blank": "FAILED", "t.py::test_new_tabs": "PASSED"})


def test_honeypots_as_they_must_be_leave_the_reward_to_the_named_tests() -> None:
    assert verdict(HONEST).reward == 1.0


def test_a_must_fail_honeypot_recorded_passed_voids_the_run() -> None:
    forged = dataclasses.replace(HONEST, exit_status=0, runner_status=0, outcomes={
        **HONEST.outcomes, "t.py::test_spaces_blank": "PASSED"})
    decided = verdict(forged)
    assert (decided.reward, decided.void) == (0.0, "honeypot")
    assert decided.caught == ("t.py::test_spaces_blank: PASSED",)


def test_a_missing_must_pass_honeypot_voids_the_run() -> None:
    outcomes = dict(HONEST.outcomes)
    del outcomes["t.py::test_new_tabs"]
    decided = verdict(dataclasses.replace(HONEST, outcomes=outcomes))
    assert (decided.reward, decided.void) == (0.0, "honeypot")


def test_log_runners_find_tests_in_either_unittest_form() -> None:
    report = GradeReport(("test_x (app.tests.T)",), (), {"test_x (app.tests.T)": "PASSED"},
                         exit_status=0, lookup=runner_outcome)
    assert verdict(report).reward == 1.0
    assert verdict(dataclasses.replace(report, fail_to_pass=("test_x (app.tests.T.test_x)",))
                   ).reward == 1.0


def test_a_record_nested_past_the_parsers_limit_is_no_record() -> None:
    """The code under test can write the recorder's file and the runner's line; JSON nested
    past the parser's recursion limit is what a killed run leaves (no record), never a grader
    that fails: the rollout earns its 0 instead of dropping out of training."""
    deep = "[" * 3000 + "]" * 3000
    assert parse_record('{"end": true, "exitstatus": 0, "tests": ' + deep + "}") is None
    assert runner_results('{"nonce": "n", "results": ' + deep + "}", "n", 1) is None
