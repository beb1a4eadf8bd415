"""A SWE-bench-layout image instance: an image made in the test from the set-up's base image
(Debian + python3) with the repository at /testbed, git, pytest and the conda activation the
harness's eval script sources; graded through the official swebench package's test spec and
log parser (its own venv, scripts/setup_swebench.sh). Gold 1, no-op 0, wrong 0. The same
image as an instance in SWE-bench 5's format (its own eval script, log parser and eval type,
a repository no 4.x table knows), graded with swebench 5; and as an instance that brings the
4.x table entry its repository lacks (a test command and a parser, as SWE-Gym's are run, or a
SWE-rebench row's ``install_config``); and
as a SWE-smith instance (a bug patch over the image's clean repository, graded by SWE-smith's
profile of the repository)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.swe import images as swe_images
from rollout.runtime.envs.swe.handler import SweHandler
from rollout.runtime.handler import HandlerError
from rollout.runtime.sandbox.base import ImageSettings
from rollout.runtime.types import InvalidArgument
from tests.fixtures.images import Registry, base_layout
from tests.runtime.envs.conftest import Rollout, call
from tests.runtime.envs.harbor_helpers import image_factory

pytestmark = pytest.mark.slow
DONE = call("submit", answer="done")
SITE = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / \
    "site-packages"
PYTEST_FILES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py.py")
# What the harness's eval script runs first: `source /opt/miniconda3/bin/activate` and
# `conda activate testbed`. The image's python3 is the environment already.
ACTIVATE = "conda() { :; }\n"
CALC = "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"
TESTS = "from calc import sub\n\n\ndef test_sub():\n    assert sub(5, 3) == 2\n"


def diff(text: str) -> str:
    """A unified diff written with ``~`` for its blank context lines (a lone space)."""
    return "\n".join(" " if line == "~" else line for line in text.split("\n"))


TEST_PATCH = diff("""\
diff --git a/tests/test_calc.py b/tests/test_calc.py
--- a/tests/test_calc.py
+++ b/tests/test_calc.py
@@ -1,5 +1,9 @@
-from calc import sub
+from calc import add, sub
~
~
 def test_sub():
     assert sub(5, 3) == 2
+
+
+def test_add():
+    assert add(2, 3) == 5
""")
GOLD = diff("""\
diff --git a/calc.py b/calc.py
--- a/calc.py
+++ b/calc.py
@@ -1,5 +1,5 @@
 def add(a, b):
-    return a - b
+    return a + b
~
~
 def sub(a, b):
""")


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, env=env).stdout.strip()


@pytest.fixture(scope="module")
def swebench_image(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(``oci:`` reference, base commit) of the instance's image."""
    try:
        swe_images.swebench_python()
    except Exception as e:
        pytest.skip(str(e))
    base = base_layout()
    if base is None or shutil.which("umoci") is None:
        pytest.skip("the cached base image or umoci is missing (bash scripts/setup_images.sh)")
    tmp = tmp_path_factory.mktemp("sweb-image")
    tree = tmp / "tree"
    repo = tree / "testbed"
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(CALC)
    (repo / "tests" / "test_calc.py").write_text(TESTS)
    # The repository's root on sys.path for its tests (a real image pip-installs it).
    (repo / "conftest.py").write_text("")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    commit = git(repo, "rev-parse", "HEAD")
    # A later commit the agent must not find: the fix itself.
    (repo / "calc.py").write_text(CALC.replace("a - b\n\n", "a + b\n\n", 1))
    git(repo, "commit", "-qam", "the fix")
    git(repo, "tag", "fixed")
    git(repo, "checkout", "-q", commit)
    site = tree / "usr" / "local" / "lib" / "python3.11" / "dist-packages"
    site.mkdir(parents=True)
    for name in PYTEST_FILES:
        for src in [SITE / name, *SITE.glob(f"{name}-*.dist-info")]:
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, site / src.name)
    (tree / "usr" / "local" / "bin").mkdir(parents=True)
    launcher = tree / "usr" / "local" / "bin" / "pytest"
    launcher.write_text("#!/usr/bin/python3\nimport sys\nfrom pytest import console_main\n"
                        "sys.exit(console_main())\n")
    launcher.chmod(0o755)
    shutil.copy2(shutil.which("git") or "/usr/bin/git", tree / "usr" / "local" / "bin" / "git")
    (tree / "opt" / "miniconda3" / "bin").mkdir(parents=True)
    (tree / "opt" / "miniconda3" / "bin" / "activate").write_text(ACTIVATE)
    layout = tmp / "layout"
    shutil.copytree(base, layout)
    for args in (("insert", "--rootless", "--image", f"{layout}:base", str(tree), "/"),
                 ("config", "--image", f"{layout}:base", "--config.workingdir", "/testbed")):
        subprocess.run(["umoci", *args], check=True, capture_output=True, timeout=300)
    return f"oci:{layout}:base", commit


