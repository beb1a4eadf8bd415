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
    args = bench.argparse.Namespace(episodes=1, turns=3, latency_ms=0.0, compact_every=2,
                                   gc_freeze=True)
    await bench._main(args, Console(file=out, width=200))
    text = out.getvalue()
    assert "backend pool directly (baseline)" in text
    assert "gateway, stream: first token" in text
    assert "HTTP alone (floor), stream: first token" in text
    assert "HTTP alone (floor), no stream: whole answer" in text
    assert "appending harness" in text and "compacting harness" in text
    assert "one chain per line of conversation" in text
    assert "one current segment, a new one per switch" in text


def test_sub_agent_tokens_counts_a_whole_prompt_at_each_switch() -> None:
    # Chain 0 (main): turns A0, A1; chain 1 (sub-agent): turn B0. Requests: A0, B0, A1.
    turns = [Turn([1, 2], [3], [0.0], observation_ids=[4]), Turn([5], [6], [0.0]),
             Turn([7, 8, 9], [10, 11], [0.0, 0.0])]
    capture = HarnessCapture(turns=turns, segments=[
        Segment(0, SegmentReason.FIRST), Segment(2, SegmentReason.NEW_CONVERSATION)])
    merged, chains, rewrite, rewrite_n, per_request, requests = bench.sub_agent_tokens(
        capture, [0, 1, 0])
    assert (merged, chains) == (11, 2)
    # One current segment: A0 (2+1), B0 (3+2), A1 again from its whole prompt (2+1+1+1)+1.
    assert (rewrite, rewrite_n) == (3 + 5 + 6, 3)
    assert (per_request, requests) == (3 + 5 + 6, 3)
    # Had the requests been A0, A1, B0, the main chain would have stayed one segment.
    assert bench.sub_agent_tokens(capture, [0, 0, 1])[2:4] == (3 + (1 + 1 + 1) + 5, 2)
