"""Per-stage figures in GetServerStatus and on the Prometheus endpoint, after real jobs."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from pathlib import Path

import pytest

from rollout.client.aio import RolloutClient
from rollout.v1 import job_pb2
from tests.client.conftest import ServerHarness, task


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(60)
async def test_status_and_prometheus_metrics_count_finished_stages(tmp_path: Path) -> None:
    port = _free_port()
    h = ServerHarness(tmp_path / "state", metrics_port=port)
    await h.start()
    try:
        async with RolloutClient(h.address) as client:
            async with client.session("observer") as session:
                await session.submit([dict(task(), job_id=f"obs-{i}") for i in range(3)])
                seen = 0
                async for frame in session.events():
                    if frame.WhichOneof("kind") == "trajectory":
                        await session.ack([frame.trajectory.delivery_id])
                    if frame.WhichOneof("kind") == "finished":
                        seen += 1
                        if seen == 3:
                            break
            status = await client.status()
        stages = {s.stage: s for s in status.stages}
        assert set(stages) == {job_pb2.STAGE_INIT, job_pb2.STAGE_RUN, job_pb2.STAGE_EVAL}
        assert all(s.completed == 3 and s.failed == 0 for s in stages.values())
        assert stages[job_pb2.STAGE_RUN].workers == 4
        assert "scripted" in status.environments

        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
            .read().decode())
        assert 'rollout_stage_duration_seconds_count{outcome="ok",stage="run"} 3.0' in body
        assert 'rollout_jobs_finished_total{code="",state="succeeded"} 3.0' in body
        assert 'rollout_stage_workers{stage="eval"} 4.0' in body
        assert "rollout_stage_queue_seconds_bucket" in body
    finally:
        await h.stop()
