"""Per-test outcomes of a pytest run, and the SWE-bench style verdict over them.

The swe grader runs only the named tests (their node ids) and reads the outcomes from the JSON
report of :mod:`rollout.runtime.envs.in_sandbox.pytest_report_plugin`
(:func:`parse_plugin_report`), never
from stdout. The test files the named tests live in are restored to the base commit before the
run, so their ids exist; an id pytest cannot find aborts the session and every test counts as
``MISSING``, which is a failure. :func:`parse_pytest_report` reads the short test summary of
``pytest -rA`` (used by the repository generator, which runs trusted code).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

PASSING = frozenset({"PASSED"})
"""Outcomes that count as "the test passes". Only a pass: an expected failure (XFAIL), an
unexpected pass (XPASS) and a skip are failures here, though SWE-bench's grader counts XFAIL
as passing, since code under test can call ``pytest.xfail()`` or ``pytest.skip()`` in the
path a test exercises and turn its failure into one of those."""

KNOWN_OUTCOMES = frozenset({"PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS"})
_SUMMARY_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S.*?)\s*$")


def parse_pytest_report(log: str) -> dict[str, str]:
    """Map node id → outcome from the short test summary of ``pytest -rA``.

    A ``FAILED`` line reads ``FAILED path::test - message``; the message is dropped. A test that
    appears twice (a failing test whose teardown also errors) keeps its worst outcome.
    """
    outcomes: dict[str, str] = {}
    for line in log.splitlines():
        m = _SUMMARY_LINE.match(line.strip())
        if m is None:
            continue
        outcome, rest = m.groups()
        if outcome == "SKIPPED":  # "SKIPPED [1] path:line: reason" names no node id
            continue
        node = rest.split(" - ", 1)[0].strip()
        if "::" not in node:  # collection errors name a file: every test in it failed
            outcomes.setdefault(node, outcome)
            continue
        if outcomes.get(node) not in ("FAILED", "ERROR"):
            outcomes[node] = outcome
    return outcomes


@dataclass
class PluginReport:
    outcomes: dict[str, str]
    """Node id -> outcome."""
    foreign_hooks: list[str]
    """Outcome hooks the code under test registered (see the plugin); any is disqualifying."""
    tampered: list[str] = field(default_factory=list)
    """Runner functions that changed while the tests ran (see the plugin); disqualifying."""
    exitstatus: int | None = None
    """pytest's own exit status, as the session saw it."""


def parse_plugin_report(text: str) -> PluginReport | None:
    """The plugin's JSON report; None when it is not one."""
    try:
        data = json.loads(text)
        tests, foreign = data["tests"], data.get("foreign_hooks", [])
        tampered, exitstatus = data.get("tampered", []), data.get("exitstatus")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(tests, dict) or not all(
            isinstance(k, str) and v in KNOWN_OUTCOMES for k, v in tests.items()):
        return None
    if not all(isinstance(x, list) and all(isinstance(f, str) for f in x)
               for x in (foreign, tampered)):
        return None
    if exitstatus is not None and (not isinstance(exitstatus, int) or isinstance(exitstatus, bool)):
        return None
    return PluginReport(dict(tests), list(foreign), list(tampered), exitstatus)


def files_of(node_ids: Iterable[str]) -> list[str]:
    """The distinct files of some pytest node ids, in first-seen order."""
    files: dict[str, None] = {}
    for node in node_ids:
        files.setdefault(node.split("::", 1)[0], None)
    return list(files)


def outcome_of(node: str, outcomes: Mapping[str, str]) -> str:
    """The outcome of ``node``; ``MISSING`` when the log never mentions it."""
    if node in outcomes:
        return outcomes[node]
    file_outcome = outcomes.get(node.split("::", 1)[0])
    return file_outcome if file_outcome is not None else "MISSING"


@dataclass
class SweVerdict:
    """Which named tests passed; ``resolved`` is the SWE-bench criterion."""

    fail_to_pass: dict[str, str] = field(default_factory=dict)
    pass_to_pass: dict[str, str] = field(default_factory=dict)

    @property
    def resolved(self) -> bool:
        return all(o in PASSING for o in self.fail_to_pass.values()) and all(
            o in PASSING for o in self.pass_to_pass.values())

    def passed_fraction(self, which: str) -> float:
        tests = self.fail_to_pass if which == "fail_to_pass" else self.pass_to_pass
        if not tests:
            return 1.0
        return sum(o in PASSING for o in tests.values()) / len(tests)


def judge(outcomes: Mapping[str, str], fail_to_pass: Iterable[str],
          pass_to_pass: Iterable[str]) -> SweVerdict:
    return SweVerdict({n: outcome_of(n, outcomes) for n in fail_to_pass},
                      {n: outcome_of(n, outcomes) for n in pass_to_pass})
