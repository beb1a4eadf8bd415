"""``rollout bench gateway``: both tables come out, and the token counts of (b) match an
independent count of what a per-request recorder would hand over. No speed is asserted."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from rollout.benchmarks import gateway as bench
from rollout.runtime.gateway import HarnessCapture
from rollout.runtime.types import Segment, SegmentReason, Turn

pytestmark = pytest.mark.timeout(120)


def test_trainer_tokens_counts_each_requests_whole_prompt() -> None:
    turns = [Turn([1, 2, 3], [4, 5], [0.0, 0.0], observation_ids=[6]),
             Turn([7], [8], [0.0]),
             Turn([1, 9], [10, 11, 12], [0.0] * 3)]
    capture = HarnessCapture(turns=turns, segments=[
        Segment(0, SegmentReason.FIRST), Segment(2, SegmentReason.HISTORY_REWRITTEN)])
    # merged: [1,2,3,4,5,6,7,8] + [1,9,10,11,12]; per request: 3+2, (3+2+1+1)+1, 2+3
    assert bench.trainer_tokens(capture) == (13, 2, 5 + 8 + 5, 3)


async def test_the_bench_prints_both_tables() -> None:
    out = io.StringIO()
    args = bench.argparse.Namespace(episodes=1, turns=3, latency_ms=0.0, compact_every=2)
    await bench._main(args, Console(file=out, width=200))
    text = out.getvalue()
    assert "backend pool directly (baseline)" in text
    assert "gateway, stream: first token" in text
    assert "appending harness" in text and "compacting harness" in text
