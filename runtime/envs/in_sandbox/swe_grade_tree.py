"""Builds the swe grading tree. Runs INSIDE the grading sandbox, stdlib only, before any code
of the agent runs there.

``python swe_grade_tree.py SOURCE KIND BASE TEST_PATCH [PATH ...] [imports:FILE ...]
[added:OUT]`` in a directory that holds a copy of the agent's working tree without ``.git``
(each ``imports:FILE``, the runner's script and the test files, is where
:func:`support_modules` starts: the test machinery they import is put back like each ``PATH``;
``added:OUT`` gets the files the agent added and changed, as JSON, which the runner's start
checks for modules that shadow the runner's or ran at the interpreter's start):

1. A fresh ``.git`` from the task's source (``KIND`` bundle or archive), reset to ``BASE`` with
   the working tree left as the agent made it: the agent's diff over a clean base, with none of
   the agent's git configuration, hooks or history.
2. Files a test run loads by design are put back to ``BASE`` (or removed when ``BASE`` has none):
   every ``conftest.py``, ``pytest.ini``/``.pytest.ini``/``pytest.toml``/``.pytest.toml``/
   ``tox.ini``, ``sitecustomize.py``, ``usercustomize.py`` and ``*.pth``; each ``PATH`` (the
   files of the named tests and of the test patch, the runner's own files); and everything
   below each ``PATH`` that ends in ``/`` (the test directories: ``tests/__init__.py``, helper
   modules beside the tests, data files), where files ``BASE`` does not track are removed.
   ``pyproject.toml`` is put back whole when any of its ``[tool.*]`` tables changed, and
   ``setup.cfg`` when a ``[tool:*]`` or ``[pytest]`` section did, since the agent may have to
   edit the rest (a dependency). Test modules the agent added anywhere else (``test_*.py``,
   ``*_test.py`` that ``BASE`` lacks) are removed: no fix needs them, and outside the screen
   below they could carry code that reaches into the runner. A conftest hook that rewrites
   outcomes is thereby never loaded.
3. Compiled bytecode that ``BASE`` does not track is removed (``__pycache__/``, ``*.pyc``,
   ``*.pyo``): Python runs a cached module whose recorded source size and mtime match instead
   of the source, so a ``.pyc`` left by the agent's own test runs (an edit within the same
   second, same size) or planted on purpose would be judged instead of the patch.
4. The screen: every file the agent's change leaves different from ``BASE`` (any text file,
   not only ``.py``: Python runs whatever some code reads and executes) is read from disk
   and each line matched against :data:`SCREEN` (imports of the test framework, its runner
   functions, the grader's names, ``/proc/self/fd``, ...); a match that the file did not
   already have at ``BASE`` is reported, and the grader scores the run 0. The code under test
   has no business with the machinery that judges it; a repository whose own code is that
   machinery (pytest itself, Django's test runner) already mentions it at ``BASE`` and
   passes. Documentation (a README, ``.rst``, ``.md``, ``.txt``) is prose: it is screened
   only when some changed file names it (code that may read and run it). Git is asked only
   which files changed, with ``.git/info/attributes`` overriding
   every ``.gitattributes`` of the tree (``*.py -diff`` would make ``git diff`` print
   "Binary files differ"), and no diff, textconv or filter driver configured.
5. The test patch is applied (exit 97 when it does not apply).

Prints one JSON line: which files were put back, how many bytecode files were removed, what
the screen found.
"""

from __future__ import annotations

import ast
import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib

LOADED_BY_PYTEST = frozenset({"conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml",
                              ".pytest.toml", "tox.ini", "sitecustomize.py", "usercustomize.py"})
