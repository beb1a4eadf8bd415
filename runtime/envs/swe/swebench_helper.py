"""Runs in the ``swebench`` venv (scripts/setup_swebench.sh), never in the server's: the official
SWE-bench harness's test spec and grading for one instance, as JSON on stdin and stdout.

    python swebench_helper.py eval-script   < {"instance": {...}}
        -> {"eval_script": "...", "test_cmd": "...", "parser": "parse_log_pytest"}
    python swebench_helper.py grade         < {"instance": {...}, "log": "..."}
        -> {"found": true, "status_map": {...}, "report": {...}, "resolution": "RESOLVED_FULL",
            "fail_to_pass": 1.0, "pass_to_pass": 1.0}

``eval-script`` is the harness's own eval script for the instance's repository and version
(``make_eval_script_list``: environment activation, the test files reset to the base commit,
the test patch applied, the repository's test command with the instance's test directives
between the output markers). ``grade`` reads a run's log with the harness's parser for the
repository (``get_logs_eval``: the part between the markers) and judges it with the harness's
FAIL_TO_PASS / PASS_TO_PASS report (``get_eval_tests_report``, ``get_resolution_status``).

Two formats of instance, two versions of the harness in one venv:

- **4.x** (``swebench`` itself in the venv): the instance names its ``repo`` and ``version``,
  and the harness's per-repository tables give the test command, the eval script and the
  parser; a repository or version missing from them cannot be graded.
  An instance of a repository the tables lack (SWE-Gym's, say) may bring the table entry
  itself as ``harness_spec`` (``test_cmd``, ``log_parser``, optionally ``eval_commands`` and
  ``install``): it is entered into the tables for this one process and the harness makes the
  eval script and reads the log exactly as for its own repositories (Python test runners).
- **5.x** (``swebench5/`` in the venv, put first on ``sys.path`` for these instances only):
  SWE-bench 5 data sets carry each instance's ``eval_script``, ``log_parser`` (a name in the
  harness's parser registry) and ``eval_type``, so any repository in any of the harness's
  languages is graded as the data set says. The eval script is returned without 5.x's own
  exit-status line: the server records the test command's status under a nonce the code under
  test never sees (a fixed marker it could print itself).

SWE-smith instances (:mod:`.smith`) are graded by SWE-smith's profile of their repository
(``swesmith/`` in the venv: the ``swesmith`` package, which imports with 4.x's dependencies):

    python swebench_helper.py smith-spec    < {"instance": {...}}
        -> {"eval_script": "...", "test_cmd": "...", "parser": "Moto694ce1f4.log_parser"}
    python swebench_helper.py smith-grade   < {"instance": {...}, "log": "..."}
        -> as ``grade``

The server reads this file as text and starts it with the venv's interpreter; it imports
nothing of the service, and the service never imports it (the harness's top-level import pulls
in docker, datasets and modal, which the server's venv does not carry).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from typing import Any

SWEBENCH5_DIR = "swebench5"
"""Where scripts/setup_swebench.sh installs swebench 5 inside the venv (beside 4.x)."""
SWESMITH_DIR = "swesmith"
"""Where it installs the ``swesmith`` package (SWE-smith's repository profiles)."""


def carries_eval_script(instance: dict[str, Any]) -> bool:
    """An instance in SWE-bench 5's format: its own eval script and log parser."""
    return isinstance(instance.get("eval_script"), str) and bool(instance.get("log_parser"))


def _load_harness(five: bool) -> None:
    """Make ``import swebench`` give the version this instance's format needs, or say why not
    (a ``LookupError``: the instance cannot be graded with what is installed)."""
    if five:
        extra = os.path.join(sys.prefix, SWEBENCH5_DIR)
        if os.path.isdir(extra):
            sys.path.insert(0, extra)
    has_tables = importlib.util.find_spec("swebench.harness.test_spec") is not None
    if five and has_tables:
        raise LookupError("the instance carries its own eval_script and log_parser (SWE-bench "
                          "5's format), which needs swebench 5: re-run `bash "
                          "scripts/setup_swebench.sh` (it installs both), or point "
                          "$ROLLOUT_SWEBENCH_PYTHON at a venv with swebench>=5")
    if not five and not has_tables:
        raise LookupError("this swebench (5 or later) has no per-repository specs: the "
                          "instance must carry eval_script, log_parser and eval_type, as "
                          "SWE-bench 5's data sets do")


def _parser_named(name: str) -> Any:
    """A 4.x log parser by its function name (4.x files them by repository only)."""
    import importlib

    for module in ("python", "javascript", "go", "java", "rust", "php", "ruby", "c"):
        found = getattr(importlib.import_module(f"swebench.harness.log_parsers.{module}"),
                        name, None)
        if name.startswith("parse_log_") and callable(found):
            return found
    raise LookupError(f"the SWE-bench harness has no log parser {name!r}")


def _enter_spec(instance: dict[str, Any]) -> None:
    """The instance's own table entry (``harness_spec``), entered into the harness's tables
    for this process: the test command (and extra eval commands, an install step) under its
    repository and version, a Python repository, and the parser it names."""
    from swebench.harness.constants import MAP_REPO_TO_EXT, MAP_REPO_VERSION_TO_SPECS
    from swebench.harness.log_parsers import MAP_REPO_TO_PARSER

    given = instance["harness_spec"]
    repo, version = instance["repo"], str(instance["version"])
    entry = {k: given[k] for k in ("test_cmd", "eval_commands", "install") if k in given}
    MAP_REPO_VERSION_TO_SPECS.setdefault(repo, {})[version] = entry
    MAP_REPO_TO_EXT[repo] = "py"
    MAP_REPO_TO_PARSER[repo] = _parser_named(str(given["log_parser"]))


def _test_spec(instance: dict[str, Any]) -> Any:
    from swebench.harness.constants import MAP_REPO_TO_EXT, MAP_REPO_VERSION_TO_SPECS
    from swebench.harness.test_spec.create_scripts import make_eval_script_list
    from swebench.harness.test_spec.test_spec import TestSpec

    if instance.get("harness_spec"):
        _enter_spec(instance)
    repo, version = instance["repo"], str(instance["version"])
    if repo not in MAP_REPO_VERSION_TO_SPECS:
        raise LookupError(f"the SWE-bench harness has no specs for the repository {repo!r}")
    if version not in MAP_REPO_VERSION_TO_SPECS[repo]:
        raise LookupError(f"the SWE-bench harness has no specs for {repo} version {version!r} "
                          f"(it has {sorted(MAP_REPO_VERSION_TO_SPECS[repo])})")
    specs = MAP_REPO_VERSION_TO_SPECS[repo][version]
    instance = {**instance, "version": version}
    eval_list = make_eval_script_list(instance, specs, "testbed", "/testbed",
                                      instance["base_commit"], instance["test_patch"])
    listed = {k: json.loads(v) if isinstance(v, str) else v for k, v in instance.items()
              if k in ("FAIL_TO_PASS", "PASS_TO_PASS")}
    # The image exists already, so the scripts that build one are not made (the harness
    # makes them by fetching the repository's requirements from the network).
    return TestSpec(instance_id=instance["instance_id"], repo=repo, version=version,
                    env_script_list=[], repo_script_list=[], eval_script_list=eval_list,
                    arch="x86_64", FAIL_TO_PASS=listed.get("FAIL_TO_PASS", []),
                    PASS_TO_PASS=listed.get("PASS_TO_PASS", []),
                    language=MAP_REPO_TO_EXT[repo], docker_specs=specs.get("docker_specs", {}),
                    namespace=None), specs


def _test_spec5(instance: dict[str, Any]) -> Any:
    from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT, EvalType
    from swebench.harness.log_parsers import PARSER_REGISTRY
    from swebench.harness.utils import make_test_spec

    parser = str(instance["log_parser"])
    if parser not in PARSER_REGISTRY:
        raise LookupError(f"the SWE-bench harness has no log parser {parser!r} (it has "
                          f"{', '.join(sorted(PARSER_REGISTRY))})")
    eval_type = str(instance.get("eval_type") or EvalType.PASS_AND_FAIL.value)
    if eval_type not in {t.value for t in EvalType}:
        raise LookupError(f"eval_type {eval_type!r} is not one of the harness's "
                          f"{sorted(t.value for t in EvalType)}")
    script = str(instance["eval_script"])
    if START_TEST_OUTPUT not in script or END_TEST_OUTPUT not in script:
        raise LookupError(f"the instance's eval_script must print the harness's markers "
                          f"{START_TEST_OUTPUT!r} and {END_TEST_OUTPUT!r} around the tests")
    return make_test_spec({**instance, "version": str(instance.get("version", "")),
                           "image": str(instance.get("image", "")), "log_parser": parser,
                           "eval_type": eval_type})


def _eval_script5(instance: dict[str, Any]) -> dict[str, Any]:
    from swebench.harness.utils import parse_eval_script

    spec = _test_spec5(instance)
    script = "\n".join(["#!/bin/bash", "set -uxo pipefail",
                         *parse_eval_script(str(instance["eval_script"]))]) + "\n"
    return {"eval_script": script, "test_cmd": "", "parser": spec.log_parser,
            "eval_type": spec.eval_type, "harness": _version()}


def _version() -> str:
    import swebench

    return str(getattr(swebench, "__version__", ""))


def eval_script(instance: dict[str, Any]) -> dict[str, Any]:
    five = carries_eval_script(instance)
    _load_harness(five)
    if five:
        return _eval_script5(instance)
    from swebench.harness.log_parsers import MAP_REPO_TO_PARSER

    spec, specs = _test_spec(instance)
    test_cmd = specs["test_cmd"]
    return {"eval_script": spec.eval_script,
            "test_cmd": test_cmd if isinstance(test_cmd, str) else " ".join(test_cmd),
            "parser": getattr(MAP_REPO_TO_PARSER[spec.repo], "__name__", ""),
            "eval_type": "", "harness": _version()}


def grade(instance: dict[str, Any], log: str) -> dict[str, Any]:
    five = carries_eval_script(instance)
    _load_harness(five)
    from swebench.harness.constants import EvalType
    from swebench.harness.grading import (
        compute_fail_to_pass,
        compute_pass_to_pass,
        get_eval_tests_report,
        get_logs_eval,
        get_resolution_status,
    )

    spec = _test_spec5(instance) if five else _test_spec(instance)[0]
    with tempfile.NamedTemporaryFile("w", suffix=".log") as f:
        f.write(log)
        f.flush()
        status_map, found = get_logs_eval(spec, f.name)
    if not found:
        return {"found": False, "status_map": {}, "report": {}, "resolution": "RESOLVED_NO",
                "fail_to_pass": 0.0, "pass_to_pass": 0.0}
    if five:
        eval_type = EvalType(spec.eval_type)
    else:
        from swebench.harness.constants import FAIL_ONLY_REPOS

        eval_type = (EvalType.FAIL_ONLY if spec.repo in FAIL_ONLY_REPOS
                     else EvalType.PASS_AND_FAIL)
    report = get_eval_tests_report(status_map, {"instance_id": spec.instance_id,
                                                "FAIL_TO_PASS": spec.FAIL_TO_PASS,
                                                "PASS_TO_PASS": spec.PASS_TO_PASS},
                                   eval_type=eval_type)
    return {"found": True, "status_map": status_map, "report": report,
            "resolution": get_resolution_status(report),
            "fail_to_pass": compute_fail_to_pass(report),
            "pass_to_pass": compute_pass_to_pass(report)}


def _profile(instance: dict[str, Any]) -> Any:
    extra = os.path.join(sys.prefix, SWESMITH_DIR)
    if os.path.isdir(extra):
        sys.path.append(extra)  # after 4.x's swebench, which swesmith imports
    if importlib.util.find_spec("swesmith") is None:
        raise LookupError("SWE-smith instances need the swesmith package: re-run `bash "
                          "scripts/setup_swebench.sh` (it installs it beside the harness)")
    from swesmith.profiles import registry

    try:
        return registry.get_from_inst(instance)
    except KeyError:
        raise LookupError(f"SWE-smith has no profile for the repository "
                          f"{instance.get('repo')!r}") from None


def smith_spec(instance: dict[str, Any]) -> dict[str, Any]:
    """The eval script SWE-smith's harness runs for the instance: its profile's test command
    (over the files of the named tests where the profile tests only those) between the
    markers, in /testbed, traced."""
    profile = _profile(instance)
    from swesmith.constants import TEST_OUTPUT_END, TEST_OUTPUT_START

    test_cmd, _ = profile.get_test_cmd(instance)
    script = "\n".join(["#!/bin/bash", "set -uxo pipefail", "cd /testbed",
                         f": '{TEST_OUTPUT_START}'", test_cmd, f": '{TEST_OUTPUT_END}'"]) + "\n"
    import swesmith

    return {"eval_script": script, "test_cmd": test_cmd,
            "parser": f"{type(profile).__name__}.log_parser",
            "harness": f"swesmith {getattr(swesmith, '__version__', '')}".strip()}


def smith_grade(instance: dict[str, Any], log: str) -> dict[str, Any]:
    """The log read with the profile's parser (the part SWE-smith reads: between the traced
    markers) and judged by SWE-smith's FAIL_TO_PASS / PASS_TO_PASS report."""
    profile = _profile(instance)
    from swebench.harness.grading import (
        compute_fail_to_pass,
        compute_pass_to_pass,
        get_resolution_status,
    )
    from swesmith.harness.grading import get_eval_tests_report, read_test_output

    with tempfile.NamedTemporaryFile("w", suffix=".log") as f:
        f.write(log)
        f.flush()
        content, found = read_test_output(f.name)
    status_map = profile.log_parser(content) if found and content is not None else {}
    if not found or not status_map:
        return {"found": False, "status_map": {}, "report": {}, "resolution": "RESOLVED_NO",
                "fail_to_pass": 0.0, "pass_to_pass": 0.0}
    listed = {k: json.loads(v) if isinstance(v, str) else v for k, v in instance.items()
              if k in ("FAIL_TO_PASS", "PASS_TO_PASS")}
    report = get_eval_tests_report(status_map, {"FAIL_TO_PASS": listed.get("FAIL_TO_PASS", []),
                                                "PASS_TO_PASS": listed.get("PASS_TO_PASS", [])})
    return {"found": True, "status_map": status_map, "report": report,
            "resolution": get_resolution_status(report),
            "fail_to_pass": compute_fail_to_pass(report),
            "pass_to_pass": compute_pass_to_pass(report)}


def main(argv: list[str]) -> int:
    request = json.loads(sys.stdin.read())
    try:
        if argv[1:] == ["eval-script"]:
            result = eval_script(request["instance"])
        elif argv[1:] == ["grade"]:
            result = grade(request["instance"], request["log"])
        elif argv[1:] == ["smith-spec"]:
            result = smith_spec(request["instance"])
        elif argv[1:] == ["smith-grade"]:
            result = smith_grade(request["instance"], request["log"])
        else:
            sys.stderr.write("usage: swebench_helper.py eval-script|grade|smith-spec|smith-grade "
                             "< request.json\n")
            return 2
    except (LookupError, ValueError) as e:
        result = {"error": str(e)}
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
