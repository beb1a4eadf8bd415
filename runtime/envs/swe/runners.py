"""The test runners a swe task may use besides pytest, the way the SWE-bench harness runs them:
Django's ``tests/runtests.py``, SymPy's ``bin/test`` and plain ``unittest``.

Which one runs: the task's ``test_runner`` field (``pytest``, ``django``, ``sympy``,
``unittest``), else what its ``spec.test_cmd`` starts with (``./tests/runtests.py ...``,
``bin/test ...``, ``python -m unittest ...``), else the repository (``django/django``,
``sympy/sympy``), else pytest. The SWE-bench harness names the tests to run by the files of the
test patch (its "test directives"): Django labels (``tests/admin_views/tests.py`` ->
``admin_views.tests``), SymPy paths, unittest module names. FAIL_TO_PASS and PASS_TO_PASS then
name tests the way the runner's log does, and the log is read with the harness's own parser
(``swebench.harness.log_parsers``) when the ``swebench`` package is installed, else with the
same rules written out here (:func:`parse_unittest_log`, :func:`parse_sympy_log`).

Names in a unittest log changed with Python 3.11 (``test_x (mod.Class)`` became
``test_x (mod.Class.test_x)``); both sides are compared in the older form, which SWE-bench's
lists use.

What a log cannot prove: code under test writes to the same stdout, so a result line it prints
after the real one wins. The grader's other checks still hold (files restored, the diff
screen, the runner's exit status against a log in which everything passed); see
``docs/grading.md``.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUNNERS = ("pytest", "django", "sympy", "unittest")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_BY_REPO = {"django/django": "django", "sympy/sympy": "sympy"}

RECORDER = Path(__file__).resolve().parents[1] / "in_sandbox" / "unittest_recorder.py"
"""``python -c`` text (after :data:`START`'s) that starts a runner with the repository off
``sys.path`` until unittest is imported and its result methods record each outcome (SymPy's:
a trace of its test functions; see the script)."""
START = Path(__file__).resolve().parents[1] / "in_sandbox" / "runner_start.py"
"""Text in front of every launcher: the repository off ``sys.path`` until the runner's
fingerprints are taken, then a probe for modules the repository shadows (see the script)."""
REPORT_VAR = "ROLLOUT_UNITTEST_REPORT"
START_VAR = "ROLLOUT_START"
REFUSED = 86
"""The exit status of a run that ``runner_start.py`` refused before any code of the repository
ran; each reason on a stderr line after :data:`REFUSED_MARK`."""
REFUSED_MARK = "rollout-start refused: "


def launcher(source: Path) -> str:
    """``python -c`` text of a launcher: :data:`START`'s first."""
    return START.read_text() + "\n" + source.read_text()


def refusals(exit_code: int, output: str) -> list[str]:
    """Why :data:`START` refused the run (empty: it did not)."""
    if exit_code != REFUSED:
        return []
    return [line.split(REFUSED_MARK, 1)[1].strip() for line in output.splitlines()
            if REFUSED_MARK in line][:20]


@dataclass(frozen=True)
class Runner:
    name: str
    script: str
    """The repository's runner script ('' for none: pytest, unittest)."""
    options: tuple[str, ...]
    """Options every run gets (the harness's), before the task's own."""
    protect: tuple[str, ...]
    """The runner's own files in the repository, put back to ``base_commit`` before a run
    (the test directories are put back as well)."""


SPECS = {
    "pytest": Runner("pytest", "", (), ()),
    "django": Runner("django", "tests/runtests.py", ("--verbosity", "2", "--parallel", "1"),
                     ("tests/runtests.py", "tests/test_sqlite.py", "tests/urls.py")),
    "sympy": Runner("sympy", "bin/test", ("-C", "--verbose"),
                    ("bin/test", "sympy/testing/runtests.py", "sympy/utilities/runtests.py",
                     "sympy/testing/pytest.py", "sympy/utilities/pytest.py")),
    "unittest": Runner("unittest", "", ("-v",), ()),
}


def split_test_cmd(test_cmd: str) -> tuple[str, tuple[str, ...]]:
    """(runner, options) of a SWE-bench ``test_cmd``; ("", ()) for an empty one. The runner
    itself is always the grader's; only the options are kept (they replace the runner's
    default :attr:`Runner.options`)."""
    words = shlex.split(test_cmd)
    # Leading NAME=value words (the harness's SymPy command sets PYTHONWARNINGS) stay in
    # front of the options; command() runs them through env.
    assignments = []
    while words and _ASSIGNMENT.match(words[0]):
        assignments.append(words.pop(0))
    if words[:1] in (["python"], ["python3"]) and words[1:2] != ["-m"]:
        words = words[1:]  # "python tests/runtests.py ..."
    prefixes = (("pytest", ["pytest"]), ("pytest", ["py.test"]),
                ("pytest", ["python", "-m", "pytest"]), ("pytest", ["python3", "-m", "pytest"]),
                ("unittest", ["python", "-m", "unittest"]),
                ("unittest", ["python3", "-m", "unittest"]),
                ("django", ["./tests/runtests.py"]), ("django", ["tests/runtests.py"]),
                ("sympy", ["bin/test"]), ("sympy", ["./bin/test"]))
    for runner, prefix in prefixes:
        if words[:len(prefix)] == prefix:
            return runner, (*assignments, *words[len(prefix):])
    if not words:
        return "", ()
    raise ValueError(f"'spec.test_cmd' must run pytest ('pytest ...', 'python -m pytest ...'), "
                     f"Django's './tests/runtests.py ...', SymPy's 'bin/test ...' or "
                     f"'python -m unittest ...', got {test_cmd!r}")


def runner_of(task: Mapping[str, Any], from_test_cmd: str = "") -> Runner:
    """The task's runner (see the module docstring); ValueError names a bad field."""
    name = task.get("test_runner")
    if name is not None:
        if name not in RUNNERS:
            raise ValueError(f"swe task field 'test_runner' must be one of {list(RUNNERS)}, "
                             f"got {name!r}")
        return SPECS[str(name)]
    if from_test_cmd:
        return SPECS[from_test_cmd]
    return SPECS[_BY_REPO.get(str(task.get("repo", "")), "pytest")]


def directives(runner: Runner, test_files: list[str]) -> list[str]:
    """What the runner is told to run: the test patch's Python files, named its way."""
    files = [f for f in test_files if f.endswith(".py")]
    if runner.name == "django":
        return [_dotted(f[len("tests/"):] if f.startswith("tests/") else f) for f in files]
    if runner.name == "unittest":
        return [_dotted(f) for f in files]
    return files


def _dotted(path: str) -> str:
    return path[:-len(".py")].replace("/", ".")


def command(runner: Runner, python: str, workspace: str, options: tuple[str, ...] | None,
            tests: list[str]) -> list[str]:
    """The run of a non-pytest runner: ``options`` from the task's ``test_cmd`` (None: the
    runner's defaults), then the tests."""
    env, opts = split_assignments(runner.options if options is None else options)
    prefix = ["env", *env] if env else []
    start = [*prefix, python, "-c", launcher(RECORDER), workspace]
    if runner.name == "unittest":
        return [*start, "unittest", *opts, *tests]
    return [*start, "script", runner.script, *opts, *tests]


def split_assignments(options: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(the leading ``NAME=value`` words, the options after them)."""
    n = 0
    while n < len(options) and _ASSIGNMENT.match(options[n]):
        n += 1
    return list(options[:n]), list(options[n:])


_OLD_STYLE = re.compile(r"^(\w+) \((.+)\.\1\)$")


def unittest_name(name: str) -> str:
    """``test_x (mod.Class.test_x)`` (Python >= 3.11) as ``test_x (mod.Class)``."""
    m = _OLD_STYLE.match(name.strip())
    return f"{m.group(1)} ({m.group(2)})" if m else name.strip()


def runner_outcome(name: str, outcomes: Mapping[str, str],
                   docs: Mapping[str, tuple[str, ...]] | None = None) -> str:
    """The outcome of a test named as FAIL_TO_PASS names it for a unittest-style or SymPy
    runner: ``method (module.Class)`` in either Python's form, or the first line of its
    docstring (``docs``: docstring -> the method-form names of the tests it describes; the
    worst of theirs); ``MISSING`` when the record lacks it."""
    key = unittest_name(name)
    if key in outcomes:
        return outcomes[key]
    found = [outcomes[k] for k in (docs or {}).get(name.strip(), ()) if k in outcomes]
    if not found:
        return "MISSING"
    return max(found, key=lambda o: _RANK.get(o, 3))


@dataclass(frozen=True)
class Record:
    """What the recorder wrote at the runner's own end (see the script)."""

    outcomes: dict[str, str]
    """``method (module.Class)`` -> outcome (empty for SymPy's runner)."""
    docs: dict[str, tuple[str, ...]]
    """First docstring line -> the tests it describes."""
    exitstatus: int
    tampered: tuple[str, ...]


def parse_record(text: str) -> Record | None:
    """The recorder's JSON; None when it is not one (never written: a killed run)."""
    try:
        data = json.loads(text)
        tests, status, tampered = data["tests"], data["exitstatus"], data.get("tampered", [])
        if data.get("end") is not True or not isinstance(status, int):
            return None
        outcomes = {unittest_name(k): str(v["outcome"]) for k, v in tests.items()}
        docs: dict[str, list[str]] = {}
        for k, v in tests.items():
            if v.get("doc"):
                docs.setdefault(str(v["doc"]), []).append(unittest_name(k))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None  # (nested past the parser's limit: the code under test wrote it)
    return Record(outcomes, {d: tuple(n) for d, n in docs.items()}, status,
                  tuple(str(t) for t in tampered))


def cross_checked(record: Record, log_outcomes: Mapping[str, str]) -> dict[str, str]:
    """The record's outcomes, each made worse where the log reports worse for the same test
    (by its method name, or its docstring): the log is a cross-check, never a source; a name
    only the log has (a line the code under test printed) counts for nothing."""
    merged: dict[str, str] = _Outcomes(record.outcomes)
    for name, outcome in log_outcomes.items():
        key = unittest_name(name)
        for target in ((key,) if key in record.outcomes else record.docs.get(name.strip(), ())):
            merged[target] = outcome
    return dict(merged)


_RANK = {"PASSED": 0, "SKIPPED": 1, "FAILED": 2, "ERROR": 3}


def _worse(old: str | None, new: str) -> str:
    """The outcome a test keeps when the log reports it twice: the worse one. A line printed
    after the real one (by code under test, at exit) cannot turn a failure into a pass."""
    return new if old is None or _RANK.get(new, 3) >= _RANK.get(old, 3) else old


class _Outcomes(dict[str, str]):
    def __setitem__(self, name: str, outcome: str) -> None:
        super().__setitem__(name, _worse(self.get(name), outcome))


def parse_unittest_log(log: str) -> dict[str, str]:
    """Test name -> outcome from a verbose unittest (or Django runner) log, by the rules of the
    harness's ``parse_log_django``: ``name ... ok`` / ``... skipped`` / ``... FAIL`` /
    ``... ERROR``, and the ``FAIL: name`` / ``ERROR: name`` headers of the tracebacks; a test
    reported twice keeps the worse outcome."""
    outcomes: dict[str, str] = _Outcomes()
    previous = None
    for raw in log.split("\n"):
        line = raw.strip()
        if " ... " in line:
            previous = line.split(" ... ")[0]
        for suffix in (" ... ok", " ... OK", " ...  OK"):
            if line.endswith(suffix):
                outcomes[line.rsplit(suffix, 1)[0]] = "PASSED"
                break
        if " ... skipped" in line:
            outcomes[line.split(" ... skipped")[0]] = "SKIPPED"
        if line.endswith(" ... FAIL"):
            outcomes[line.split(" ... FAIL")[0]] = "FAILED"
        if line.startswith("FAIL:"):
            outcomes[line[len("FAIL:"):].strip()] = "FAILED"
        if line.endswith(" ... ERROR"):
            outcomes[line.split(" ... ERROR")[0]] = "ERROR"
        if line.startswith("ERROR:"):
            outcomes[line[len("ERROR:"):].strip()] = "ERROR"
        if line.startswith("ok") and previous is not None:
            outcomes[previous] = "PASSED"
    return outcomes


def parse_sympy_log(log: str) -> dict[str, str]:
    """Test name -> outcome from ``bin/test --verbose``, as the harness's ``parse_log_sympy``
    reads it: ``test_x ok`` / ``test_x F`` / ``test_x E`` lines, and the ``____ path.py:test_x
    ____`` headers of failure reports (which fail ``test_x`` too); a test reported twice keeps
    the worse outcome."""
    outcomes: dict[str, str] = _Outcomes()
    for m in re.findall(r"(_*) (.*)\.py:(.*) (_*)", log):
        outcomes[f"{m[1]}.py:{m[2]}"] = "FAILED"
        outcomes[m[2].strip()] = "FAILED"
    for raw in log.split("\n"):
        line = raw.strip()
        if line.startswith("test_"):
            if line.endswith(" E"):
                outcomes[line.split()[0]] = "ERROR"
            if line.endswith(" F"):
                outcomes[line.split()[0]] = "FAILED"
            if line.endswith(" ok"):
                outcomes[line.split()[0]] = "PASSED"
    return outcomes


def _swebench_parser(name: str) -> Callable[[str], dict[str, str]] | None:
    """The harness's own parser, when the ``swebench`` package is importable (it is heavy:
    docker, datasets; so it is optional)."""
    try:
        from swebench.harness.log_parsers import PARSER_REGISTRY
    except Exception:
        return None
    parser = PARSER_REGISTRY.get(name)
    if parser is None:
        return None
    return lambda log: {k: str(v) for k, v in parser(log, None).items()}


def parse_log(runner: Runner, log: str) -> tuple[dict[str, str], str]:
    """(test name -> outcome, which parsers read it): the rules written out here, and the
    harness's own parser when ``swebench`` is installed; a test keeps the worse of the two
    (the harness's keeps the last line, which code under test can print)."""
    name = "parse_log_sympy" if runner.name == "sympy" else "parse_log_django"
    outcomes = (parse_sympy_log if runner.name == "sympy" else parse_unittest_log)(log)
    sources = [f"builtin.{name}"]
    harness = _swebench_parser(name)
    if harness is not None:
        sources.append(f"swebench.{name}")
        for test, outcome in harness(log).items():
            outcomes[test] = outcome  # the worse of the two stays
    if runner.name in ("django", "unittest"):
        merged: dict[str, str] = _Outcomes()
        for test, outcome in outcomes.items():
            merged[unittest_name(test)] = outcome
        outcomes = merged
    return dict(outcomes), "+".join(sources)
