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

The runner's own functions are checked as well: at load (before any code under test is
imported) the plugin takes a fingerprint of each function that runs a test, makes or records
its report, or raises an outcome (``Function.runtest``, ``call_and_report``,
``TestReport.from_item_and_call``, ``pytest.xfail``/``skip``/``fail``, pluggy's hook calls,
this plugin's own hooks, ...): the object, its code object and the code's bytes. Before and
after every test and at the end of the session it compares; a test item with a ``runtest`` of
its own, and this plugin's hooks swapped out of the hook registry, count too. Anything that
differs is named in the report (``tampered``), and the grader scores the run 0. The report
also carries pytest's ``exitstatus`` (the grader compares it, and the process's exit status,
with the outcomes: a run in which every test passed exits 0).

What this cannot stop: code under test runs in this same process and could, on purpose,
reach the plugin's saved fingerprints, or overwrite the file at exit. The grader restores
every file pytest loads by configuration (conftest, ini files, ``.pth``) and the test
directories, and screens the agent's diff for code that reaches into the runner or the grader
before the run (:mod:`rollout.runtime.envs.in_sandbox.swe_grade_tree`); docs/grading.md says what
remains.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import types
from typing import TYPE_CHECKING

import _pytest.main
import _pytest.outcomes
import _pytest.python
import _pytest.reports
import _pytest.runner
import _pytest.skipping
import pluggy

_ORDER = {"MISSING": 0, "PASSED": 1, "XFAIL": 1, "XPASS": 1, "SKIPPED": 2, "FAILED": 3,
          "ERROR": 4}
_PATH = os.environ.pop("ROLLOUT_PYTEST_REPORT", "")
_FD = (os.open(_PATH, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
               0o600) if _PATH else -1)
_outcomes: dict[str, str] = {}
_tampered: list[str] = []
_ROOT = os.path.realpath(os.getcwd()) + os.sep
_GUARDED_HOOKS = ("pytest_runtest_makereport", "pytest_runtest_logreport",
                  "pytest_report_teststatus", "pytest_runtest_protocol", "pytest_runtest_call",
                  "pytest_runtest_setup", "pytest_runtest_teardown", "pytest_pyfunc_call",
                  "pytest_collection_modifyitems", "pytest_sessionfinish")
# (owner, attribute) of what runs a test, makes, counts or records its report, or raises an
# outcome. Names a pytest version lacks are skipped.
_WATCHED_NAMES = {
    _pytest.python: ("pytest_pyfunc_call",),
    _pytest.python.Function: ("runtest", "setup", "_getobj"),
    _pytest.runner: ("pytest_runtest_protocol", "runtestprotocol", "call_and_report",
                     "call_runtest_hook", "pytest_runtest_call", "pytest_runtest_setup",
                     "pytest_runtest_teardown", "pytest_runtest_makereport",
                     "check_interactive_exception", "show_test_item"),
    _pytest.runner.CallInfo: ("from_call",),
    _pytest.reports.TestReport: ("from_item_and_call", "__init__"),
    _pytest.reports.BaseReport: ("passed", "failed", "skipped"),
    _pytest.outcomes: ("fail", "skip", "xfail", "exit", "importorskip"),
    _pytest.skipping: ("pytest_runtest_setup", "pytest_runtest_call",
                       "pytest_runtest_makereport", "pytest_report_teststatus",
                       "evaluate_xfail_marks", "evaluate_skip_marks"),
    _pytest.main.Session: ("pytest_runtest_logreport", "pytest_collectreport"),
    _pytest.main: ("pytest_runtestloop", "wrap_session", "_main"),
    getattr(pluggy, "HookCaller", getattr(pluggy, "_HookCaller", object)): (
        "__call__", "call_historic", "get_hookimpls"),
    pluggy.PluginManager: ("_hookexec", "register", "subset_hook_caller"),
}
try:
    import _pytest.unittest
    _WATCHED_NAMES[_pytest.unittest.TestCaseFunction] = ("runtest", "addSuccess", "addFailure",
                                                         "addError", "addSkip")
except ImportError:  # pragma: no cover - every supported pytest has it
    pass
try:
    import pluggy._callers
    _WATCHED_NAMES[pluggy._callers] = ("_multicall",)
except ImportError:  # pragma: no cover - pluggy < 1.0
    pass


def _fingerprint(obj: object) -> tuple[object, ...]:
    """What must stay the same: the object, and for functions (or a property's getter) the
    code object, its bytes and constants, and the defaults."""
    func = getattr(obj, "fget", None) or getattr(obj, "__func__", None) or obj
    code = getattr(func, "__code__", None)
    if code is None:
        return (id(obj),)
    return (id(obj), id(func), id(code), code.co_code, repr(code.co_consts)[:2000],
            id(getattr(func, "__defaults__", None)), id(getattr(func, "__globals__", None)))


