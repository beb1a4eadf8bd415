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

The report also names every implementation of a hook that decides or reports an outcome
(``pytest_runtest_makereport``, ``pytest_pyfunc_call``, ...) that lives in the repository under
test but not in a ``conftest.py`` (the grader restored those to the base commit): code under
test that registers such a hook at import is rewriting its own verdict, and the grader scores
that run 0.

What this cannot stop: code under test runs in this same process and could, on purpose,
monkeypatch pytest's internals or this module, or overwrite the file at exit. The grader
removes every file pytest loads by configuration (conftest, ini files, ``.pth``) before the
run; source code written to attack the test runner itself is beyond a plugin's reach.
"""

from __future__ import annotations

import inspect
import json
import os
import types

_ORDER = {"MISSING": 0, "PASSED": 1, "XFAIL": 1, "XPASS": 1, "SKIPPED": 2, "FAILED": 3,
          "ERROR": 4}
_PATH = os.environ.pop("ROLLOUT_PYTEST_REPORT", "")
_FD = (os.open(_PATH, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
               0o600) if _PATH else -1)
_outcomes: dict[str, str] = {}
_ROOT = os.path.realpath(os.getcwd()) + os.sep
_GUARDED_HOOKS = ("pytest_runtest_makereport", "pytest_runtest_logreport",
                  "pytest_report_teststatus", "pytest_runtest_protocol", "pytest_runtest_call",
                  "pytest_runtest_setup", "pytest_runtest_teardown", "pytest_pyfunc_call",
                  "pytest_collection_modifyitems", "pytest_sessionfinish")


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


def _foreign_hooks(pluginmanager) -> list[str]:  # type: ignore[no-untyped-def]
    """Outcome hooks implemented in the repository outside a conftest.py."""
    found = []
    for name in _GUARDED_HOOKS:
        caller = getattr(pluginmanager.hook, name, None)
        for impl in caller.get_hookimpls() if caller is not None else ():
            try:
                path = os.path.realpath(inspect.getfile(impl.function))
            except (TypeError, OSError):
                path = "<unknown>"
            module = impl.plugin.__name__ if isinstance(impl.plugin, types.ModuleType) else ""
            if module == "pytest" or module.startswith("_pytest."):
                continue  # pytest's own (under test itself when the repository is pytest)
            if path == "<unknown>" or (path.startswith(_ROOT)
                                       and os.path.basename(path) != "conftest.py"):
                found.append(f"{name} in {path}")
    return found


def pytest_sessionfinish(session, exitstatus):  # type: ignore[no-untyped-def]
    if _FD < 0:
        return
    data = json.dumps({"tests": _outcomes, "exitstatus": int(exitstatus),
                       "foreign_hooks": _foreign_hooks(session.config.pluginmanager)}).encode()
    os.ftruncate(_FD, 0)
    view = memoryview(data)
    offset = 0
    while offset < len(data):
        offset += os.pwrite(_FD, view[offset:], offset)
    os.close(_FD)
