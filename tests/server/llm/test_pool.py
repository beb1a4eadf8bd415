"""Backend pool behaviour with fake engines: least-loaded balance, stickiness, group affinity,
ejection and re-admission, retry, membership changes and policy versions."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from rollout.runtime.llm import GenerateRequest, LLMClient, LLMUnavailable
from rollout.runtime.types import SamplingParams
from rollout.server.llm.backend_pool import BackendPool
from tests.server.llm.conftest import FakeEngine
from tests.util import assert_eventually


def req(session: str, group: str = "", min_version: int = 0) -> GenerateRequest:
    return GenerateRequest([1, 2, 3], SamplingParams(), 4, session, group_id=group,
                           min_policy_version=min_version)


async def test_pool_is_an_llm_client() -> None:
    pool = BackendPool([FakeEngine("a")])
    assert isinstance(pool, LLMClient)
    await pool.close()


async def test_least_loaded_under_uneven_latency() -> None:
    """A slow backend accumulates in-flight requests, so new sessions go to the fast ones."""
    fast, slow = FakeEngine("fast", 0.005), FakeEngine("slow", 0.2)
    pool = BackendPool([fast, slow], health_interval_s=0)
    sem = asyncio.Semaphore(4)

    async def one(i: int) -> str:
        async with sem:
            return (await pool.generate(req(f"s{i}"))).backend

    served = Counter(await asyncio.gather(*(one(i) for i in range(40))))
    assert served["fast"] > 3 * served["slow"]
    assert all(b.in_flight == 0 for b in pool.backends())
    await pool.close()


async def test_load_counts_return_to_zero_after_errors_and_cancels() -> None:
    a = FakeEngine("a")
    a.gate = asyncio.Event()
    pool = BackendPool([a], health_interval_s=0, wait_for_backend_s=0.1)
    tasks = [asyncio.create_task(pool.generate(req(f"c{i}"))) for i in range(3)]
    await assert_eventually(lambda: pool.get("a").in_flight == 3)
    tasks[0].cancel()
    await assert_eventually(lambda: pool.get("a").in_flight == 2)
    a.alive = False
    a.gate.set()
    for task in tasks[1:]:
        with pytest.raises(LLMUnavailable):
            await task
    assert pool.get("a").in_flight == 0
    await pool.close()


async def test_weights_bias_the_heap() -> None:
    big, small = FakeEngine("big"), FakeEngine("small")
    big.gate = small.gate = asyncio.Event()
    pool = BackendPool(health_interval_s=0)
    pool.add(big, weight=3.0)
    pool.add(small, weight=1.0)
    tasks = [asyncio.create_task(pool.generate(req(f"w{i}"))) for i in range(8)]
    await assert_eventually(lambda: big.in_flight + small.in_flight == 8)
    assert (big.in_flight, small.in_flight) == (6, 2)
    big.gate.set()
    await asyncio.gather(*tasks)
    await pool.close()


async def test_sticky_sessions_stay_on_one_backend() -> None:
    engines = [FakeEngine(n) for n in "abc"]
    pool = BackendPool(engines, health_interval_s=0)
    owners: dict[str, set[str]] = {}
    for turn in range(4):
        results = await asyncio.gather(*(pool.generate(req(f"t{i}")) for i in range(9)))
        for i, r in enumerate(results):
            owners.setdefault(f"t{i}", set()).add(r.backend)
        del turn
    assert all(len(o) == 1 for o in owners.values())
    assert len({next(iter(o)) for o in owners.values()}) == 3  # sessions were spread out
    await pool.end_session("t0")
    owner = next(iter(owners["t0"]))
    assert "t0" in next(e for e in engines if e.name == owner).released
    await pool.close()


async def test_group_samples_are_co_located_within_slack() -> None:
    engines = [FakeEngine(n) for n in "abcd"]
    gate = asyncio.Event()
    for e in engines:
        e.gate = gate
    pool = BackendPool(engines, health_interval_s=0, group_affinity_slack=8)
    tasks = []
    for i in range(4):  # each sample joins while the others are still in flight
        tasks.append(asyncio.create_task(pool.generate(req(f"g{i}", group="G"))))
        await assert_eventually(lambda: sum(e.in_flight for e in engines) == len(tasks))
    gate.set()
    assert len({r.backend for r in await asyncio.gather(*tasks)}) == 1

    pool.group_affinity_slack = 1  # a busy group backend no longer attracts new samples
    gate.clear()
    tasks = []
    for i in range(4):
        tasks.append(asyncio.create_task(pool.generate(req(f"h{i}", group="H"))))
        await assert_eventually(lambda: sum(e.in_flight for e in engines) == len(tasks))
    gate.set()
    assert len({r.backend for r in await asyncio.gather(*tasks)}) > 1
    await pool.close()


async def test_dead_backend_is_ejected_turn_retried_then_readmitted() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    pool = BackendPool([a, b], health_interval_s=0.02)
    await pool.start()
    first = await pool.generate(req("s"))
    victim = a if first.backend == "a" else b
    other = b if victim is a else a
    victim.alive = False
    retried = await pool.generate(req("s"))  # sticky backend fails -> retried elsewhere
    assert retried.backend == other.name
    assert not pool.get(victim.name).healthy
    for i in range(5):
        assert (await pool.generate(req(f"n{i}"))).backend == other.name
    victim.alive = True
    await assert_eventually(lambda: pool.get(victim.name).healthy)
    served = {(await pool.generate(req(f"m{i}"))).backend for i in range(6)}
    assert victim.name in served
    await pool.close()


async def test_all_backends_down_raises_unavailable_after_bounded_wait() -> None:
    a = FakeEngine("a")
    a.alive = False
    pool = BackendPool([a], health_interval_s=0, wait_for_backend_s=0.2)
    with pytest.raises(LLMUnavailable):
        await pool.generate(req("x"))
    start = time.monotonic()
    with pytest.raises(LLMUnavailable):
        await pool.generate(req("y"))  # a is ejected now: waits for re-admission, then gives up
    assert time.monotonic() - start < 5
    await pool.close()


async def test_add_and_remove_at_run_time() -> None:
    a = FakeEngine("a")
    pool = BackendPool([a], health_interval_s=0)
    await pool.generate(req("s"))
    b = FakeEngine("b")
    pool.add(b, weight=2.0)
    with pytest.raises(KeyError):
        pool.add(FakeEngine("b"))
    a.gate = asyncio.Event()
    held = asyncio.create_task(pool.generate(req("s")))  # sticky on a, held in flight
    await assert_eventually(lambda: a.in_flight == 1)
    assert (await pool.generate(req("fresh"))).backend == "b"
    removed = pool.remove("a")
    assert removed.engine is a and removed.draining and [i.name for i in pool.backends()] == ["b"]
    a.gate.set()
    assert (await held).backend == "a"  # the in-flight turn finished where it was
    assert (await pool.generate(req("s"))).backend == "b"  # the session moved
    with pytest.raises(KeyError):
        pool.remove("a")
    await pool.close()


async def test_min_policy_version_waits_for_a_backend_then_gives_up() -> None:
    old, new = FakeEngine("old", version=1), FakeEngine("new", version=1)
    pool = BackendPool([old, new], health_interval_s=0, wait_for_backend_s=5)
    waiting = asyncio.create_task(pool.generate(req("v", min_version=2)))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    pool.set_policy_version(2, ["new"])
    result = await asyncio.wait_for(waiting, 5)
    assert result.backend == "new" and result.policy_version == 2
    pool.wait_for_backend_s = 0.1
    with pytest.raises(LLMUnavailable, match="policy version >= 3"):
        await pool.generate(req("w", min_version=3))
    await pool.close()


async def test_turn_cancelled_as_a_backend_appears_is_not_served() -> None:
    """A turn cancelled in the loop step in which its wait for a backend ends must stop there:
    with Python 3.11's ``asyncio.wait_for`` (gh-86296) the wake-up won, and the cancelled turn
    was sent to the backend anyway."""
    engine = FakeEngine("a", version=1)
    pool = BackendPool([engine], health_interval_s=0, wait_for_backend_s=30)
    waiting = asyncio.create_task(pool.generate(req("c", min_version=2)))
    # The pool's condition and its waiter list are private; they are the only sign that the
    # turn has begun to wait (wait_for waited from a task of its own, one step later).
    await assert_eventually(lambda: pool._changed is not None
                            and bool(pool._changed._waiters), timeout=5)
    condition = pool._changed
    engine.set_policy_version(2)
    async with condition:  # the lock is free: this takes no loop step
        condition.notify_all()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert engine.served == [] and engine.in_flight == 0
    await pool.close()


async def test_rolling_update_records_versions_per_turn() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    pool = BackendPool([a, b], health_interval_s=0)
    before = await pool.generate(req("s"))
    assert before.policy_version == 0
    assert await pool.update_weights("/ckpt", 5) == ["a", "b"]
    after = await pool.generate(req("s"))
    assert after.policy_version == 5
    assert {i.policy_version for i in pool.backends()} == {5}
    await pool.close()


async def test_group_affinity_table_keeps_only_recent_groups() -> None:
    """One entry per group ever seen would grow without bound over a long run; the table keeps
    the most recently used ones, and a group in use keeps its backend."""
    engines = [FakeEngine(n) for n in "ab"]
    pool = BackendPool(engines, health_interval_s=0, max_group_affinities=8)
    for i in range(200):
        await pool.generate(req(f"s{i}", group=f"G{i}"))
        await pool.end_session(f"s{i}")
    assert pool.group_affinities == 8
    # A group used again moves to the front and survives newer groups.
    first = await pool.generate(req("keep-0", group="G199"))
    for i in range(200, 207):
        await pool.generate(req(f"s{i}", group=f"G{i}"))
    again = await pool.generate(req("keep-1", group="G199"))
    assert pool.group_affinities == 8 and again.backend == first.backend
    with pytest.raises(ValueError, match="max_group_affinities"):
        BackendPool([], max_group_affinities=0)
    await pool.close()