@pytest.fixture(scope="module")
def swe_image_settings(tmp_path_factory: pytest.TempPathFactory,
                       image_registry: Registry) -> ImageSettings:
    return image_registry.settings(tmp_path_factory.mktemp("sweb-cache"))


@pytest.fixture
def sandbox_factory(tmp_path: Path, swe_image_settings: ImageSettings) -> Any:
    return image_factory(tmp_path / "state", swe_image_settings)


def instance(image: str, commit: str) -> dict[str, Any]:
    return {"instance_id": "psf__requests-9001", "repo": "psf/requests", "version": "3.0",
            "base_commit": commit, "problem_statement": "add() subtracts instead of adding.",
            "test_patch": TEST_PATCH, "patch": GOLD,
            "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
            "PASS_TO_PASS": '["tests/test_calc.py::test_sub"]', "spec": {"image": image}}


async def test_gold_noop_and_wrong(rollout: Rollout, swebench_image: tuple[str, str]) -> None:
    task = instance(*swebench_image)
    # The later history (the fix, its tag) is gone from the agent's /testbed.
    look = "cd /testbed && git log --all --oneline | wc -l && git tag | wc -l && ls"
    gold = await rollout(SweHandler(), task, [
        call("bash", command=look),
        call("bash", command=f"cd /testbed && git apply <<'EOF'\n{GOLD}EOF\n"), DONE])
    assert "<|im_start|>tool\n1\n0\ncalc.py  conftest.py  tests\n" in gold.prompt_text()
    assert gold.reward.value == 1.0, gold.reward.info["log"]
    assert gold.reward.info["grader"] == "swebench"
    assert gold.reward.info["parser"] == "parse_log_pytest_options"
    assert gold.reward.info["resolution"] == "RESOLVED_FULL"
    assert gold.reward.components == {"fail_to_pass": 1.0, "pass_to_pass": 1.0}

    noop = await rollout(SweHandler(), task, [DONE])
    assert noop.reward.value == 0.0
    assert noop.reward.components == {"fail_to_pass": 0.0, "pass_to_pass": 1.0}
    assert noop.reward.info["failing"] == "tests/test_calc.py::test_add"

    # Wrong: add() fixed by breaking sub(), and the test file edited to pass (put back).
    wrong_cmd = ("cd /testbed && sed -i 's/return a - b/return a + b/' calc.py && "
                 "printf 'def test_add():\\n    pass\\n' > tests/test_calc.py")
    wrong = await rollout(SweHandler(), task, [call("bash", command=wrong_cmd), DONE])
    assert wrong.reward.value == 0.0
    assert wrong.reward.components == {"fail_to_pass": 1.0, "pass_to_pass": 0.0}
    assert "tests/test_calc.py" in wrong.reward.info["restored"]


