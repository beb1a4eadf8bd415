"""``rollout bench pipeline --dashboard`` stays runnable and really keeps pages open (a tiny
run; no speed asserted)."""

from __future__ import annotations

import pytest

from rollout.benchmarks import pipeline_dashboard


@pytest.mark.timeout(120)
async def test_dashboard_rows_alternate_and_the_viewers_get_updates() -> None:
    rows = await pipeline_dashboard.run(200, 2)
    assert [(r["progress"], r["open"]) for r in rows] == [
        (p, o) for p in (False, True) for o in (False, True, False, True)]
    for r in rows:
        assert r["rate"] > 0
        if r["open"]:
            assert r["loads"] >= 2  # each viewer loaded its page at least once
