"""Runs a unittest-based test runner for the swe grader and records each test's outcome from
the runner's own result calls. Runs INSIDE the grading sandbox, stdlib only, passed to
``python -c`` as text.

``python -c SOURCE WORKSPACE unittest [ARGS ...]`` runs ``python -m unittest ARGS``;
``python -c SOURCE WORKSPACE script PATH [ARGS ...]`` runs the repository's runner script
(Django's ``tests/runtests.py``, SymPy's ``bin/test``) as ``python PATH ARGS`` would.

Why not the log: code under test writes to the same stream, and one ``print('ok')`` completes
the runner's ``<docstring> ... `` line of a test named by its docstring. So before any
repository code can run (the repository is off ``sys.path`` until then, and the interpreter's
``unittest`` is imported first) the methods of ``unittest.TestResult`` that every result class
calls (``addSuccess``, ``addFailure``, ``addError``, ``addSkip``, ``addSubTest``, ...) are
wrapped to record the test (``method (module.Class)``, and its docstring's first line) with its
outcome. The record is written through a descriptor opened with ``O_EXCL`` at start, at the
runner's own end (its ``SystemExit``, whose status is recorded with it): a run that is killed
or ended by ``os._exit`` leaves no record, and the grader counts none of its tests complete.
Wrappers that are no longer in place at the end are named (``tampered``). A runner with no
``TestResult`` (SymPy's) still gets its end and exit status recorded.

What this cannot stop: code under test shares this process and can, on purpose, reach these
wrappers; the grader's honeypot tests catch outcomes forged wholesale (docs/grading.md).
"""
import sys

# First, before any other import: ``python -c`` puts the working directory (the repository)
# in front, where a ``json.py`` or ``unittest.py`` of the agent's would be imported instead.
if sys.path and sys.path[0] in ("", "."):
    del sys.path[0]
import json
import os
import runpy
import unittest
import unittest.result

_PATH = os.environ.pop("ROLLOUT_UNITTEST_REPORT", "")
_FD = (os.open(_PATH, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
               0o600) if _PATH else -1)
_RANK = {"PASSED": 0, "SKIPPED": 1, "XFAIL": 1, "XPASS": 2, "FAILED": 2, "ERROR": 3}
# A type comment, not an annotation: the sandbox's interpreter may predate 3.9.
_tests = {}  # type: dict[str, dict]
_RESULT = unittest.result.TestResult


def _name(test):
    method = getattr(test, "_testMethodName", None)
    if method is None:  # an error holder (setUpClass, a module that failed to import)
        return str(test)
    cls = type(test)
    return f"{method} ({cls.__module__}.{cls.__qualname__})"


def _record(test, outcome):
    name = _name(test)
    entry = _tests.setdefault(name, {"outcome": outcome, "doc": ""})
    if _RANK[outcome] > _RANK[entry["outcome"]]:
        entry["outcome"] = outcome
    try:
        doc = test.shortDescription() if hasattr(test, "shortDescription") else None
    except Exception:
        doc = None
    if doc:
        entry["doc"] = str(doc).strip()


def _wrap(method, outcome):
    original = getattr(_RESULT, method)

    def recording(self, test, *args):
        if method == "addSubTest":
            if args[1] is not None:  # a failing subtest fails its test
                failed = issubclass(args[1][0], self.failureException)
                _record(test, "FAILED" if failed else "ERROR")
        else:
            _record(test, outcome)
        return original(self, test, *args)

    recording.__name__ = method
    return recording


_WRAPPED = {}
for _method, _outcome in (("addSuccess", "PASSED"), ("addFailure", "FAILED"),
                          ("addError", "ERROR"), ("addSkip", "SKIPPED"),
                          ("addExpectedFailure", "XFAIL"),
                          ("addUnexpectedSuccess", "XPASS"), ("addSubTest", "")):
    _WRAPPED[_method] = _wrap(_method, _outcome)
    setattr(_RESULT, _method, _WRAPPED[_method])


def _finish(status):
    if _FD < 0:
        return
    tampered = [m for m, f in _WRAPPED.items() if _RESULT.__dict__.get(m) is not f]
    data = json.dumps({"tests": _tests, "exitstatus": status, "end": True,
                       "tampered": tampered}).encode()
    view, offset = memoryview(data), 0
    while offset < len(data):
        offset += os.pwrite(_FD, view[offset:], offset)
    os.close(_FD)


def _status(code):
    if code is None:
        return 0
    return int(code) if isinstance(code, int) else 1  # sys.exit(True) is status 1


def main(argv):
    workspace, kind, args = argv[1], argv[2], argv[3:]
    if kind == "unittest":
        sys.path.insert(0, workspace)

        def run():
            unittest.main(module=None, argv=["python -m unittest", *args])
    else:
        script = os.path.abspath(args[0])
        sys.path.insert(0, os.path.dirname(script))  # as ``python SCRIPT`` puts it
        sys.argv[:] = args

        def run():
            runpy.run_path(script, run_name="__main__")
    try:
        run()
    except SystemExit as e:
        _finish(_status(e.code))
        raise
    _finish(0)


main(sys.argv)