async def test_a_forged_result_line_earns_0(rollout: Rollout,
                                            swebench_image: tuple[str, str]) -> None:
    # The change prints the parser's result line for the failing test when the test run's
    # process exits, after pytest's own summary: the log then says every test passed.
    forge = ("cd /testbed && cat >> calc.py <<'EOF'\nimport atexit, os\n"
             "atexit.register(lambda: os.write(1, b'PASSED tests/test_calc.py::test_add\\n'))"
             "\nEOF\n")
    result = await rollout(SweHandler(), instance(*swebench_image),
                           [call("bash", command=forge), DONE])
    assert result.reward.value == 0.0
    assert result.reward.components["fail_to_pass"] == 1.0  # the parser was fooled
    assert "disagrees with the log" in result.reward.info["error"]
    assert result.reward.info["exit_status"] == "1"


def test_image_instances_are_validated() -> None:
    task = instance("docker://swebench/sweb.eval.x86_64.psf_1776_requests-9001:latest", "abc1234")
    SweHandler().validate_task(task)
    table = {"image": "docker://x/y:1", "test_cmd": "pytest -rA",
             "log_parser": "parse_log_pytest"}
    SweHandler().validate_task({**task, "spec": table})
    for change, field in (({"spec": {"image": "swebench/sweb"}}, "task.spec.image"),
                          ({"spec": {"image": "docker://x/y:1", "python": "3.11"}}, "task.spec"),
                          ({"spec": {**table, "test_cmd": ""}}, "task.spec.test_cmd"),
                          ({"spec": {**table, "log_parser": "x"}}, "task.spec.log_parser"),
                          ({"spec": {"image": "docker://x/y:1", "install": "x"}},
                           "task.spec.test_cmd"),
                          ({"spec": {**table, "eval_commands": "x"}}, "task.spec.eval_commands"),
                          ({"version": ""}, "task.version"), ({"repo": "requests"}, "task.repo"),
                          ({"FAIL_TO_PASS": []}, "task.FAIL_TO_PASS")):
        with pytest.raises(InvalidArgument) as err:
            SweHandler().validate_task({**task, **change})
        assert err.value.field == field, change


def eval_script5(commit: str, *, with_test_patch: bool = True) -> str:
    """An eval script as SWE-bench 5's data sets carry one (the shape of the harness's own):
    activation, the test file reset to the base, the test patch in a here-document, the test
    command between the markers, the reset again. ``with_test_patch=False``: one that expects
    the test patch in the tree already (no reset, no here-document)."""
    reset = f"git checkout {commit} tests/test_calc.py\n" if with_test_patch else ""
    apply = (f"{reset}git apply -v - <<'EOF_114329324912'\n{TEST_PATCH}\nEOF_114329324912\n"
             if with_test_patch else "")
    return ("#!/bin/bash\nset -uxo pipefail\nsource /opt/miniconda3/bin/activate\n"
            f"conda activate testbed\ncd /testbed\n{apply}: '>>>>> Start Test Output'\n"
            f"pytest -rA tests/test_calc.py\n: '>>>>> End Test Output'\n{reset}")


def instance5(image: str, commit: str, **change: Any) -> dict[str, Any]:
    """SWE-bench 5's format: a top-level ``image`` and the instance's own eval script, parser
    and eval type; a repository the 4.x tables do not have."""
    task = {**instance(image, commit), "instance_id": "acme__calc-7", "repo": "acme/calc",
            "version": "0.1", "image": image, "eval_script": eval_script5(commit),
            "log_parser": "parse_log_pytest", "eval_type": "pass_and_fail", **change}
    del task["spec"]
    return task


