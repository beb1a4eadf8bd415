"""Run by ``tests/test_under_load.py`` in a child pytest (the name keeps it out of the suite's
own collection): writes the pytest-timeout guard the suite's hook gave this test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.mark.timeout(7)
def test_guard_probe(request: pytest.FixtureRequest) -> None:
    Path(os.environ["ROLLOUT_GUARD_PROBE"]).write_text(
        str(request.node.get_closest_marker("timeout").args[0]))
