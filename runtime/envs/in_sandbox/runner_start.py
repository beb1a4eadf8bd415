"""The start of every test run of the swe grader: the runner's own modules are imported, and
its fingerprints taken, before any directory of the repository is on ``sys.path``; then those
directories are put back and the repository is probed for modules that would shadow the
runner's or the standard library's. Runs INSIDE the grading sandbox, stdlib only; its text is
put in front of a launcher's (``pytest_launch.py``, ``unittest_recorder.py``) and passed to
``python -c`` together.

Why: ``python -c`` puts the working directory (the repository) first on ``sys.path``, a task's
``PYTHONPATH`` may name folders of the repository (a ``src/`` layout) and an editable install
adds one through a ``.pth`` file; a ``pytest.py``, ``unittest/``, ``json.py`` or
``_distutils_hack/`` the agent adds there would be imported instead of the real module, before
the report plugin or the recorder has taken its fingerprints, or later, while the tests run
(a module the runner imports lazily). So:

1. :func:`hide` (first, with nothing imported but what the interpreter's start already loaded)
   takes every entry inside the repository (and ``''``) off ``sys.path`` and notes any module
   the interpreter's start already loaded from the repository (a ``sitecustomize.py`` on a path
   of the environment's ``.pth``): when the agent added or changed that file, its code ran
   before the runner, and the run is refused (a repository whose own module an environment's
   ``.pth`` imports, as setuptools' ``_distutils_hack``, is the task's).
   The handler keeps the repository's ``PYTHONPATH`` entries out of the interpreter's
   environment (they reach :func:`reopen` through ``ROLLOUT_START``), so no module of the
   repository is found at the interpreter's start through them.
2. The launcher imports the runner (pytest and the report plugin, or unittest and the
   recorder's wrappers): fingerprints are taken from the environment's own files.
3. :func:`reopen` puts the entries back where they were, with the task's ``PYTHONPATH`` in
   front as the interpreter would have put it, and probes every directory of the repository
   the run puts on ``sys.path`` for a top-level module (``NAME.py``, ``NAME/__init__.py``, an
   extension module, sourceless bytecode) named like a module of the standard library or of
   the runner (every module loaded so far, and pytest's, pluggy's, unittest's, ...) or like
   one that an import line of the site directories' ``.pth`` files names (the interpreter's
   start imported it, from the repository when the environment lacks it), that the agent
   added (not tracked at ``base_commit``: the list comes from the grading tree) or, for what
   the start imports, changed. Any
   found: the run is refused before any code of the repository runs, with one line per module
   on stderr (``shadowed_module: NAME (PATH)``) and exit status :data:`REFUSED`.

What this cannot stop: once the tests run, code under test shares this process (see
docs/grading.md).
"""
import sys

REFUSED = 86
_MARK = "rollout-start refused: "
_RUNNER_NAMES = ("pytest", "_pytest", "pluggy", "py", "iniconfig", "packaging",
                 "exceptiongroup", "tomli", "unittest", "rollout_pytest_report", "sitecustomize",
                 "usercustomize", "runpy", "site",
                 "django")  # Django's runner (django.test.runner) when the environment has it


