"""The pipeline benchmark stays runnable (a tiny in-process overlap run; no speed asserted)."""

from __future__ import annotations

import re

import pytest

from rollout.benchmarks import pipeline


@pytest.mark.timeout(60)
def test_overlap_section_runs_and_prints_both_rows(capsys):
    rc = pipeline.main(["--only", "overlap", "--overlap-jobs", "12", "--pool-workers", "2",
                        "--sleeps", "2,3,1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "pipeline, equal pools 2/2/2" in out and "coupled pool of 6" in out


@pytest.mark.timeout(240)
def test_overhead_section_compares_batched_frames_with_an_older_client(capsys):
    """A tiny (a): a real server process, the batched session (the client's default) beside
    one asking for a write per frame; the older client's row shows three frames per job."""
    rc = pipeline.main(["--only", "overhead", "--jobs", "40", "--queued", "20"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "one write per frame (older" in out  # the row's label, as rich wraps it
    assert re.search(r"3\.0\d frames/job \(0 progress events\)", out)  # opened + 3 per job
    assert "baseline: in-process scheduler" in out