async def test_an_instance_with_its_own_eval_script_is_graded_by_swebench_5(
        rollout: Rollout, swebench_image: tuple[str, str]) -> None:
    image, commit = swebench_image
    task = instance5(image, commit)
    assert swe_images.is_image_instance(task)
    gold = await rollout(SweHandler(), task, [
        call("bash", command=f"cd /testbed && git apply <<'EOF'\n{GOLD}EOF\n"), DONE])
    assert gold.reward.value == 1.0, gold.reward.info
    assert gold.reward.info["harness"].startswith("5.")
    assert gold.reward.info["parser"] == "parse_log_pytest"
    assert gold.reward.info["eval_type"] == "pass_and_fail"
    assert gold.reward.components == {"fail_to_pass": 1.0, "pass_to_pass": 1.0}

    noop = await rollout(SweHandler(), task, [DONE])
    assert noop.reward.value == 0.0, noop.reward.info
    assert noop.reward.info["failing"] == "tests/test_calc.py::test_add"

    # A script that expects the test patch in the tree already (no here-document of it).
    bare = instance5(image, commit, eval_script=eval_script5(commit, with_test_patch=False))
    gold = await rollout(SweHandler(), bare, [
        call("bash", command=f"cd /testbed && git apply <<'EOF'\n{GOLD}EOF\n"), DONE])
    assert gold.reward.value == 1.0, gold.reward.info

    # Neither harness can grade these, and INIT says so before the agent runs.
    past_init: list[Any] = []
    for change, said in (({"log_parser": "parse_log_nothing"}, "no log parser"),
                         ({"eval_script": None, "log_parser": None, "eval_type": None},
                          "no specs for the repository 'acme/calc'")):
        task = {k: v for k, v in instance5(image, commit, **change).items() if v is not None}
        with pytest.raises(HandlerError, match=said) as err:
            await rollout(SweHandler(), task, [DONE], inspect=past_init.append)
        assert err.value.reason == "INVALID_TASK" and not past_init


async def test_an_instance_with_the_harness_entry_its_repository_lacks(
        rollout: Rollout, swebench_image: tuple[str, str]) -> None:
    image, commit = swebench_image
    task = {**instance(image, commit), "instance_id": "acme__calc-8", "repo": "acme/calc",
            "version": "0.1", "spec": {"image": image, "test_cmd": "pytest -rA",
                                       "log_parser": "parse_log_pytest"}}
    gold = await rollout(SweHandler(), task, [
        call("bash", command=f"cd /testbed && git apply <<'EOF'\n{GOLD}EOF\n"), DONE])
    assert gold.reward.value == 1.0, gold.reward.info
    # The harness made the script: its test command with the test patch's file appended.
    assert gold.reward.info["test_cmd"] == "pytest -rA"
    assert "pytest -rA tests/test_calc.py" in gold.reward.info["log"]
    assert gold.reward.info["parser"] == "parse_log_pytest"
    noop = await rollout(SweHandler(), task, [DONE])
    assert noop.reward.value == 0.0, noop.reward.info
    assert noop.reward.components == {"fail_to_pass": 0.0, "pass_to_pass": 1.0}


def rebench_row(image: str, commit: str, **config: Any) -> dict[str, Any]:
    """A SWE-rebench row as its data set exports it: ``docker_image`` (no transport), the
    repository's harness entry in ``install_config`` beside the keys that built the image, a
    null for every key another row has, the tests as JSON strings, a repository no 4.x table
    knows."""
    task = {k: v for k, v in instance(image, commit).items() if k != "spec"}
    return {**task, "instance_id": "acme__calc-9", "repo": "acme/calc", "version": "0.9",
            "docker_image": image, "environment_setup_commit": commit, "hints_text": "",
            "created_at": "2025-01-08T12:00:00Z", "requirements": "pytest\n",
            "FAIL_TO_PASS": '["tests/test_calc.py::test_add"]',
            "meta": {"has_test_patch": True, "is_lite": False},
            "install_config": {"python": "3.11", "packages": "requirements.txt",
                               "pip_packages": ["pytest"], "pre_install": None,
                               "reqs_path": ["requirements.txt"], "env_yml_path": None,
                               "no_use_env": None, "eval_commands": None,
                               "install": "printf 'rebench-%s\\n' installed",
                               "test_cmd": "pytest -rA", "log_parser": "parse_log_pytest",
                               **config}}


