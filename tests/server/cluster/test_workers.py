"""``rollout serve --workers N``: stage work in N local processes (node agents on a private
local Ray), real bubblewrap sandboxes in them, driven over real gRPC; a worker killed mid-run
is replaced and its jobs are delivered exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray", reason="the `ray` extra is not installed (scripts/setup_test.sh)")

from rollout.client.aio import RolloutClient
from rollout.runtime.handler import HandlerRegistry
from rollout.runtime.types import Stage
from rollout.server.app import Server
from rollout.server.cluster.local_cluster import LocalRayCluster
from rollout.server.config import load_config
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from tests.util import assert_eventually

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_workers_run_jobs_in_their_own_processes_and_survive_a_killed_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in LocalRayCluster.DRIVER_ENV.items():
        monkeypatch.setenv(key, value)
    # The workers import the test environment from this checkout.
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    cfg = load_config(None, [
        "server.port=0", f"server.state_dir={tmp_path}/state", "llm.backends=[]",
        "server.grace_s=0.2", "cluster.workers=2", "cluster.slots_per_node=3",
        "cluster.poll_s=0.5", 'cluster.handlers={"io": "tests.server.cluster.handlers:IoHandler"}',
        f"cluster.node_state_dir={tmp_path}/nodes"], environ={})
    server = await Server(cfg, registry=HandlerRegistry()).start()
    try:
        sched = server.scheduler
        assert sched is not None and server.cluster is not None
        await assert_eventually(lambda: len(sched.nodes) == 2, timeout=120)
        ids = [f"w{i}" for i in range(9)]
        seen: dict[str, list[dict[str, str]]] = {}
        async with RolloutClient(server.address) as client, client.session("t") as s:
            await s.submit([{"job_id": j, "environment": "io",
                             "task": {"run_s": 1.5, "sandbox": True}} for j in ids])

            def on(name: str) -> list[Any]:
                return [j for j in sched._live.values()
                        if j.node is not None and j.node.name == name and j.stage is Stage.RUN]

            await assert_eventually(lambda: on("worker-1"), timeout=60)
            server.cluster.kill_agent("worker-1")
            async with asyncio.timeout(120):
                async for t in s.trajectories():
                    seen.setdefault(t.trajectory.job_id, []).append(dict(t.trajectory.metadata))
                    await s.ack([t.delivery_id])
                    if set(seen) == set(ids):
                        break
        assert {j: len(v) for j, v in seen.items()} == dict.fromkeys(ids, 1)
        pids = {v[0]["pid"] for v in seen.values()}
        assert str(os.getpid()) not in pids  # stage work ran outside the server process
        assert all(v[0]["echo"] == j for j, v in seen.items())  # real sandboxes answered
        assert sched.node_losses >= 1 and "worker-1" in sched.nodes.lost
        # The killed worker is replaced by a fresh process.
        await assert_eventually(lambda: len(sched.nodes) == 2, timeout=120)
    finally:
        await server.stop(0.2)
    # The SIGKILLed worker could not unmount its sandboxes' quota tmpfs; its replacement's
    # start-up sweep or the server's stop (which sweeps every local node's root) did.
    assert _mounts_below(tmp_path / "nodes") == []
    assert not [p for p in (tmp_path / "nodes").glob("*/sandboxes/*")
                if not p.name.startswith(".")]


def _mounts_below(path: Path) -> list[str]:
    prefix = os.path.realpath(path) + "/"
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(prefix)]


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_progress_of_a_stage_on_a_worker_arrives_while_the_stage_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn reported on a node reaches the trainer before the stage ends (the server polls
    the agents), not only with the stage's reply: the stage waits until the turn arrived."""
    for key, value in LocalRayCluster.DRIVER_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    cfg = load_config(None, [
        "server.port=0", f"server.state_dir={tmp_path}/state", "llm.backends=[]",
        "server.grace_s=0.2", "cluster.workers=1", "cluster.slots_per_node=2",
        'cluster.handlers={"io": "tests.server.cluster.handlers:IoHandler"}',
        f"cluster.node_state_dir={tmp_path}/nodes"], environ={})
    server = await Server(cfg, registry=HandlerRegistry()).start()
    gate = tmp_path / "go"
    try:
        sched = server.scheduler
        assert sched is not None
        await assert_eventually(lambda: len(sched.nodes) == 1, timeout=120)
        order: list[str] = []
        async with RolloutClient(server.address) as client, \
                client.session("t", progress=True) as s:
            await s.submit([{"job_id": "p", "environment": "io",
                             "task": {"gate_file": str(gate)}}])
            async with asyncio.timeout(120):
                async for frame in s.events():
                    kind = frame.WhichOneof("kind")
                    if kind == "progress":
                        order.append(f"{frame.progress.stage}:{frame.progress.event}")
                        if frame.progress.event == frame.progress.EVENT_TURN:
                            gate.touch()  # only now may RUN end
                    elif kind == "finished":
                        assert frame.finished.state == job_pb2.Job.STATE_SUCCEEDED
                        break
        run, turn = job_pb2.STAGE_RUN, pb.StageProgress.EVENT_TURN
        fin = pb.StageProgress.EVENT_FINISHED
        assert order.index(f"{run}:{turn}") < order.index(f"{run}:{fin}")
    finally:
        gate.touch()
        await server.stop(0.2)


def _in_session(sid: int) -> dict[int, str]:
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_bytes()
        except OSError:
            continue
        fields = raw[raw.rindex(b")") + 2:].split()
        if int(fields[3]) == sid:  # the session id
            out[int(entry.name)] = raw[raw.index(b"(") + 1:raw.rindex(b")")].decode()
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sigkilled_workers_server_takes_its_whole_ray_with_it(tmp_path: Path) -> None:
    """Ray kills the processes ray.init started with the server, but its dashboard and
    runtime-env agents (started by the raylet) spend a minute reporting to the dead GCS
    before they exit; the reaper must take them (and every worker) within seconds."""
    import subprocess
    import sys
    import time

    env = {**os.environ, **LocalRayCluster.DRIVER_ENV, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout.entrypoints.cli", "serve", "--port", "0", "--workers", "1",
         "--state-dir", str(tmp_path / "state"), "--set", "llm.backends=[]",
         "--set", f"cluster.node_state_dir={tmp_path}/nodes"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if b"listening" in line:
                break
        else:
            pytest.fail(f"rollout serve --workers 1 exited with {proc.wait()}")
        deadline = time.monotonic() + 60
        while not any(n.startswith("ray::") for n in _in_session(proc.pid).values()):
            assert time.monotonic() < deadline, _in_session(proc.pid)
            time.sleep(0.5)
        time.sleep(2)  # the reaper lists the raylet's children once a second
        os.kill(proc.pid, 9)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while left := _in_session(proc.pid):
            assert time.monotonic() < deadline, f"outlived the server: {left}"
            time.sleep(0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