_FRAMEWORKS = r"(?:_pytest|pytest|pluggy|unittest|doctest|nose2?)"
SCREEN = [(re.compile(pattern), why) for pattern, why in (
    (rf"(?:^|[;:])\s*(?:from\s+{_FRAMEWORKS}\b|import\s+(?:[\w.]+(?:\s+as\s+\w+)?\s*,\s*)*"
     rf"{_FRAMEWORKS}\b)", "imports the test framework"),
    (rf"(?:__import__|import_module)\(\s*['\"]{_FRAMEWORKS}\b", "imports the test framework"),
    (rf"sys\.modules\s*(?:\[|\.get\()\s*['\"]{_FRAMEWORKS}\b", "reaches the test framework"),
    (r"\brollout_(?:pytest|unittest|runner)|\bROLLOUT_[A-Z]|\.rollout-", "refers to the grader"),
    (r"\bruntest\b|pytest_runtest|pytest_pyfunc_call|TestCaseFunction|CallInfo|TestReport\b",
     "refers to pytest's runner"),
    (r"\b(?:TestResult|TextTestRunner|TextTestResult|DiscoverRunner)\b|\.add(?:Success|Failure|"
     r"Error|Skip|ExpectedFailure|UnexpectedSuccess|SubTest)\b|\bwasSuccessful\b",
     "refers to unittest's runner"),
    (r"(?:sympy\.(?:testing|utilities)\.runtests|SymPyTests|PyTestReporter)\b",
     "refers to SymPy's runner"),
    (r"/proc/self/(?:fd|environ|mem)|\bgc\.get_(?:objects|referrers)\b|\bsys\.(?:settrace|"
     r"setprofile)\b|\bos\._exit\b|\bsys\.(?:stdout|stderr|exit|excepthook)\s*=(?!=)",
     "inspects, rewrites or ends its own process"),
)]
_MAX_FINDINGS = 20
_MAX_SCREENED = 4 << 20
PATCH_FAILED = 97
_GIT_ENV = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_TERMINAL_PROMPT": "0"}


def git(*args: str, data: bytes | None = None) -> bytes:
    return subprocess.run(["git", *args], check=True, capture_output=True, input=data,
                          env=_GIT_ENV).stdout


def fresh_git(source: str, kind: str, base: str) -> None:
    if kind == "archive":
        with tempfile.TemporaryDirectory(dir=".") as tmp:
            subprocess.run(["tar", "-xf", source, "-C", tmp], check=True)
            found = [os.path.join(tmp, ".git")] + [os.path.join(tmp, d, ".git")
                                                   for d in sorted(os.listdir(tmp))]
            gitdir = next((g for g in found if os.path.isdir(g)), None)
            if gitdir is None:
                sys.exit("the archive holds no git repository (.git)")
            os.rename(gitdir, ".git")
    else:
        git("init", "-q")
        git("fetch", "-q", source, "+refs/*:refs/rollout-src/*")
    os.unlink(source)
    git("reset", "-q", base)  # HEAD and index at base; the working tree stays the agent's
    git("config", "user.name", "grader")
    git("config", "user.email", "grader@localhost")