async def test_a_swe_rebench_row_is_graded_with_its_install_config(
        rollout: Rollout, swebench_image: tuple[str, str]) -> None:
    image, commit = swebench_image
    task = rebench_row(image, commit)
    assert swe_images.is_image_instance(task) and swe_images.image_of(task) == image
    gold = await rollout(SweHandler(), task, [
        call("bash", command=f"cd /testbed && git apply <<'EOF'\n{GOLD}EOF\n"), DONE])
    assert gold.reward.value == 1.0, gold.reward.info
    # The harness made the script from the row's entry: its install step ran before the
    # tests (the output, not the trace, says so), then its test command and the test file.
    assert "rebench-installed" in gold.reward.info["log"]
    assert "pytest -rA tests/test_calc.py" in gold.reward.info["log"]
    assert (gold.reward.info["test_cmd"], gold.reward.info["parser"]) == (
        "pytest -rA", "parse_log_pytest")
    noop = await rollout(SweHandler(), task, [DONE])
    assert noop.reward.value == 0.0, noop.reward.info
    assert noop.reward.components == {"fail_to_pass": 0.0, "pass_to_pass": 1.0}
    # A parser the harness does not have: refused at INIT, before the agent runs.
    past_init: list[Any] = []
    with pytest.raises(HandlerError, match="no log parser") as err:
        await rollout(SweHandler(), rebench_row(image, commit, log_parser="parse_log_nothing"),
                      [DONE], inspect=past_init.append)
    assert err.value.reason == "INVALID_TASK" and not past_init


def test_swe_rebench_rows_are_validated() -> None:
    task = rebench_row("swerebench/sweb.eval.x86_64.acme_1776_calc-9", "abc1234")
    SweHandler().validate_task(task)
    assert swe_images.image_of(task) == "docker://swerebench/sweb.eval.x86_64.acme_1776_calc-9"
    assert swe_images.instance_fields(task)["harness_spec"] == {
        "test_cmd": "pytest -rA", "log_parser": "parse_log_pytest",
        "install": "printf 'rebench-%s\\n' installed"}
    # A SWE-bench row as R2E-Gym's data sets carry it: 'docker_image', graded by the 4.x
    # tables for its repo and version.
    plain = {**{k: v for k, v in instance("x", "abc1234").items() if k != "spec"},
             "docker_image": "slimshetty/swebench-verified:sweb.eval.x86_64.psf__requests-9001"}
    SweHandler().validate_task(plain)
    assert swe_images.is_image_instance(plain) and "harness_spec" not in \
        swe_images.instance_fields(plain)
    assert swe_images.image_of(plain) == f"docker://{plain['docker_image']}"
    config = task["install_config"]
    for change, field in (({"install_config": {**config, "test_cmd": None}},
                           "task.install_config.test_cmd"),
                          ({"install_config": {**config, "log_parser": "pytest"}},
                           "task.install_config.log_parser"),
                          ({"install_config": {**config, "eval_commands": "make"}},
                           "task.install_config.eval_commands"),
                          ({"install_config": {"python": "3.11"}}, "task.install_config"),
                          ({"install_config": "pytest -rA"}, "task.install_config"),
                          ({"docker_image": "UPPER/x"}, "task.docker_image"),
                          ({"spec": {"image": "docker://x/y:1"}}, "task.install_config"),
                          ({"eval_script": eval_script5("abc1234"),
                            "log_parser": "parse_log_pytest"}, "task.install_config")):
        with pytest.raises(InvalidArgument) as err:
            SweHandler().validate_task({**task, **change})
        assert err.value.field == field, change


