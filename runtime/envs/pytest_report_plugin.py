"""A pytest plugin that writes each test's outcome, keyed by its exact node id, to a JSON file.

Loaded by the swe grader (``-p rollout_pytest_report``, from a private directory on
``PYTHONPATH``) into the task's own pytest, whatever its version: it uses only hooks and report
attributes that pytest has had since 3.x. Why not the terminal summary: stdout is shared with
the code under test, and a summary line is easy to forge. Why not JUnit XML: its
``classname``/``name`` pair loses the node id (the mangling of paths and parameters changed
between pytest versions), and the grader must match the task's FAIL_TO_PASS ids exactly.

The report path comes from the ``ROLLOUT_PYTEST_REPORT`` environment variable. The plugin
creates the file with ``O_EXCL`` when it loads, before any conftest or test module is imported
(a file planted there beforehand makes the run fail instead of being trusted), and writes the
outcomes through that descriptor when the session finishes.

What this cannot stop: code under test runs in this same process and could, on purpose,
monkeypatch pytest or this module, or overwrite the file at exit. The grader removes every
file pytest loads by configuration (conftest, ini files, ``.pth``) before the run; source code
written to attack the test runner itself is out of this plugin's reach.
"""

from __future__ import annotations

import json
import os

_ORDER = {"MISSING": 0, "PASSED": 1, "XFAIL": 1, "XPASS": 1, "SKIPPED": 2, "FAILED": 3,
          "ERROR": 4}
_PATH = os.environ.pop("ROLLOUT_PYTEST_REPORT", "")
_FD = (os.open(_PATH, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
               0o600) if _PATH else -1)
_outcomes: dict[str, str] = {}


def _record(nodeid: str, outcome: str) -> None:
    if _ORDER[outcome] >= _ORDER[_outcomes.get(nodeid, "MISSING")]:
        _outcomes[nodeid] = outcome


def pytest_runtest_logreport(report):  # type: ignore[no-untyped-def]
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if report.passed:
            _record(report.nodeid, "XPASS" if xfail else "PASSED")
        elif report.failed:
            _record(report.nodeid, "FAILED")
        else:
            _record(report.nodeid, "XFAIL" if xfail else "SKIPPED")
    elif report.failed:  # setup or teardown
        _record(report.nodeid, "ERROR")
    elif report.skipped:  # skipped (or xfailed) in setup: no call phase follows
        _record(report.nodeid, "XFAIL" if xfail else "SKIPPED")


def pytest_collectreport(report):  # type: ignore[no-untyped-def]
    if report.failed:
        _record(report.nodeid, "ERROR")


def pytest_sessionfinish(session, exitstatus):  # type: ignore[no-untyped-def]
    if _FD < 0:
        return
    data = json.dumps({"tests": _outcomes, "exitstatus": int(exitstatus)}).encode()
    os.ftruncate(_FD, 0)
    view = memoryview(data)
    offset = 0
    while offset < len(data):
        offset += os.pwrite(_FD, view[offset:], offset)
    os.close(_FD)
