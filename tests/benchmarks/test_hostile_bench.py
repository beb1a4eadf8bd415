"""``rollout bench hostile`` at its smallest: both runs finish every good job, the hostile
tenant's unread pages leave the good tenant's page served, a SIGKILL loses nothing, and the
table comes out. No speed is asserted."""

from __future__ import annotations

import pytest

from rollout.benchmarks import hostile

pytestmark = pytest.mark.timeout(400)


@pytest.mark.slow
def test_the_smallest_mixed_soak_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    code = hostile.main(["--jobs", "3", "--calls", "2", "--hostile", "1", "--flood", "1000",
                         "--pages", "12"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| jobs SUCCEEDED | 6/6 | 3/3 |" in out  # the baseline runs twice
    assert "gateway p99 latency" in out and "server peak open fds" in out
    assert "good tenant's live page beside them: served" in out
    assert "3/3 good jobs SUCCEEDED" in out