def runner_config(path: str, data: bytes) -> object:
    """What a file configures for a test runner (None for nothing); unparsable -> a marker.
    ``pyproject.toml``: every ``[tool.*]`` table (pytest's, and any plugin's or runner's);
    ``setup.cfg``: its ``[tool:*]`` and ``[pytest]`` sections."""
    try:
        if path.endswith(".toml"):
            return tomllib.loads(data.decode()).get("tool")
        parser = configparser.ConfigParser(interpolation=None)
        parser.read_string(data.decode())
        return {name: dict(parser[name]) for name in parser.sections()
                if name.startswith("tool:") or name == "pytest"} or None
    except (ValueError, configparser.Error, UnicodeDecodeError):
        return "<unparsable>"


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def protect(base: str, named: set[str], in_base: set[str]) -> tuple[list[str], int]:
    # Everything in the working tree, ignored files included: .gitignore is the agent's. The
    # walk also sees what git would not list (files below a nested .git the agent made).
    in_tree = set(git("ls-files", "-z", "--cached", "--others").decode().split("\0")) - {""}
    for dirpath, dirnames, filenames in os.walk("."):
        if ".git" in dirnames or ".git" in filenames:
            if dirpath != ".":  # a nested repository: its files are plain files here
                remove(os.path.join(dirpath, ".git"))
            dirnames[:] = [d for d in dirnames if d != ".git"]
            filenames = [n for n in filenames if n != ".git"]
        in_tree.update(os.path.normpath(os.path.join(dirpath, n)) for n in filenames)
    dirs = tuple(d for d in named if d.endswith("/") and d != "/")
    # Tracked files the agent changed (HEAD and index are at base); the rest need no look.
    dirty = set(git("diff", "--name-only", "--no-renames", "-z").decode().split("\0")) - {""}
    restored, bytecode = [], 0
    for path in sorted(in_base | in_tree):
        if path in in_base and path not in dirty:
            continue
        name = os.path.basename(path)
        if is_bytecode(path) and path not in in_base:
            remove(path)
            bytecode += 1
            continue
        config = name in ("pyproject.toml", "setup.cfg")
        added_test = path not in in_base and is_test_module(name)
        if not (config or added_test or name in LOADED_BY_PYTEST or name.endswith(".pth")
                or path in named or path.startswith(dirs)):
            continue
        theirs = git("show", f"{base}:{path}") if path in in_base else None
        if os.path.islink(path) or not os.path.isfile(path):
            changed = os.path.lexists(path) or theirs is not None
        else:
            with open(path, "rb") as f:
                mine = f.read()
            if config:
                changed = runner_config(path, mine) != runner_config(path, theirs or b"")
            else:
                changed = mine != theirs
        if not changed:
            continue
        remove(path)
        if theirs is not None:
            git("checkout", base, "--", path)
        restored.append(path)
    return restored, bytecode


def is_test_module(name: str) -> bool:
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def neutral_attributes() -> None:
    """Make git see files as bytes: ``.git/info/attributes`` outranks every
    ``.gitattributes`` of the tree, so the agent's (``*.py -diff``, a textconv or filter
    driver, an eol conversion) changes nothing the grader asks git; this ``.git`` has no diff
    or filter drivers configured, and no system or global configuration is read."""
    os.makedirs(os.path.join(".git", "info"), exist_ok=True)
    with open(os.path.join(".git", "info", "attributes"), "w") as f:
        f.write("* -text -filter -ident -working-tree-encoding -export-subst !diff !eol\n")


def changed_files(base: str) -> list[str]:
    """Every path whose content differs from ``base``, untracked and ignored files included
    (the agent's ``.gitignore`` must not hide a file from the screen)."""
    # This .git is the grader's own, so its index may hold the agent's tree.
    git("add", "--force", "-A")
    names = git("diff", "--cached", "--name-only", "--no-renames", "-z", base).decode()
    git("reset", "-q")
    return [n for n in names.split("\0") if n]


def read_text(path: str) -> str | None:
    """A regular file's text as it is on disk (None: a link, gone, or binary). Every text file
    is screened, not only ``.py``: Python runs any file some code reads and executes."""
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        data = f.read(_MAX_SCREENED)
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", "replace")


def screen(base: str, in_base: set[str]) -> tuple[list[str], list[str]]:
    """What the agent's remaining changes add that reaches into the test machinery (see
    :data:`SCREEN`), each as ``PATH: why: line``, and the changed paths. Read from the files
    themselves, never from ``git diff``'s rendering of them."""
    findings: list[str] = []
    changed = changed_files(base)
    texts = {path: text for path in changed if (text := read_text(path)) is not None}
    code = [text for path, text in texts.items() if not is_doc(path)]
    for path, text in texts.items():
        if is_doc(path) and not any(os.path.basename(path) in other for other in code):
            continue  # prose that no changed code names, so none reads and runs it
        before = (git("cat-file", "blob", f"{base}:{path}").decode("utf-8", "replace")
                  if path in in_base else "")
        for line in text.splitlines():
            for pattern, why in SCREEN:
                if pattern.search(line) and not pattern.search(before):
                    findings.append(f"{path}: {why}: {line.strip()[:160]}")
                    break
            if len(findings) >= _MAX_FINDINGS:
                return findings, changed
    return findings, changed


