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

The server reads this file as text and starts it with the venv's interpreter; it imports
nothing of the service, and the service never imports it (the harness's top-level import pulls
in docker, datasets and modal, which the server's venv does not carry).
"""

from __future__ import annotations

import json
import sys
import tempfile
from typing import Any


def _test_spec(instance: dict[str, Any]) -> Any:
    from swebench.harness.constants import MAP_REPO_TO_EXT, MAP_REPO_VERSION_TO_SPECS
    from swebench.harness.test_spec.create_scripts import make_eval_script_list
    from swebench.harness.test_spec.test_spec import TestSpec

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


def eval_script(instance: dict[str, Any]) -> dict[str, Any]:
    from swebench.harness.log_parsers import MAP_REPO_TO_PARSER

    spec, specs = _test_spec(instance)
    test_cmd = specs["test_cmd"]
    return {"eval_script": spec.eval_script,
            "test_cmd": test_cmd if isinstance(test_cmd, str) else " ".join(test_cmd),
            "parser": getattr(MAP_REPO_TO_PARSER[spec.repo], "__name__", "")}


def grade(instance: dict[str, Any], log: str) -> dict[str, Any]:
    from swebench.harness.constants import FAIL_ONLY_REPOS, EvalType
    from swebench.harness.grading import (
        compute_fail_to_pass,
        compute_pass_to_pass,
        get_eval_tests_report,
        get_logs_eval,
        get_resolution_status,
    )

    spec, _ = _test_spec(instance)
    with tempfile.NamedTemporaryFile("w", suffix=".log") as f:
        f.write(log)
        f.flush()
        status_map, found = get_logs_eval(spec, f.name)
    if not found:
        return {"found": False, "status_map": {}, "report": {}, "resolution": "RESOLVED_NO",
                "fail_to_pass": 0.0, "pass_to_pass": 0.0}
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


def main(argv: list[str]) -> int:
    request = json.loads(sys.stdin.read())
    try:
        if argv[1:] == ["eval-script"]:
            result = eval_script(request["instance"])
        elif argv[1:] == ["grade"]:
            result = grade(request["instance"], request["log"])
        else:
            sys.stderr.write("usage: swebench_helper.py eval-script|grade < request.json\n")
            return 2
    except (LookupError, ValueError) as e:
        result = {"error": str(e)}
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