def test_a_row_that_names_no_repository_is_told_the_ways_to_name_one() -> None:
    row = {k: v for k, v in rebench_row("x/y:1", "abc1234").items()
           if k not in ("docker_image", "install_config")}
    with pytest.raises(InvalidArgument, match="'docker_image' \\(SWE-rebench's\\)") as err:
        SweHandler().validate_task(row)
    assert err.value.field == "task.repo_source" and "V2" not in str(err.value)
    with pytest.raises(InvalidArgument, match="SWE-rebench V2's") as err:
        SweHandler().validate_task({**row, "image_name": "swerebench/x"})
    assert err.value.field == "task.repo_source"


def test_prepare_fetches_the_images_of_every_instance_format_once(
        tmp_path: Path, swebench_image: tuple[str, str],
        capsys: pytest.CaptureFixture[str]) -> None:
    """``rollout tasks prepare`` on a file of image instances in each format (spec.image with
    the harness's entry, SWE-bench 5, SWE-rebench, SWE-smith): their one image is fetched into
    the cache once; there is no environment to build."""
    from rollout.runtime.tasksets import shipped

    image, commit = swebench_image
    rows = [instance(image, commit), instance5(image, commit), rebench_row(image, commit),
            smith_instance(image),
            {**instance(image, commit), "instance_id": "acme__calc-8",
             "spec": {"image": image, "test_cmd": "pytest -rA", "log_parser": "parse_log_pytest"}}]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"environment": "swe", "task": t}) + "\n" for t in rows))
    argv = ["prepare", str(tasks), "--wheelhouse", str(tmp_path / "wheelhouse"),
            "--state-dir", str(tmp_path / "state"), "--image-cache", str(tmp_path / "cache")]
    for action in ("pulled", "cached"):
        assert shipped.main(argv) == 0, capsys.readouterr().err
        out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        images = [r for r in out if "image" in r]
        assert [(r["image"], r["action"]) for r in images] == [(image, action)], out
        assert not any("env" in r for r in out)
    # A row the server would refuse stops prepare before any work, saying why.
    tasks.write_text(json.dumps({"environment": "swe", "task": {
        **rebench_row(image, commit), "install_config": {"python": "3.9"}}}) + "\n")
    assert shipped.main(argv) == 2
    assert "install_config" in capsys.readouterr().err


def test_swebench_5_fields_are_validated() -> None:
    task = instance5("swebench/sweb.eval.x86_64.acme_1776_calc-7:latest", "abc1234")
    SweHandler().validate_task(task)
    assert swe_images.image_of(task) == "docker://swebench/sweb.eval.x86_64.acme_1776_calc-7:latest"
    for change, field in (({"eval_script": ""}, "task.eval_script"),
                          ({"eval_script": "pytest"}, "task.eval_script"),
                          ({"log_parser": "x; rm -rf /"}, "task.log_parser"),
                          ({"log_parser": None}, "task.log_parser"),
                          ({"eval_type": "some"}, "task.eval_type"),
                          ({"image": "docker://"}, "task.image"),
                          ({"spec": {"image": "docker://x/y:1", "test_cmd": "pytest",
                                     "log_parser": "parse_log_pytest"}}, "task.spec")):
        with pytest.raises(InvalidArgument) as err:
            SweHandler().validate_task({k: v for k, v in {**task, **change}.items()
                                        if v is not None})
        assert err.value.field == field, change


def sub_diff(old: str, new: str) -> str:
    """A diff of ``calc.py``'s ``sub`` returning ``new`` instead of ``old``."""
    return diff(f"""\
diff --git a/calc.py b/calc.py
--- a/calc.py
+++ b/calc.py
@@ -3,4 +3,4 @@ def add(a, b):
~
~
 def sub(a, b):
-    return {old}
+    return {new}
""")


BUG = sub_diff("a - b", "a + b")
FIX = sub_diff("a + b", "a - b")


