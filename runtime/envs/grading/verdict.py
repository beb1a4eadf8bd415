"""One grading decision as values: what a test run left (:class:`GradeReport`) and the one
function that turns it into a reward (:func:`verdict`).

Every reason for a 0 that no test outcome can outweigh is a field of the report, set where it
is found (the screen, the runner's fingerprints, the honeypots, the exit statuses, a timeout);
:func:`verdict` is the only place that weighs them. Tests drive it with hand-made reports, and
any grader (the swe environment's bwrap sandboxes, a SWE-bench image) fills one the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from rollout.runtime.envs.grading.pytest_log import PASSING, outcome_of

HONEYPOT = "honeypot"
"""``info.screen`` of a run the honeypots voided."""


@dataclass(frozen=True)
class Honeypots:
    """Tests the grader injected into the test files for this evaluation only."""

    must_fail: tuple[str, ...] = ()
    """Named as the runner names them; an assertion that cannot hold: recorded as passed, the
    outcomes were forged wholesale."""
    must_pass: tuple[str, ...] = ()
    """An assertion that always holds: missing from the record, the record was written by
    something that knew only the named tests."""

    @property
    def names(self) -> tuple[str, ...]:
        return (*self.must_fail, *self.must_pass)


@dataclass(frozen=True)
class GradeReport:
    """What one evaluation found, before anything is decided."""

    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    outcomes: Mapping[str, str]
    """Test name -> outcome, as recorded (``PASSED``, ``FAILED``, ...)."""
    exit_status: int | None
    """The test process's exit status (None: it was killed, or never ran)."""
    runner_status: int | None = None
    """The exit status the runner itself recorded at its own end (None: it recorded none)."""
    completed: bool = True
    """The runner reached its own end and wrote its record (a killed run did not)."""
    timed_out: bool = False
    problems: tuple[str, ...] = ()
    """Reasons for a 0 found outside the outcomes (the screen, replaced runner functions,
    outcome hooks, an unrecorded end), each a sentence."""
    honeypots: Honeypots = field(default_factory=Honeypots)
    lookup: Callable[[str, Mapping[str, str]], str] = outcome_of
    """How a named test is found among the outcomes (``MISSING`` when it is not)."""


@dataclass(frozen=True)
class Verdict:
    reward: float
    fail_to_pass: float
    """Fraction of FAIL_TO_PASS tests that passed."""
    pass_to_pass: float
    failing: tuple[str, ...]
    """Named tests that did not pass."""
    reasons: tuple[str, ...]
    """Why the reward is 0 whatever the outcomes (empty: the outcomes decided)."""
    void: str = ""
    """``honeypot`` when the honeypots voided the run."""
    caught: tuple[str, ...] = ()
    """The honeypots that gave it away, with what was recorded for each."""


def _fraction(outcomes: Mapping[str, str]) -> float:
    if not outcomes:
        return 1.0
    return sum(o in PASSING for o in outcomes.values()) / len(outcomes)


def verdict(report: GradeReport) -> Verdict:
    """Reward 1 iff every FAIL_TO_PASS and PASS_TO_PASS test PASSED, in a run that ended by
    the runner's own end within its time, whose exit statuses agree with its record, with no
    problem found and every honeypot as it must be."""
    f2p = {n: report.lookup(n, report.outcomes) for n in report.fail_to_pass}
    p2p = {n: report.lookup(n, report.outcomes) for n in report.pass_to_pass}
    failing = tuple(n for n, o in {**f2p, **p2p}.items() if o not in PASSING)
    reasons = list(report.problems)
    if report.timed_out:
        # Whatever the record holds was written by a run that did not end: a filtered log
        # and a hang at exit must not be read as a finished run.
        reasons.append("the tests timed out: a run that did not end grades 0")
    elif not report.completed:
        reasons.append("the runner did not reach its own end (killed, or ended by the code "
                       "under test): no test is recorded complete")
    elif report.exit_status is None:
        reasons.append("the test process has no exit status")
    else:
        if report.runner_status is not None and report.runner_status != report.exit_status:
            reasons.append(f"the runner's exit status ({report.exit_status}) is not the one "
                           f"it recorded at its end ({report.runner_status})")
        failed = any(o in ("FAILED", "ERROR") for o in report.outcomes.values())
        if report.exit_status != 0 and report.outcomes and not failed:
            reasons.append(f"the runner's exit status ({report.exit_status}) disagrees with "
                           "the recorded outcomes, in which every test passed")
        elif report.exit_status == 0 and failed:
            # The must-fail honeypots fail in every honest run, so an honest runner never
            # exits 0 with them.
            reasons.append("the runner exited 0 although the record holds failed tests")
    caught = [f"{n}: {o}" for n in report.honeypots.must_fail
              if (o := report.lookup(n, report.outcomes)) in ("PASSED", "XPASS")]
    caught += [f"{n}: MISSING" for n in report.honeypots.must_pass
               if report.lookup(n, report.outcomes) == "MISSING"]
    void = HONEYPOT if caught else ""
    if caught:
        reasons.append("a honeypot test the grader injected has the wrong outcome: the "
                       "outcomes were not recorded from the tests as they ran")
    resolved = not failing and not reasons
    return Verdict(1.0 if resolved else 0.0, _fraction(f2p), _fraction(p2p), failing,
                   tuple(reasons), void, tuple(caught))
