"""The store's owner index: a client's jobs (its sessions' and its SubmitRollout channels'
``rpc:<owner>#<job>``) read by owner, paged and counted without touching other clients' rows,
and store files from before the ``owner`` column opening with every owner filled in.

Expected owners and counts are written out by hand below, not derived from the store.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from rollout.runtime.types import JobSpec, JobState, Stage, StageTimings
from rollout.server.store import FinishRecord, JobStore
from rollout.server.store.file import APPLICATION_ID
from rollout.server.store.job_reads import OWNER_COUNTS_SQL, OWNER_LIVE_SQL, list_sql
from rollout.server.store.sqlite import owner_sql
from rollout.server.tenancy.auth import owner_of
from rollout.server.tenancy.tenant_status import OwnerCounts

pytestmark = pytest.mark.timeout(60)

# Stored client id -> the owner a tenant query must file it under (by hand, from auth.py's
# rules: a session's id is its own owner; rpc:<owner>#<job> is <owner>'s; an anonymous
# SubmitRollout channel rpc:<job> has no owner; ids that only look alike are someone else).
OWNERS = {
    "alice": "alice",
    "rpc:alice#a-7": "alice",
    "rpc:alice#x.y_z-1": "alice",
    "bob": "bob",
    "rpc:bob#b-1": "bob",
    "rpc:anon-job": "",
    "alice2": "alice2",
    "rpc:alice2#a-1": "alice2",
    "alic": "alic",
    "rpcalice": "rpcalice",
}


def _spec(job_id: str) -> JobSpec:
    return JobSpec(job_id=job_id, environment="scripted", task={"reward": 1.0})


def test_the_stores_owner_rule_is_auth_owner_of() -> None:
    conn = sqlite3.connect(":memory:")
    for stored, owner in [*OWNERS.items(), ("rpc:", ""), ("rpc:#j", ""), ("rpc:a#", "a"),
                          ("r", "r"), ("", "")]:
        (got,) = conn.execute(f"SELECT {owner_sql('?1')}", (stored,)).fetchone()
        assert got == owner == owner_of(stored), stored


async def _interleaved(store: JobStore, others: int) -> list[str]:
    """Alice's jobs with ``others`` jobs of other clients before each; returns her job ids
    in submission order."""
    alice: list[str] = []
    ids = list(OWNERS)
    n = 0
    for k, cid in enumerate(["alice", "rpc:alice#a-7", "rpc:alice#x.y_z-1", "alice", "alice"]):
        batch = []
        for _ in range(others):
            other = ids[3 + n % (len(ids) - 3)]  # never one of Alice's
            batch.append((_spec(f"o{n}"), other))
            n += 1
        await store.insert_jobs(batch, 1.0)
        await store.insert_jobs([(_spec(f"a{k}"), cid)], 1.0)
        alice.append(f"a{k}")
    return alice


async def test_owner_pages_are_full_however_many_other_jobs_lie_between(
        tmp_path: Path) -> None:
    store = JobStore(tmp_path / "s.db")
    await store.open()
    try:
        alice = await _interleaved(store, others=300)
        pages, after = [], 0
        while True:
            rows = await store.list_jobs(after_seq=after, limit=2, owner="alice")
            if not rows:
                break
            pages.append([r.job_id for r in rows])
            after = rows[-1].seq
        assert pages == [alice[0:2], alice[2:4], alice[4:5]]
        # The exact client-id filter still means one stored id; other owners are exact too.
        assert [r.job_id for r in await store.list_jobs(
            after_seq=0, limit=10, client_id="alice")] == ["a0", "a3", "a4"]
        alic = await store.list_jobs(after_seq=0, limit=1000, owner="alic")
        assert len(alic) == sum(1 for n in range(5 * 300) if n % 7 == 5)  # ids[8]
        assert {owner_of(r.client_id) for r in alic} == {"alic"}
        anon = await store.list_jobs(after_seq=0, limit=1000, owner="")
        assert {r.client_id for r in anon} == {"rpc:anon-job"}
    finally:
        await store.close()


async def test_owner_counts_by_state_by_hand(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "s.db")
    await store.open()
    try:
        await store.insert_jobs([(_spec("a-ok"), "alice"), (_spec("b-ok"), "bob"),
                                 (_spec("a-rpc-ok"), "rpc:alice#a-rpc-ok"),
                                 (_spec("a-fail"), "rpc:alice#a-fail"),
                                 (_spec("a-run"), "alice"), (_spec("a-wait"), "alice"),
                                 (_spec("a2"), "alice2"), (_spec("b-run"), "rpc:bob#b-run")],
                                1.0)
        for job_id, cid, state in [("a-ok", "alice", JobState.SUCCEEDED),
                                   ("b-ok", "bob", JobState.SUCCEEDED),
                                   ("a-rpc-ok", "rpc:alice#a-rpc-ok", JobState.SUCCEEDED),
                                   ("a-fail", "rpc:alice#a-fail", JobState.FAILED)]:
            await store.finish(FinishRecord(job_id, cid, state, Stage.EVAL, None, 1.0,
                                            StageTimings(), None, 2.0), deliver=False)
        store.record_stage("a-run", Stage.RUN, 1, 2.0)
        store.record_stage("b-run", Stage.INIT, 1, 2.0)
        await store.flush()

        got = await store.owner_counts("alice")
        assert got.by_state == {JobState.SUCCEEDED: 2, JobState.FAILED: 1,
                                JobState.RUNNING: 1, JobState.QUEUED: 1}
        assert got.live == {"a-run": JobState.RUNNING, "a-wait": JobState.QUEUED}
        assert (await store.owner_counts("bob")).by_state == {JobState.SUCCEEDED: 1,
                                                              JobState.RUNNING: 1}
        assert (await store.owner_counts("nobody")).by_state == {}

        # The scheduler knows better than a lagging row: a-wait already runs, a-run's row
        # says RUNNING and so does the scheduler; a job it does not run keeps its row's state.
        live = {"a-wait": JobState.RUNNING, "a-run": JobState.RUNNING}
        counts = OwnerCounts(store, live.get)
        assert await counts.get("alice") == {JobState.SUCCEEDED: 2, JobState.FAILED: 1,
                                             JobState.RUNNING: 2}
    finally:
        await store.close()


def _plan(conn: sqlite3.Connection, sql: str, args: tuple[object, ...]) -> str:
    return " | ".join(r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + sql, args))


async def test_owner_queries_read_the_owner_index_not_the_job_list(tmp_path: Path) -> None:
    """What "not a scan" means, asked of SQLite itself: each owner query seeks the owner
    index, and counting by state reads nothing but that index."""
    store = JobStore(tmp_path / "s.db")
    await store.open()
    await _interleaved(store, others=50)
    await store.close()
    conn = sqlite3.connect(tmp_path / "s.db")
    conn.execute("ANALYZE")  # plans with statistics too, as a long-lived store may have them
    page = _plan(conn, *list_sql(after_seq=10, limit=100, owner="alice"))
    assert page.startswith("SEARCH jobs USING INDEX jobs_by_owner (owner=? AND rowid>?)")
    by_state = _plan(conn, *list_sql(after_seq=10, limit=100, owner="alice",
                                     state=JobState.RUNNING))
    assert "INDEX jobs_by_owner_state (owner=? AND state=? AND rowid>?)" in by_state
    counts = _plan(conn, OWNER_COUNTS_SQL, ("alice",))
    assert counts == "SEARCH jobs USING COVERING INDEX jobs_by_owner_state (owner=?)"
    assert "jobs_by_owner_state (owner=? AND state=?)" in _plan(
        conn, OWNER_LIVE_SQL, ("alice", "queued", "running"))
    for plan in (page, by_state, counts):
        assert "SCAN" not in plan and "TEMP B-TREE" not in plan


# The job table as the release before the owner column wrote it (server/store/sqlite.py at
# 8d22f6b), with its two indexes; the store creates the other tables itself when missing.
PREVIOUS_JOBS_TABLE = """
CREATE TABLE jobs (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id      TEXT NOT NULL UNIQUE,
    client_id   TEXT NOT NULL,
    group_id    TEXT NOT NULL DEFAULT '',
    state       TEXT NOT NULL,
    stage       TEXT,
    attempts    INTEGER NOT NULL DEFAULT 0,
    priority    INTEGER NOT NULL DEFAULT 0,
    spec        BLOB NOT NULL,
    error       TEXT,
    reward      REAL,
    timings     TEXT,
    trajectory  BLOB,
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL,
    pruned_at   REAL,
    in_stage    INTEGER NOT NULL DEFAULT 0,
    crashes     INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX jobs_by_group ON jobs (group_id, seq);
CREATE INDEX jobs_by_client ON jobs (client_id, seq);
"""


def _insert_without_owner(path: Path, rows: list[tuple[str, str, str]]) -> None:
    """Rows as a release without the owner column inserts them (its column list)."""
    from rollout.server.api.proto_convert import spec_to_bytes

    conn = sqlite3.connect(path)
    with conn:
        conn.executemany(
            "INSERT INTO jobs (job_id, client_id, group_id, state, priority, spec, created_at,"
            " updated_at) VALUES (?,?,'',?,0,?,1.0,1.0)",
            [(j, cid, st, spec_to_bytes(_spec(j))) for j, cid, st in rows])
    conn.close()


async def test_a_store_from_before_the_owner_column_opens_with_every_owner(
        tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(PREVIOUS_JOBS_TABLE)
    conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
    conn.close()
    old = [("j-a", "alice", "succeeded"), ("j-b", "bob", "failed"),
           ("j-ar", "rpc:alice#j-ar", "succeeded"), ("j-x", "rpc:j-x", "succeeded"),
           ("j-q", "rpc:alice#j-q", "queued")]
    _insert_without_owner(path, old)

    store = JobStore(path)
    await store.open()
    try:
        got = await store.list_jobs(after_seq=0, limit=10, owner="alice")
        assert [r.job_id for r in got] == ["j-a", "j-ar", "j-q"]
        assert (await store.owner_counts("alice")).by_state == {JobState.SUCCEEDED: 2,
                                                                JobState.QUEUED: 1}
        await store.insert_jobs([(_spec("j-new"), "rpc:alice#j-new")], 2.0)
        got = await store.list_jobs(after_seq=0, limit=10, owner="alice")
        assert [r.job_id for r in got] == ["j-a", "j-ar", "j-q", "j-new"]
    finally:
        await store.close()

    # Downgraded, an older server inserts rows without an owner; the next open fills them.
    _insert_without_owner(path, [("j-late", "rpc:bob#j-late", "queued")])
    store = JobStore(path)
    await store.open()
    try:
        got = await store.list_jobs(after_seq=0, limit=10, owner="bob")
        assert [r.job_id for r in got] == ["j-b", "j-late"]
    finally:
        await store.close()
    conn = sqlite3.connect(path)
    owners = dict(conn.execute("SELECT job_id, owner FROM jobs").fetchall())
    indexes = {r[1] for r in conn.execute("PRAGMA index_list(jobs)")}
    conn.close()
    assert owners == {"j-a": "alice", "j-b": "bob", "j-ar": "alice", "j-x": "", "j-q": "alice",
                      "j-new": "alice", "j-late": "bob"}
    assert {"jobs_by_owner", "jobs_by_owner_state"} <= indexes
