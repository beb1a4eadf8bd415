"""Starts ``python -m unittest`` for the swe grader. Runs INSIDE the grading sandbox (stdlib
only), passed to ``python -c`` as text.

``python -c SOURCE WORKSPACE [UNITTEST ARGS ...]``. ``python -m unittest`` would put the
repository first on ``sys.path`` before unittest is imported: a ``unittest.py`` the agent adds
would be the runner. So unittest comes from the interpreter first, then the repository goes in
front, as ``-m`` would have put it.
"""
import sys

if sys.path and sys.path[0] in ("", "."):
    del sys.path[0]
import unittest

sys.path.insert(0, sys.argv[1])
unittest.main(module=None, argv=["python -m unittest", *sys.argv[2:]])