def _raw(owner: object, name: str) -> object:
    """The attribute as stored (a class's own entry, not a bound method)."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in vars(klass):
                return vars(klass)[name]
        raise AttributeError(name)
    return getattr(owner, name)


if TYPE_CHECKING:  # the task's Python may predate subscripted builtins at run time
    _Taken = dict[str, tuple[tuple[object, str], tuple[object, ...]]]


def _snapshot() -> _Taken:
    taken: _Taken = {}
    for owner, names in _WATCHED_NAMES.items():
        for name in names:
            try:
                obj = _raw(owner, name)
            except AttributeError:
                continue
            label = (f"{owner.__module__}.{owner.__qualname__}.{name}"
                     if isinstance(owner, type) else f"{getattr(owner, '__name__', '?')}.{name}")
            taken[label] = ((owner, name), _fingerprint(obj))
    return taken


def _changed(taken: _Taken) -> list[str]:
    found = []
    for label, ((owner, name), print_) in taken.items():
        try:
            now = _fingerprint(_raw(owner, name))
        except AttributeError:
            now = ()
        if now != print_:
            found.append(label)
    return found


def _tamper(what: str) -> None:
    if what not in _tampered and len(_tampered) < 50:
        _tampered.append(what)


def _record(nodeid: str, outcome: str) -> None:
    if _ORDER[outcome] >= _ORDER[_outcomes.get(nodeid, "MISSING")]:
        _outcomes[nodeid] = outcome


def _check(when: str, item: object = None) -> None:
    for label in _changed(_WATCHED):
        _tamper(f"{label} replaced ({when})")
    if item is not None and "runtest" in vars(item):
        _tamper(f"{getattr(item, 'nodeid', '?')}: the item's runtest replaced ({when})")
    if item is not None and type(item) is _pytest.python.Function and \
            _raw(type(item), "runtest") is not _WATCHED_FUNCTION_RUNTEST:
        _tamper(f"{getattr(item, 'nodeid', '?')}: Function.runtest replaced ({when})")


@pluggy.HookimplMarker("pytest")(hookwrapper=True, tryfirst=True)
def pytest_runtest_call(item):  # type: ignore[no-untyped-def]
    _check("before the test", item)
    yield
    _check("after the test", item)


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


def _own_hooks(pluginmanager) -> list[str]:  # type: ignore[no-untyped-def]
    """This plugin's hooks that are no longer registered as they were defined."""
    missing = []
    for name, func in _OWN_HOOKS.items():
        caller = getattr(pluginmanager.hook, name, None)
        impls = caller.get_hookimpls() if caller is not None else []
        if not any(impl.function is func for impl in impls):
            missing.append(f"this plugin's {name} unregistered or swapped")
    return missing


@pluggy.HookimplMarker("pytest")(trylast=True)
def pytest_sessionfinish(session, exitstatus):  # type: ignore[no-untyped-def]
    if _FD < 0:
        return
    _check("at the end of the session")
    for what in _own_hooks(session.config.pluginmanager):
        _tamper(what)
    data = json.dumps({"tests": _outcomes, "exitstatus": int(exitstatus),
                       "testsfailed": int(getattr(session, "testsfailed", 0)),
                       "tampered": _tampered,
                       "foreign_hooks": _foreign_hooks(session.config.pluginmanager)}).encode()
    os.ftruncate(_FD, 0)
    view = memoryview(data)
    offset = 0
    while offset < len(data):
        offset += os.pwrite(_FD, view[offset:], offset)
    os.close(_FD)


_OWN_HOOKS = {"pytest_runtest_logreport": pytest_runtest_logreport,
              "pytest_collectreport": pytest_collectreport,
              "pytest_runtest_call": pytest_runtest_call,
              "pytest_sessionfinish": pytest_sessionfinish}
_WATCHED_NAMES[sys.modules[__name__]] = (
    "_record", "_check", "_changed", "_fingerprint", "_raw", "_tamper", "_own_hooks",
    "_foreign_hooks", "pytest_runtest_logreport", "pytest_collectreport",
    "pytest_runtest_call", "pytest_sessionfinish", "_outcomes", "_tampered", "_ORDER")
_WATCHED_NAMES[os] = ("pwrite", "ftruncate", "close", "write")
_WATCHED_NAMES[json] = ("dumps",)
_WATCHED = _snapshot()
_WATCHED_FUNCTION_RUNTEST = _raw(_pytest.python.Function, "runtest")
