"""The soak benchmark's books, small: real server processes SIGKILLed and restarted on one port
and state directory, clients that cut their own streams (some within ms of a submit), and at the
end every accepted job delivered exactly once, none failed, no id re-issued.

``rollout bench soak`` runs the same thing for minutes; this keeps its accounting honest (a
ledger that could not see a loss would make the benchmark worthless).
"""

from __future__ import annotations

import pytest

from rollout.benchmarks.soak import Books, _run


def test_books_see_duplicates_and_reissued_ids():
    books = Books("c", ["a", "b"])
    books.on_delivery(1, "a")
    books.on_delivery(2, "b")
    assert books.acked_through == 2 and books.done()
    books.confirmed = 2  # a session opened with acked_through=2: the server committed it
    books.on_delivery(2, "a")  # id 2 again, for another job, after it was acked
    assert books.dup_after_ack == 1 and books.reissued == 1
    assert books.delivered["a"] == {1, 2}


@pytest.mark.timeout(240)
async def test_soak_with_kills_and_disconnects_balances():
    r = await _run("t", clients=3, jobs=60, kills=2, duration=8, mean_cut_s=0.5, seed=3,
                   drain_s=120, bursts=2)
    assert r.kills == 2 and r.cuts > 0
    assert r.submitted == 180 and r.delivered_once == 180
    assert (r.lost, r.dup_after_ack, r.reissued, r.failed) == (0, 0, 0, 0), r
    assert r.rss_start > 0 and r.rss_end > 0