def smith_instance(image: str) -> dict[str, Any]:
    """A SWE-smith row (no base_commit, no test_patch; ``patch`` makes the bug) of a
    repository SWE-smith has a Python profile of, on the test's image."""
    return {"instance_id": "getmoto__moto.694ce1f4.func_pm_op_swap__calc1",
            "repo": "swesmith/getmoto__moto.694ce1f4", "image_name": image, "patch": BUG,
            "problem_statement": "sub() adds its arguments.",
            "FAIL_TO_PASS": ["tests/test_calc.py::test_sub"], "PASS_TO_PASS": []}


async def test_a_swe_smith_instance_gets_its_bug_and_swe_smiths_grading(
        rollout: Rollout, swebench_image: tuple[str, str]) -> None:
    task = smith_instance(swebench_image[0])
    assert swe_images.is_image_instance(task)
    # The bug is in the tree and nowhere in the history: one commit, no other ref.
    look = "cd /testbed && git rev-list --all | wc -l && git for-each-ref | wc -l && git status -s"
    fixed = await rollout(SweHandler(), task, [
        call("bash", command=look),
        call("bash", command=f"cd /testbed && git apply <<'EOF'\n{FIX}EOF\n"), DONE])
    assert "<|im_start|>tool\n1\n1\n<|im_end|>" in fixed.prompt_text()
    assert fixed.reward.value == 1.0, fixed.reward.info
    assert fixed.reward.info["grader"] == "swesmith"
    assert fixed.reward.info["parser"] == "Moto694ce1f4.log_parser"
    assert fixed.reward.info["test_cmd"].endswith("--verbose tests/test_calc.py")
    assert fixed.reward.components == {"fail_to_pass": 1.0, "pass_to_pass": 1.0}

    noop = await rollout(SweHandler(), task, [DONE])
    assert noop.reward.value == 0.0
    assert noop.reward.info["failing"] == "tests/test_calc.py::test_sub"

    # The test rewritten to pass is put back before the tests run.
    cheat = "cd /testbed && printf 'def test_sub():\\n    pass\\n' > tests/test_calc.py"
    wrong = await rollout(SweHandler(), task, [call("bash", command=cheat), DONE])
    assert wrong.reward.value == 0.0 and "tests/test_calc.py" in wrong.reward.info["restored"]

    # A bug that does not apply to the image is the task's fault, found at INIT.
    with pytest.raises(HandlerError, match="does not apply") as err:
        await rollout(SweHandler(), {**task, "patch": BUG.replace("a - b", "a * b")}, [DONE])
    assert err.value.reason == "INVALID_TASK"


def test_swe_smith_rows_are_validated() -> None:
    task = smith_instance("jyangballin/swesmith.x86_64.getmoto_1776_moto.694ce1f4")
    SweHandler().validate_task(task)
    for change, field in (({"patch": "not a diff"}, "task.patch"),
                          ({"image_name": "UPPER/x"}, "task.image_name"),
                          ({"FAIL_TO_PASS": []}, "task.FAIL_TO_PASS"),
                          ({"problem_statement": ""}, "task.problem_statement")):
        with pytest.raises(InvalidArgument) as err:
            SweHandler().validate_task({**task, **change})
        assert err.value.field == field, change


@pytest.mark.parametrize("recorded", [False, True])
def test_the_test_commands_exit_status_is_recorded_under_the_nonce(recorded: bool) -> None:
    """Whether or not the script records the status itself (swebench 5's ``VAR=$?`` before
    the end marker), the nonce line carries the test command's own status, not 0."""
    own = ["SWEBENCH_TEST_EXIT_CODE=$?"] if recorded else []
    script = "\n".join(["#!/bin/bash", "set -uxo pipefail", ": '>>>>> Start Test Output'",
                        "(exit 3)", *own, ": '>>>>> End Test Output'", "true", ""])
    run = subprocess.run(["bash", "-c", swe_images.with_exit_status(script, "n0nce")],
                         capture_output=True, text=True, timeout=30)
    assert "ROLLOUT_EXIT_n0nce=3" in run.stdout, run.stdout + run.stderr
