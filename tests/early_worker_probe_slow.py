"""Run only by ``tests/test_under_load.py`` (with ``early_worker_probe_quick.py``): this file's
worker runs well past the exit grace the other worker's process would allow itself."""

import time

import pytest

from tests.conftest import EXIT_GRACE_S
from tests.util import patience


@pytest.mark.timeout(600)  # the suite's default guard is shorter than the sleep
def test_outlasts_the_other_workers_exit_grace() -> None:
    time.sleep(2 * patience(EXIT_GRACE_S) + 1)