_DOC = re.compile(r"(?:\.(?:md|rst|txt|adoc|markdown)|(?:^|/)(?:README|CHANGES|CHANGELOG|"
                  r"HISTORY|NEWS|AUTHORS)[^/]*)$", re.IGNORECASE)


def is_doc(path: str) -> bool:
    """Documentation: a README or ``.rst`` that mentions ``import pytest`` in an example is
    prose, screened only when some changed code names the file (and may read and run it)."""
    return bool(_DOC.search(path))


def is_bytecode(path: str) -> bool:
    return (path.endswith((".pyc", ".pyo"))
            or "__pycache__" in os.path.normpath(path).split(os.sep)[:-1])


_SUPPORT_DIRS = re.compile(r"tests?|testing|test_?tools|test_?utils|testutils|tests?_\w+|"
                           r"\w+_tests?")
_SUPPORT_FILES = re.compile(r"(?:conftest|runtests|testing|test_?tools|test_?utils|"
                            r"test_\w+|\w+_tests?)\.py")


def is_support(path: str) -> bool:
    """Test machinery by its place: a module in a test folder (``tests``, ``testing``,
    ``test_tools``, ...), or a runner / helper / test module by name. ``test`` alone is not
    one: Django's ``django/test/`` is the library's product, which fixes may change."""
    *dirs, name = path.split("/")
    return (any(d != "test" and _SUPPORT_DIRS.fullmatch(d) for d in dirs)
            or bool(_SUPPORT_FILES.fullmatch(name)))


def _imports(source: str) -> list[tuple[str, int]]:
    """(dotted name, relative level) of every import, submodule candidates of ``from X
    import a`` included."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        found = re.findall(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))", source,
                           re.MULTILINE)
        return [(a or b, 0) for a, b in found]
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            out.append((module, node.level))
            out += [(f"{module}.{a.name}" if module else a.name, node.level)
                    for a in node.names]
    return out


def _resolve(name: str, level: int, importer: str, in_base: set[str]) -> list[str]:
    """The repository files an import loads: the module and its packages' ``__init__.py``,
    searched where the runners put the repository (its root, ``tests/``, ``src/``, the
    importer's folder)."""
    folder = os.path.dirname(importer)
    if level:
        for _ in range(level - 1):
            folder = os.path.dirname(folder)
        roots = [folder + "/" if folder else ""]
    else:
        roots = ["", "tests/", "src/", folder + "/" if folder else ""]
    parts = [p for p in name.split(".") if p]
    for root in dict.fromkeys(roots):
        files = []
        for i in range(1, len(parts) + 1):
            stem = root + "/".join(parts[:i])
            if f"{stem}/__init__.py" in in_base:
                files.append(f"{stem}/__init__.py")
            elif f"{stem}.py" in in_base and i == len(parts):
                files.append(f"{stem}.py")
            elif i == 1:
                break
        if files:
            return files
    return []


def support_modules(base: str, roots: list[str], patch: str, in_base: set[str]) -> set[str]:
    """The test machinery of the repository that the runner and the test files import, as
    ``BASE`` has them (and as the test patch adds imports): each imported module that
    :func:`is_support` calls machinery, and what those import in turn, never following the
    library code the tests exercise."""
    todo: list[tuple[str, str]] = []
    for path in roots:
        if path in in_base:
            todo.append((path, git("cat-file", "blob", f"{base}:{path}").decode(
                "utf-8", "replace")))
    with open(patch, encoding="utf-8", errors="replace") as f:
        current = ""
        for line in f:
            if line.startswith("+++ b/"):
                current = line[6:].strip()
            elif line.startswith("+") and current:
                todo.append((current, line[1:].strip()))
    found: set[str] = set()
    seen: set[str] = set()
    while todo:
        importer, source = todo.pop()
        for name, level in _imports(source):
            for target in _resolve(name, level, importer, in_base):
                if target in found or target in seen or not is_support(target):
                    continue
                found.add(target)
                seen.add(target)
                todo.append((target, git("cat-file", "blob", f"{base}:{target}").decode(
                    "utf-8", "replace")))
    return found


_DEF_LINE = re.compile(r"^(\s*)(?:async\s+)?def\s+(\w+)\s*\(")
_CLASS_LINE = re.compile(r"^(\s*)class\s+(\w+)")


def _classes_of(lines: list[str], at: int, indent: int) -> list[str]:
    """The classes, outermost first, that the line ``at`` (indented ``indent``) is in."""
    found: list[str] = []
    for line in reversed(lines[:at]):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "@", ")")):
            continue
        width = len(line) - len(line.lstrip())
        if width < indent:
            m = _CLASS_LINE.match(line)
            if m is None:
                break
            found.insert(0, m.group(2))
            indent = width
            if width == 0:
                break
    return found