class _Start:
    def __init__(self):
        os = sys.modules["os"]  # loaded by the interpreter's start, no search of sys.path
        self.workspace = os.path.realpath(sys.argv[1])
        self.hidden = []
        self.findings = []
        kept = []
        for i, entry in enumerate(sys.path):
            if entry in ("", ".") or self.inside(entry):
                self.hidden.append((i, entry))
            else:
                kept.append(entry)
        sys.path[:] = kept
        self.started = []
        for name, module in list(sys.modules.items()):
            where = getattr(module, "__file__", None)
            if isinstance(where, str) and self.inside(where):
                self.started.append((name, self.relative(where)))

    def inside(self, path):
        os = sys.modules["os"]
        try:
            real = os.path.realpath(os.path.join(self.workspace, path))
        except (TypeError, ValueError):
            return False
        return real == self.workspace or real.startswith(self.workspace + os.sep)

    def relative(self, path):
        os = sys.modules["os"]
        return os.path.relpath(os.path.realpath(os.path.join(self.workspace, path)),
                               self.workspace)

    def reopen(self, front=(), probe=(), names=()):
        """The hidden entries back in place, the task's PYTHONPATH in front of them and
        ``front`` first; refuses the run (exit :data:`REFUSED`) when the repository shadows a
        module (see the module docstring). ``probe``: more directories the runner will put on
        ``sys.path`` (pytest's rootdir of a test file); ``names``: more modules the runner will
        import (the task's pytest plugins)."""
        import json
        import os
        start = json.loads(os.environ.pop("ROLLOUT_START", "{}") or "{}")
        for i, entry in self.hidden:
            if entry not in ("", "."):
                sys.path.insert(min(i, len(sys.path)), entry)
        pythonpath = [p for p in start.get("pythonpath", []) if p]
        for entry in reversed(pythonpath):
            if entry in sys.path:
                sys.path.remove(entry)
            sys.path.insert(0, entry)
        if pythonpath:
            os.environ["PYTHONPATH"] = os.pathsep.join(pythonpath)
        for entry in reversed(list(front)):
            sys.path.insert(0, entry)
        self.probe(start.get("added"), [*sys.path, *probe], names)
        if self.findings:
            for line in self.findings:
                sys.stderr.write(_MARK + line + "\n")
            sys.stderr.flush()
            os._exit(REFUSED)

    def probe(self, added_file, directories, extra=()):
        import json
        import os
        added = changed = None  # no lists: every file counts as the agent's
        if added_file:
            try:
                with open(added_file) as f:
                    lists = json.loads(f.read())
                added, changed = set(lists["added"]), set(lists["changed"])
            except (OSError, ValueError, KeyError, TypeError):
                pass
        for name, rel in self.started:
            if changed is None or rel in changed:
                self.findings.append(f"started_from_repository: {name} ({rel})")
        # What the interpreter's start imports has run before the runner: the agent's change to
        # such a file counts as well as a file it added.
        at_start = self.started_names() | {"sitecustomize", "usercustomize"}
        names = self.names() | at_start | {n for n in extra if n}
        seen = set()
        for directory in directories:
            if not isinstance(directory, str) or not self.inside(directory):
                continue
            real = os.path.realpath(os.path.join(self.workspace, directory))
            if real in seen:
                continue
            seen.add(real)
            try:
                entries = os.listdir(real)
            except OSError:
                continue
            for entry in sorted(entries):
                name = self.module_name(real, entry)
                if name is None or name not in names:
                    continue
                path = os.path.join(real, entry)
                found = (os.path.join(path, "__init__.py") if os.path.isdir(path) else path)
                rel = self.relative(found)
                if added is None or rel in added or (name in at_start and rel in (changed or ())):
                    self.findings.append(f"shadowed_module: {name} ({rel})")

    @staticmethod
    def module_name(directory, entry):
        os = sys.modules["os"]
        path = os.path.join(directory, entry)
        if os.path.isdir(path):
            has_init = any(os.path.exists(os.path.join(path, "__init__" + s))
                           for s in (".py", ".pyc"))
            return entry if has_init and entry.isidentifier() else None
        stem, dot, _ = entry.partition(".")
        if not dot or not stem.isidentifier():
            return None
        if entry.endswith((".py", ".pyc", ".so", ".pyd")):
            return stem
        return None

    @staticmethod
    def started_names():
        """Top-level modules that the import lines of the site directories' ``.pth`` files
        name. The interpreter's start imports them before any code of the runner runs, from a
        directory of the repository that an earlier ``.pth`` put on ``sys.path`` (an editable
        install's ``src/``) when the environment lacks the module; a module whose import failed
        is not in ``sys.modules``, and one that ran may have taken itself out of it, so the
        names come from the ``.pth`` files, not from what is loaded."""
        os = sys.modules["os"]
        site = sys.modules.get("site")
        folders = []
        listed = getattr(site, "getsitepackages", None)  # None: -S, an old virtualenv's site.py
        if listed is not None:
            folders.extend(listed())
        user = getattr(site, "USER_SITE", None)
        if user and getattr(site, "ENABLE_USER_SITE", False):
            folders.append(user)
        found = set()
        for folder in folders:
            try:
                entries = sorted(os.listdir(folder))
            except (OSError, TypeError):
                continue
            for entry in entries:
                if not entry.endswith(".pth"):
                    continue
                try:
                    with open(os.path.join(folder, entry), errors="replace") as f:
                        lines = f.read().splitlines()
                except OSError:
                    continue
                for line in lines:
                    if line.startswith(("import ", "import\t")):  # what site.py executes
                        found.update(_Start.imported(line))
        return found

    @staticmethod
    def imported(line):
        """Top-level names a line of Python source imports: ``import a.b, c as d``,
        ``from e import f``, ``__import__('g')``, ``importlib.import_module('h')``."""
        import re
        found = set()
        for statement in line.split(";"):
            words = statement.split()
            if words[:1] == ["import"]:
                for part in " ".join(words[1:]).split(","):
                    found.add(part.split()[0] if part.split() else "")
            elif words[:1] == ["from"] and len(words) > 1:
                found.add(words[1])
        found.update(re.findall(r"(?:__import__|import_module)\(\s*['\"]([\w.]+)", line))
        return {n.partition(".")[0] for n in found if n.partition(".")[0].isidentifier()}

    @staticmethod
    def names():
        """Top-level names of the standard library and of the runner (everything loaded by
        now: the runner's import closure)."""
        names = set(getattr(sys, "stdlib_module_names", ()))
        if not names:  # Python < 3.10: the standard library's folders
            import sysconfig
            os = sys.modules["os"]
            names.update(sys.builtin_module_names)
            for key in ("stdlib", "platstdlib"):
                folder = sysconfig.get_paths().get(key)
                for sub in (folder, os.path.join(folder or "", "lib-dynload")):
                    try:
                        entries = os.listdir(sub) if sub else []
                    except OSError:
                        entries = []
                    for entry in entries:
                        stem = entry.partition(".")[0]
                        if stem.isidentifier() and stem not in ("test", "site-packages"):
                            names.add(stem)
        names.update(_RUNNER_NAMES)
        names.update(n.partition(".")[0] for n in list(sys.modules) if n != "__main__")
        names.discard("__main__")
        return names


_start = _Start()
