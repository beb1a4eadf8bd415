"""StagePool under random operation sequences: slots, priorities, backpressure, cancellation.

A model tracks which jobs are queued where; after every operation the pools must agree with it,
and whenever a job starts it must be the best queued one (highest priority, then oldest).
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rollout.runtime.types import JobSpec, Stage
from rollout.server.pipeline.stage_pool import LiveJob, StagePool

OPS = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(-2, 2)),
    st.tuples(st.just("finish_init"), st.integers(0, 3)),
    st.tuples(st.just("finish_run"), st.integers(0, 3)),
    st.tuples(st.just("cancel"), st.integers(0, 5)),
), max_size=60)


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(1, 3), st.integers(1, 3), st.integers(1, 2))
# Cancelling a job blocked on a full downstream queue must hand its slot to a waiting job.
@example([("submit", 0)] * 4 + [("finish_init", 0)] * 3 + [("cancel", 2)], 1, 1, 1)
def test_pools_keep_their_invariants(ops, up_workers, down_workers, capacity):
    running: dict[Stage, list[LiveJob]] = {Stage.INIT: [], Stage.RUN: []}
    queued: dict[Stage, list[LiveJob]] = {Stage.INIT: [], Stage.RUN: []}

    def start(job: LiveJob, pool: StagePool) -> None:
        best = min(queued[pool.stage], key=lambda j: (-j.spec.priority, j.seq))
        assert job is best, "the best queued job must start first"
        queued[pool.stage].remove(job)
        running[pool.stage].append(job)

    up = StagePool(Stage.INIT, up_workers, 10_000, start)
    down = StagePool(Stage.RUN, down_workers, capacity, start)
    up.downstream, down.upstream = down, up
    orig_push = StagePool.push

    def push(self: StagePool, job: LiveJob) -> None:
        queued[self.stage].append(job)
        orig_push(self, job)

    up.push = push.__get__(up)  # type: ignore[method-assign]
    down.push = push.__get__(down)  # type: ignore[method-assign]

    seq = 0
    for op, arg in ops:
        if op == "submit":
            seq += 1
            up.push(LiveJob(spec=JobSpec(f"j{seq}", "x", {}, priority=arg), client_id="c",
                            seq=seq, created_at=0.0))
        elif op in ("finish_init", "finish_run"):
            stage = Stage.INIT if op == "finish_init" else Stage.RUN
            if running[stage]:
                job = running[stage].pop(arg % len(running[stage]))
                if stage is Stage.INIT:
                    up.hand_on(job)
                else:
                    down.release()
        else:
            candidates = queued[Stage.INIT] + queued[Stage.RUN] + list(up.blocked)
            if candidates:
                job = candidates[arg % len(candidates)]
                pool = job.pool
                assert pool is not None
                if job in queued[pool.stage]:
                    queued[pool.stage].remove(job)
                pool.remove(job)
        for pool in (up, down):
            assert pool.busy <= pool.workers
            assert pool.depth == len(queued[pool.stage])
            assert pool.busy == len(running[pool.stage]) + (len(up.blocked) if pool is up else 0)
            if pool.busy < pool.workers:
                assert not queued[pool.stage], "a free slot never leaves a job waiting"
        assert down.depth <= capacity
        if up.blocked:
            assert not down.has_room(), "blocked jobs only wait while downstream is full"