def plant_honeypots(insert: dict) -> bool:
    """Honeypot tests (from the grader, ``honeypots.Insert``) put into a named test file
    beside its test ``anchor`` in the classes named, before the anchor's decorators, written
    as its body is (``self.assert...`` or ``assert``). False when there is no such test."""
    path = insert["path"]
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        lines = f.read().splitlines(keepends=True)
    for i, line in enumerate(lines):
        m = _DEF_LINE.match(line)
        if not m or m.group(2) != insert["anchor"] or \
                _classes_of(lines, i, len(m.group(1))) != insert["classes"]:
            continue
        indent, at = m.group(1), i
        while at > 0 and lines[at - 1].startswith(indent + "@"):
            at -= 1
        style = 2 if "self.assert" in "".join(lines[i:i + 40]) else 1
        new = []
        for test in insert["tests"]:
            new += [f"{indent}def {test[0]}({'self' if indent else ''}):\n",
                    f"{indent}    {test[style]}\n", "\n"]
        lines[at:at] = new
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write("".join(lines))
        return True
    return False


def main(argv: list[str]) -> int:
    source, kind, base, patch, *named = argv[1:]
    roots = [n[len("imports:"):] for n in named if n.startswith("imports:")]
    added_list = [n[len("added:"):] for n in named if n.startswith("added:")]
    inserts = [n[len("honeypots:"):] for n in named if n.startswith("honeypots:")]
    named = [n for n in named if not n.startswith(("imports:", "added:", "honeypots:"))]
    fresh_git(source, kind, base)
    neutral_attributes()
    in_base = set(git("ls-tree", "-r", "-z", "--name-only", base).decode().split("\0")) - {""}
    support = support_modules(base, roots, patch, in_base)
    restored, bytecode = protect(base, set(named) | support, in_base)
    found, changed = screen(base, in_base)
    for where in added_list:  # for the runner's start (runner_start.py): what may shadow
        with open(where, "w") as f:
            present = sorted(p for p in changed if os.path.exists(p))
            json.dump({"added": [p for p in present if p not in in_base],
                       "changed": present}, f)
    # A src/ layout: packages under src/ that the checkout's root does not have.
    under_src = {p.split("/")[1] for p in in_base if p.startswith("src/") and p.count("/") == 2
                 and p.endswith("/__init__.py")}
    at_root = {p.split("/")[0] for p in in_base if p.count("/") == 1
               and p.endswith("/__init__.py")}
    # An empty test patch (a SWE-smith instance: its tests are in the repository) applies as
    # nothing; `git apply` refuses an empty input.
    proc = (subprocess.run(["git", "apply", "--whitespace=nowarn", patch], env=_GIT_ENV,
                           capture_output=True, text=True) if os.path.getsize(patch) else None)
    if proc is not None and proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        return PATCH_FAILED
    planted = []
    for where in inserts:
        with open(where) as f:
            planted += [i["path"] for i in json.load(f) if plant_honeypots(i)]
    sys.stdout.write(json.dumps({"restored": restored, "bytecode_removed": bytecode,
                                 "honeypots_in": planted,
                                 "support": sorted(support),
                                 "screen": found,
                                 "import_paths": ["src"] if under_src - at_root else []}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
