"""Starts pytest for the swe grader. Runs INSIDE the grading sandbox (stdlib and the task
environment's pytest only), passed to ``python -c`` as text.

``python -c SOURCE WORKSPACE [PYTEST ARGS ...]``. ``python -m pytest`` would put the repository
first on ``sys.path`` before pytest is imported: a ``pytest.py`` or ``_pytest/`` the agent adds
would be the test runner (and could write the report itself), and a file named like the report
plugin would replace it. So pytest and the plugin are imported from the environment first (the
plugin takes its fingerprints then, before any repository code can run), and only then does the
repository go to the front of ``sys.path``, where ``python -m pytest`` would have put it for
the code under test.
"""
import sys

if sys.path and sys.path[0] in ("", "."):
    del sys.path[0]
import pytest
import rollout_pytest_report  # noqa: F401

sys.path.insert(0, sys.argv[1])
sys.argv[:] = ["pytest", *sys.argv[2:]]
raise SystemExit(getattr(pytest, "console_main", pytest.main)())
