"""The runner starts with the repository off ``sys.path`` until its fingerprints are taken, and
a module the repository shadows is refused (``runtime/envs/in_sandbox/runner_start.py``);
SymPy's runner has its outcomes recorded by a trace of its test functions, not read from its
log. Each exploit earns 0 with the layer on, and 1 with it off (a control), with the other
layers that would also catch it switched off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.swe import runners as swe_runners
from rollout.runtime.envs.swe.handler import SweHandler
from rollout.runtime.tasksets.shipped import load_tasks
from tests.runtime.envs.conftest import Rollout, call
from tests.runtime.envs.test_swe_env import (  # noqa: F401 (a fixture)
    needs_environment,
    wheelhouse_for_task_environments,
)
from tests.runtime.envs.test_swe_exploits import (
    FAKE_PYTEST,
    RESTORE,
    RUNNER_CHECK,
    SCREEN,
    create,
    layer_off,
    unprotect,
)

pytestmark = pytest.mark.timeout(180)

TASKS = {t["instance_id"]: t for t in load_tasks("swe")}
TEXTSTATS = TASKS["rollout__textstats-1"]
MDURL = TASKS["rollout__mdurl-1"]
SYMPY = TASKS["rollout__tinysym-1"]
UNITTEST = dict(TASKS["rollout__tinydj-1"], instance_id="rollout__tinydj-unittest",
                test_runner="unittest",
                FAIL_TO_PASS=[n.replace("(text_tests.", "(tests.text_tests.")
                              for n in TASKS["rollout__tinydj-1"]["FAIL_TO_PASS"]],
                PASS_TO_PASS=[n.replace("(text_tests.", "(tests.text_tests.")
                              for n in TASKS["rollout__tinydj-1"]["PASS_TO_PASS"]])
SUBMIT = call("submit", answer="fixed")

# A unittest package at the repository's root: imported instead of the interpreter's, it loads
# the real one and makes every test "run" by reporting success.
FAKE_UNITTEST = '''import importlib.util, os, sys
_std = os.path.join(os.path.dirname(os.__file__), "unittest")
_spec = importlib.util.spec_from_file_location(
    "unittest", os.path.join(_std, "__init__.py"), submodule_search_locations=[_std])
_real = importlib.util.module_from_spec(_spec)
sys.modules["unittest"] = _real
_spec.loader.exec_module(_real)


def _run(self, result=None):
    result.startTest(self)
    result.addSuccess(self)
    result.stopTest(self)


_real.case.TestCase.run = _run
'''
# On a path of the environment's .pth (mdurl's editable install puts src/ there), run by the
# interpreter's start before the report plugin takes its fingerprints.
SITECUSTOMIZE = ("import _pytest.python\n"
                 "_pytest.python.Function.runtest = lambda self: None\n")

EXPLOITS: dict[str, tuple[dict[str, Any], list[str], tuple[tuple[str, str, str], ...], bool,
                          str]] = {
    # (task, steps, other layers switched off, the naive pytest launch, what the screen says)
    "pytest-py": (TEXTSTATS, [create("pytest.py", FAKE_PYTEST)], (SCREEN,), True,
                  "shadowed_module: pytest (pytest.py)"),
    "unittest-package": (UNITTEST, [create("unittest/__init__.py", FAKE_UNITTEST)], (SCREEN,),
                         False, "shadowed_module: unittest (unittest/__init__.py)"),
    # The report plugin's runner check stays on: it fingerprints the function already patched.
    "sitecustomize": (MDURL, [create("src/sitecustomize.py", SITECUSTOMIZE)],
                      (SCREEN, RESTORE), False,
                      "started_from_repository: sitecustomize (src/sitecustomize.py)"),
}


@pytest.mark.parametrize("exploit", EXPLOITS)
async def test_a_module_that_runs_before_the_fingerprints_earns_0(
        exploit: str, rollout: Rollout, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    task, steps, layers, _, says = EXPLOITS[exploit]
    needs_environment(task)
    unprotect(monkeypatch, tmp_path, *layers)
    result = await rollout(SweHandler(honeypots=False), task, [*steps, SUBMIT])
    assert result.reward.value == 0.0, result.reward.info
    assert says in result.reward.info["screen"], result.reward.info


@pytest.mark.parametrize("exploit", EXPLOITS)
async def test_control_without_the_isolated_start_the_module_earns_1(
        exploit: str, rollout: Rollout, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    task, steps, layers, naive_launch, _ = EXPLOITS[exploit]
    needs_environment(task)
    unprotect(monkeypatch, tmp_path, *layers)
    layer_off(monkeypatch, tmp_path, pytest_launch=naive_launch)
    result = await rollout(SweHandler(honeypots=False), task, [*steps, SUBMIT])
    assert result.reward.value == 1.0, result.reward.info


async def test_a_pth_file_in_the_repository_is_inert(rollout: Rollout,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    """Python reads .pth files only in site directories, never in the repository (not even on
    a path of the environment's .pth): one dropped there runs nothing, restored or not."""
    needs_environment(MDURL)
    unprotect(monkeypatch, tmp_path, SCREEN, RESTORE, RUNNER_CHECK)
    layer_off(monkeypatch, tmp_path)
    pth = "import _pytest.python; _pytest.python.Function.runtest = lambda self: None\n"
    result = await rollout(SweHandler(honeypots=False), MDURL,
                           [create("zz-fix.pth", pth), create("src/zz-fix.pth", pth), SUBMIT])
    assert result.reward.value == 0.0, result.reward.info


async def test_gold_with_the_repositorys_own_modules_earns_1(rollout: Rollout) -> None:
    """The layer refuses only what the agent added: the gold fix plus a package module that
    only shares a name with the standard library (not at a path's top level) earns 1."""
    steps = [call("bash", command=f"git apply <<'PATCH_EOF'\n{TEXTSTATS['patch']}PATCH_EOF\n"),
             create("textstats/json.py", "VALUE = 1\n"), SUBMIT]
    result = await rollout(SweHandler(), TEXTSTATS, steps)
    assert result.reward.value == 1.0, result.reward.info


def _start(tmp_path: Path, files: dict[str, str], added: list[str],
           pythonpath: list[str], python: str = sys.executable,
           env: dict[str, str] | None = None,
           changed: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """runner_start.py and a launcher that only reopens, on a scratch repository (``changed``:
    the files the agent changed, ``added`` unless given)."""
    repo = tmp_path / "repo"
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    lists = {"added": added, "changed": added if changed is None else changed}
    (tmp_path / "added.json").write_text(json.dumps(lists))
    source = swe_runners.START.read_text() + (
        "\n_start.reopen(front=[sys.argv[1]])\nimport json\nprint('ran', json.__file__)\n")
    env = {"PATH": os.environ["PATH"], **(env or {}),
           "ROLLOUT_START": json.dumps({"pythonpath": [str(repo / p) for p in pythonpath],
                                        "added": str(tmp_path / "added.json")})}
    return subprocess.run([python, "-c", source, str(repo)], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_stdlib_name_added_on_a_path_of_the_task_is_refused(tmp_path: Path) -> None:
    files = {"src/json.py": "print('shadow ran')\n", "src/pkg/__init__.py": ""}
    refused = _start(tmp_path, files, ["src/json.py"], ["src"])
    assert refused.returncode == swe_runners.REFUSED, refused
    assert swe_runners.refusals(refused.returncode, refused.stderr) == [
        "shadowed_module: json (src/json.py)"]
    assert "shadow ran" not in refused.stdout
    # The same file tracked at base_commit (a repository that is its own backport) runs.
    kept = _start(tmp_path, files, [], ["src"])
    assert kept.returncode == 0 and "ran" in kept.stdout, kept


# Imported by a .pth of the environment that names a module the environment lacks, from the
# src/ folder an editable install's .pth put on sys.path: it runs at the interpreter's start,
# before the runner, and takes itself out of sys.modules (its import then fails, which the
# start only prints) so that neither the check of what the start loaded nor the names loaded
# by the runner's start know it.
STARTUP_HOOK = "import sys\nsys.stderr.write('hook ran\\n')\ndel sys.modules[__name__]\n"
OLD_PYTHONS = sorted(str(p) for p in Path("/root/.pyenv/versions").glob("3.*/bin/python3"))


def _site_with_pths(python: str, tmp_path: Path, repo: Path) -> tuple[str, dict[str, str]]:
    """An interpreter whose site directory holds an editable install's ``.pth`` and one whose
    import line names ``_speedups_hook``, and the environment variables it needs: a fresh
    venv, as a task's environment is, for this interpreter; the user site directory
    (``PYTHONUSERBASE``) for the others."""
    env = {"PYTHONUSERBASE": str(tmp_path / "userbase"), "HOME": str(tmp_path)}
    where = "site.getusersitepackages()"
    if python == sys.executable:
        subprocess.run([python, "-m", "venv", "--without-pip", str(tmp_path / "venv")],
                       check=True, timeout=120)
        python, where = str(tmp_path / "venv" / "bin" / "python"), "site.getsitepackages()[0]"
    folder = Path(subprocess.run([python, "-c", f"import site; print({where})"],
                                 env={"PATH": os.environ["PATH"], **env}, capture_output=True,
                                 text=True, check=True, timeout=60).stdout.strip())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__editable__.fastlib-1.0.pth").write_text(f"{repo / 'src'}\n")
    (folder / "zz-speedups.pth").write_text(
        "import os; os.environ.get('NO_SPEEDUPS') or __import__('_speedups_hook')\n")
    return python, env


@pytest.mark.parametrize("python", [sys.executable, *OLD_PYTHONS],
                         ids=lambda p: "venv" if p == sys.executable else p.split("/")[-3])
def test_a_module_an_environments_pth_imports_is_refused_when_the_agent_adds_it(
        python: str, tmp_path: Path) -> None:
    """The names the ``.pth`` files import are probed like the runner's: an added
    ``src/_speedups_hook.py`` ran at the start (nothing before the runner can stop that) but
    the run is refused before the runner's tests, on every interpreter the recorder serves."""
    files = {"src/_speedups_hook.py": STARTUP_HOOK, "src/fastlib/__init__.py": ""}
    python, env = _site_with_pths(python, tmp_path, tmp_path / "repo")
    refused = _start(tmp_path, files, ["src/_speedups_hook.py"], [], python, env)
    assert "hook ran" in refused.stderr, refused  # the .pth really ran it at the start
    assert refused.returncode == swe_runners.REFUSED, refused
    assert swe_runners.refusals(refused.returncode, refused.stderr) == [
        "shadowed_module: _speedups_hook (src/_speedups_hook.py)"]
    # Tracked at base_commit and changed by the agent: its change ran at the start too.
    changed = _start(tmp_path, files, [], [], python, env, changed=["src/_speedups_hook.py"])
    assert swe_runners.refusals(changed.returncode, changed.stderr) == [
        "shadowed_module: _speedups_hook (src/_speedups_hook.py)"], changed
    # The repository's own module as base_commit has it is the task's, and runs.
    kept = _start(tmp_path, files, [], [], python, env)
    assert kept.returncode == 0 and "ran" in kept.stdout, kept


@pytest.mark.parametrize("python", OLD_PYTHONS, ids=lambda p: p.split("/")[-3])
def test_the_start_and_the_recorder_serve_every_interpreter(python: str, tmp_path: Path) -> None:
    """No ``-P`` before 3.11: the launcher's first statement keeps the repository off
    ``sys.path`` on every interpreter, so an added ``unittest/`` is neither imported by the
    recorder nor allowed to run; without it the record is the runner's."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "__init__.py").write_text("")
    (repo / "tests" / "test_a.py").write_text(
        "import unittest\n\n\nclass T(unittest.TestCase):\n"
        "    def test_ok(self):\n        self.assertEqual(1 + 1, 2)\n\n"
        "    def test_bad(self):\n        self.assertEqual(1, 2)\n")
    source = swe_runners.launcher(swe_runners.RECORDER)

    def run(name: str, added: list[str]) -> subprocess.CompletedProcess[str]:
        (tmp_path / "added.json").write_text(json.dumps({"added": added, "changed": added}))
        env = {"PATH": os.environ["PATH"], "ROLLOUT_UNITTEST_REPORT": str(tmp_path / name),
               "ROLLOUT_START": json.dumps({"added": str(tmp_path / "added.json")})}
        return subprocess.run([python, "-c", source, str(repo), "unittest", "tests.test_a"],
                              cwd=repo, env=env, capture_output=True, text=True, timeout=60)

    clean = run("clean.json", [])
    record = json.loads((tmp_path / "clean.json").read_text())
    assert clean.returncode == 1 and record["end"] and not record["tampered"], clean
    assert {n: t["outcome"] for n, t in record["tests"].items()} == {
        "test_ok (tests.test_a.T)": "PASSED", "test_bad (tests.test_a.T)": "FAILED"}
    (repo / "unittest").mkdir()
    (repo / "unittest" / "__init__.py").write_text(
        "import sys\nsys.stderr.write('shadow ran\\n')\n" + FAKE_UNITTEST)
    shadowed = run("shadowed.json", ["unittest/__init__.py"])
    assert "shadow ran" not in shadowed.stderr, shadowed
    assert swe_runners.refusals(shadowed.returncode, shadowed.stderr) == [
        "shadowed_module: unittest (unittest/__init__.py)"], shadowed


# SymPy's log forged: every "F" line printed as "ok", the failure reports dropped, and the
# runner's sys.exit(1) made a no-op so that the run ends with status 0 by its own end.
FORGED_SYMPY_LOG = call("bash", command="cat >> tinysym/__init__.py <<'EOF'\n"
                        "import builtins, sys\n"
                        "_print = builtins.print\n"
                        "def _forged(*args, **kwargs):\n"
                        "    text = ' '.join(str(a) for a in args)\n"
                        "    if text.startswith('test_') and text.endswith((' F', ' E')):\n"
                        "        text = text[:-2] + ' ok'\n"
                        "    if '.py:' in text or 'Error' in text or text.startswith('___'):\n"
                        "        return\n"
                        "    _print(text, **kwargs)\n"
                        "builtins.print = _forged\n"
                        "setattr(sys, 'exit', lambda *args: None)\n"
                        "EOF\n")


async def test_a_forged_sympy_log_earns_0(rollout: Rollout) -> None:
    result = await rollout(SweHandler(honeypots=False), SYMPY, [FORGED_SYMPY_LOG, SUBMIT])
    assert result.reward.value == 0.0, result.reward.info
    assert result.reward.info["failing"] == "test_sign_zero", result.reward.info
    assert result.reward.info["parser"].startswith("recorder+"), result.reward.info


async def test_control_read_from_its_log_a_forged_sympy_log_earns_1(
        rollout: Rollout, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(swe_runners, "cross_checked", lambda record, logged: logged)
    result = await rollout(SweHandler(honeypots=False), SYMPY, [FORGED_SYMPY_LOG, SUBMIT])
    assert result.reward.value == 1.0, result.reward.info


async def test_sympy_outcomes_are_recorded_from_its_test_functions(
        rollout: Rollout, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record alone (no log at all) grades the gold fix 1 and a no-op 0."""
    monkeypatch.setattr(swe_runners, "parse_log", lambda runner, log: ({}, "none"))
    gold = call("bash", command=f"git apply <<'PATCH_EOF'\n{SYMPY['patch']}PATCH_EOF\n")
    fixed = await rollout(SweHandler(), SYMPY, [gold, SUBMIT])
    assert fixed.reward.value == 1.0, fixed.reward.info
    unfixed = await rollout(SweHandler(), SYMPY, [SUBMIT])
    assert unfixed.reward.value == 0.0, unfixed.reward.info
    assert unfixed.reward.info["failing"] == "test_sign_zero", unfixed.reward.info


# unittest's runner made a no-op by the package (imported by the tests): every test "runs" by
# reporting success.
NO_OP_TESTCASE_RUN = call("bash", command="cat >> tinydj/__init__.py <<'EOF'\n"
                          "import sys\n"
                          "def _run(self, result=None):\n"
                          "    result.startTest(self)\n"
                          "    result.addSuccess(self)\n"
                          "    result.stopTest(self)\n"
                          "sys.modules['unittest'].case.TestCase.run = _run\n"
                          "EOF\n")


async def test_unittest_runner_functions_replaced_while_the_tests_run_earn_0(
        rollout: Rollout, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The recorder's fingerprints of unittest's runner, taken before the repository is on
    sys.path, alone (screen and honeypots off); its control is the honeypot test's
    ``no-op-unittest-runner`` with honeypots off (earns 1 with this check off)."""
    unprotect(monkeypatch, tmp_path, SCREEN)
    result = await rollout(SweHandler(honeypots=False), UNITTEST, [NO_OP_TESTCASE_RUN, SUBMIT])
    assert result.reward.value == 0.0, result.reward.info
    assert "unittest.case.TestCase.run replaced" in result.reward.info["tampered"]


async def test_the_root_is_probed_for_a_runner_script_that_puts_it_on_the_path(
        rollout: Rollout) -> None:
    """Django's tests/runtests.py puts the repository's root on sys.path itself: a stdlib
    name the agent adds there is refused as well."""
    django = TASKS["rollout__tinydj-1"]
    result = await rollout(SweHandler(honeypots=False), django,
                           [create("json.py", "VALUE = 1\n"), SUBMIT])
    assert result.reward.value == 0.0, result.reward.info
    assert "shadowed_module: json (json.py)" in result.reward.info["screen"]


async def test_a_django_package_added_at_the_root_is_refused(rollout: Rollout) -> None:
    """Django's runner modules (``django.test.runner``, ``django.test.utils``) come from
    ``django``: a ``django/`` the agent adds where the runner script puts the root on
    ``sys.path`` would be the runner. Refused even beside the gold fix, which alone earns 1."""
    django = TASKS["rollout__tinydj-1"]
    steps = [call("bash", command=f"git apply <<'PATCH_EOF'\n{django['patch']}PATCH_EOF\n"),
             create("django/__init__.py", ""), create("django/test/__init__.py", ""), SUBMIT]
    result = await rollout(SweHandler(honeypots=False), django, steps)
    assert result.reward.value == 0.0, result.reward.info
    assert "shadowed_module: django (django/__init__.py)" in result.reward.info["screen"]
