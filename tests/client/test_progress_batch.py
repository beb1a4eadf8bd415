"""The Python client and batched progress: sessions opt in, ``events()`` still yields one
progress frame per event (batches unpacked), and ``rollout submit``'s bars keep counting."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollout.client.aio import RolloutClient
from rollout.entrypoints.cli import main
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from tests.client.conftest import ServerHarness, ThreadedServer, task

pytestmark = pytest.mark.timeout(60)
P = pb.StageProgress
INIT, RUN, EVAL = job_pb2.STAGE_INIT, job_pb2.STAGE_RUN, job_pb2.STAGE_EVAL


def expected_events(turns: int) -> list[tuple[int, int, int]]:
    """The scripted environment's events for one job, worked out by hand from its code."""
    return ([(INIT, P.EVENT_STARTED, 0), (INIT, P.EVENT_FINISHED, 0), (RUN, P.EVENT_STARTED, 0)]
            + [(RUN, P.EVENT_TURN, t + 1) for t in range(turns)]
            + [(RUN, P.EVENT_FINISHED, 0), (EVAL, P.EVENT_STARTED, 0),
               (EVAL, P.EVENT_FINISHED, 0)])


async def _run(harness: ServerHarness, client_id: str, n: int, turns: int, **options: Any
               ) -> tuple[list[pb.StreamRolloutsResponse], list[pb.StreamRolloutsResponse]]:
    """Submit n jobs on one session and read it to its end; returns (wire frames, events)."""
    wire: list[pb.StreamRolloutsResponse] = []
    events: list[pb.StreamRolloutsResponse] = []
    async with RolloutClient(harness.address) as client, \
            client.session(client_id, progress=True, heartbeat_s=0.1, auto_ack=True,
                           on_wire=wire.append, **options) as s:
        await s.submit([{"job_id": f"{client_id}-{i}", **task(turns=turns)} for i in range(n)])
        await s.close()
        async for f in s.events():
            events.append(f)
    # Frames the server wrote together (`batch`, OpenSession.batch_frames) as if written alone.
    return [g for f in wire for g in (f.batch.frames if f.WhichOneof("kind") == "batch"
                                      else [f])], events


def _per_job(events: list[pb.StreamRolloutsResponse]) -> dict[str, list[Any]]:
    jobs: dict[str, list[Any]] = {}
    delivered: set[str] = set()
    for f in events:
        if f.WhichOneof("kind") == "trajectory":
            delivered.add(f.job_id)
        if f.WhichOneof("kind") == "progress":
            assert f.job_id not in delivered, "progress after the job's trajectory"
            jobs.setdefault(f.job_id, []).append(
                (f.progress.stage, f.progress.event, f.progress.turns))
    return jobs


async def test_session_unpacks_batches_into_single_events(harness: ServerHarness) -> None:
    wire, events = await _run(harness, "batched", 150, turns=2)
    kinds = {f.WhichOneof("kind") for f in events}
    assert "progress_batch" not in kinds and "progress" in kinds
    batches = [f for f in wire if f.WhichOneof("kind") == "progress_batch"]
    assert batches and not any(f.WhichOneof("kind") == "progress" for f in wire)
    # 150 jobs at once pile events up between writes: fewer frames than events
    assert len(batches) < sum(len(f.progress_batch.events) for f in batches)
    assert _per_job(events) == {f"batched-{i}": expected_events(2) for i in range(150)}
    # each unpacked event carries its batch frame's sequence number
    by_seq = {f.sequence: len(f.progress_batch.events) for f in batches}
    unpacked: dict[int, int] = {}
    for f in events:
        if f.WhichOneof("kind") == "progress":
            unpacked[f.sequence] = unpacked.get(f.sequence, 0) + 1
    assert unpacked == by_seq


async def test_session_without_batching_asks_for_single_frames(harness: ServerHarness) -> None:
    wire, events = await _run(harness, "single", 40, turns=1, batch_progress=False)
    assert not any(f.WhichOneof("kind") == "progress_batch" for f in wire)
    assert _per_job(events) == {f"single-{i}": expected_events(1) for i in range(40)}


def test_submit_progress_bars_count_batched_events(threaded_server: ThreadedServer, tmp_path,
                                                   capsys, monkeypatch) -> None:
    """`rollout submit` with bars (its session asks for batched progress): the RUN bar's label
    counts every turn event (2 + 3 + 0 + 1 + 5), one by one as the session unpacks them."""
    monkeypatch.setenv("COLUMNS", "200")
    turns = [2, 3, 0, 1, 5]
    jobs = tmp_path / "bars.jsonl"
    jobs.write_text("".join(json.dumps(task(turns=t)) + "\n" for t in turns))
    out = tmp_path / "out.jsonl"
    assert main(["submit", str(jobs), "--out", str(out), "--progress",
                 "--address", threaded_server.address]) == 0
    text = capsys.readouterr().out
    assert f"RUN · {sum(turns)} turns" in text, text
    assert "done ✓5" in text, text
