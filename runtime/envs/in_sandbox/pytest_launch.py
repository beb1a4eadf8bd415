"""Starts pytest for the swe grader. Runs INSIDE the grading sandbox (stdlib and the task
environment's pytest only), passed to ``python -c`` as text after ``runner_start.py``'s.

``python -c SOURCE WORKSPACE [PYTEST ARGS ...]``. ``python -m pytest`` would put the repository
first on ``sys.path`` before pytest is imported: a ``pytest.py`` or ``_pytest/`` the agent adds
would be the test runner (and could write the report itself), and a file named like the report
plugin would replace it. So pytest and the plugin are imported from the environment first, with
every directory of the repository off ``sys.path`` (``runner_start.py``: the plugin takes its
fingerprints then, before any repository code can run), and only then does the repository go
to the front of ``sys.path``, where ``python -m pytest`` would have put it for the code under
test, once the repository is found to shadow none of the modules loaded so far.
"""
import sys

import pytest
import rollout_pytest_report  # noqa: F401

_start = globals()["_start"]  # runner_start.py's, whose text comes first


def _rootdirs(args):
    """The folders pytest's default import mode puts on ``sys.path`` for the test files run:
    the first folder above each file that is not a package."""
    import os
    found = []
    for arg in args:
        path = arg.split("::")[0]
        if not path.endswith(".py"):
            continue
        folder = os.path.dirname(os.path.join(sys.argv[1], path))
        while os.path.isfile(os.path.join(folder, "__init__.py")):
            folder = os.path.dirname(folder)
        found.append(folder)
    return found


_plugins = [sys.argv[i + 1].partition(".")[0] for i in range(2, len(sys.argv) - 1)
            if sys.argv[i] == "-p"]
_start.reopen(front=[sys.argv[1]], probe=_rootdirs(sys.argv[2:]), names=_plugins)
sys.argv[:] = ["pytest", *sys.argv[2:]]
raise SystemExit(getattr(pytest, "console_main", pytest.main)())
