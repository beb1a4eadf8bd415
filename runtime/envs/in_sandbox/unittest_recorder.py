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
Wrappers that are no longer in place at the end are named (``tampered``).

SymPy's runner has no ``TestResult``: its test functions are called by the runner itself. For
it (``trace`` in ``ROLLOUT_START``: the test files the runner is told to run) a trace function
registered before any test module is imported records each ``test_*`` function of those files
that the runner calls (not one a test calls): returned -> PASSED, ``AssertionError`` -> FAILED,
SymPy's ``Skipped`` / ``XFail`` / ``XPass`` -> SKIPPED / XFAIL / XPASS, anything else -> ERROR;
whether the frame returned or raised is read from its last instruction, so a ``finally`` or a
caught exception inside the test changes nothing. Only frames of those files are traced
line-free; every other call costs one check of its file name.

The runner starts with the repository off ``sys.path`` (``runner_start.py``, whose text comes
first): the interpreter's ``unittest`` is imported and wrapped before the repository's
directories are put back.

What this cannot stop: code under test shares this process and can, on purpose, reach these
wrappers; the grader's honeypot tests catch outcomes forged wholesale (docs/grading.md).
"""
import dis
import json
import os
import runpy
import sys
import unittest
import unittest.loader
import unittest.result
import unittest.runner
import unittest.suite

_start = globals()["_start"]  # runner_start.py's, whose text comes first
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


def _fingerprint(obj):
    """The object, and for a function its code object and the code's bytes."""
    func = getattr(obj, "__func__", obj)
    code = getattr(func, "__code__", None)
    return (id(obj),) if code is None else (id(obj), id(code), code.co_code)


# What runs a test and hands its outcome to the result, taken before any code of the
# repository can run; names a Python lacks are skipped.
_WATCHED = {}
for _owner, _names in ((unittest.case.TestCase, ("run", "__call__", "_callTestMethod",
                                                 "_callSetUp", "_callTearDown", "doCleanups")),
                       (unittest.suite.BaseTestSuite, ("run", "__call__")),
                       (unittest.suite.TestSuite, ("run", "__call__", "_handleClassSetUp")),
                       (unittest.result.TestResult, ("startTest", "stopTest")),
                       (unittest.runner.TextTestRunner, ("run",)),
                       (unittest.loader.TestLoader, ("loadTestsFromTestCase",))):
    for _attr in _names:
        if _attr in vars(_owner):
            _WATCHED[f"{_owner.__module__}.{_owner.__qualname__}.{_attr}"] = (
                _owner, _attr, _fingerprint(vars(_owner)[_attr]))


def _finish(status):
    if _FD < 0:
        return
    tampered = [m for m, f in _WRAPPED.items() if _RESULT.__dict__.get(m) is not f]
    if _FILES and sys.gettrace() is not _tracer:
        tampered.append("the recorder's trace function")
    tampered += [f"{label} replaced" for label, (owner, name, taken) in _WATCHED.items()
                 if name not in vars(owner) or _fingerprint(vars(owner)[name]) != taken]
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


_TRACED = {}  # type: dict[str, bool]
_FILES = set()  # type: set[str]
_OUTCOME_OF = {"AssertionError": "FAILED", "Skipped": "SKIPPED", "XFail": "XFAIL",
               "XPass": "XPASS"}
_RETURNS = {dis.opmap[n] for n in ("RETURN_VALUE", "RETURN_CONST") if n in dis.opmap}
_raised = {}  # type: dict[int, str]


def _is_test(code):
    """A test function of the traced files (each file's verdict cached by its name)."""
    if not code.co_name.startswith("test") or code.co_flags & 0x2A0:  # generator, coroutine
        return False
    known = _TRACED.get(code.co_filename)
    if known is None:
        known = _TRACED[code.co_filename] = os.path.realpath(code.co_filename) in _FILES
    return known


def _returned(frame, event, arg):
    if event == "exception":
        _raised[id(frame)] = getattr(arg[0], "__name__", "")
    elif event == "return":
        raised = _raised.pop(id(frame), "")
        code, at = frame.f_code.co_code, frame.f_lasti
        if 0 <= at < len(code) and code[at] in _RETURNS:
            outcome = "PASSED"
        else:
            outcome = _OUTCOME_OF.get(raised, "ERROR")
        entry = _tests.setdefault(frame.f_code.co_name, {"outcome": outcome, "doc": ""})
        if _RANK[outcome] > _RANK[entry["outcome"]]:
            entry["outcome"] = outcome
    return _returned


def _tracer(frame, event, arg):
    if event != "call" or not _is_test(frame.f_code):
        return None
    caller = frame.f_back
    if caller is not None and _is_test(caller.f_code):
        return None  # a test function a test calls is not a test the runner ran
    try:
        frame.f_trace_lines = False
    except AttributeError:  # Python < 3.7 has no per-frame switch
        pass
    return _returned


def main(argv):
    workspace, kind, args = argv[1], argv[2], argv[3:]
    traced = json.loads(os.environ.get("ROLLOUT_START", "{}") or "{}").get("trace", [])
    if kind == "unittest":
        _start.reopen(front=[workspace])

        def run():
            unittest.main(module=None, argv=["python -m unittest", *args])
    else:
        script = os.path.abspath(args[0])
        # As ``python SCRIPT`` puts it; the repository's root is probed too: Django's and
        # SymPy's runner scripts put it on sys.path themselves.
        _start.reopen(front=[os.path.dirname(script)], probe=[workspace])
        sys.argv[:] = args

        def run():
            runpy.run_path(script, run_name="__main__")
    if traced:
        _FILES.update(os.path.realpath(os.path.join(workspace, p)) for p in traced)
        sys.settrace(_tracer)
    try:
        run()
    except SystemExit as e:
        _finish(_status(e.code))
        raise
    _finish(0)


main(sys.argv)
