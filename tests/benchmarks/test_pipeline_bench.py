"""The pipeline benchmark stays runnable (a tiny in-process overlap run; no speed asserted)."""

from __future__ import annotations

import pytest

from rollout.benchmarks import pipeline


@pytest.mark.timeout(60)
def test_overlap_section_runs_and_prints_both_rows(capsys):
    rc = pipeline.main(["--only", "overlap", "--overlap-jobs", "12", "--pool-workers", "2",
                        "--sleeps", "2,3,1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "pipeline, equal pools 2/2/2" in out and "coupled pool of 6" in out
