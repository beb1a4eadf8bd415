"""Run by ``tests/test_under_load.py`` in a child pytest (the name keeps it out of the suite's
own collection): writes the pytest-timeout guard the suite's hook gave this test. It takes
``tmp_path`` so that its session has a base folder, and with it pytest's end-of-session sweep
of older sessions' folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.mark.timeout(7)
def test_guard_probe(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    Path(os.environ["ROLLOUT_GUARD_PROBE"]).write_text(
        str(request.node.get_closest_marker("timeout").args[0]))
