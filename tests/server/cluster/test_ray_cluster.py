"""A real local Ray cluster (head + nodes, each its own ``ray start`` process group), a real
server with ``cluster.ray`` pointing at it, real bubblewrap sandboxes on the nodes, and a real
gRPC client session: jobs land on several nodes; a node SIGKILLed mid-run loses nothing and
duplicates nothing; a node that joins mid-run takes work. The cluster is always torn down.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray", reason="the `ray` extra is not installed (scripts/setup_test.sh)")

from rollout.client.aio import RolloutClient
from rollout.runtime.handler import HandlerRegistry
from rollout.runtime.sandbox import reap_stale
from rollout.runtime.types import Stage
from rollout.server.app import Server
from rollout.server.cluster.local_cluster import LocalRayCluster
from rollout.server.config import load_config
from tests.util import assert_eventually

ROOT = Path(__file__).resolve().parents[3]
NODE_KEY = "rollout.node"


def _node_process(pid: int, procs: list[Any]) -> int:
    """The pid among ``procs`` that ``pid`` descends from."""
    wanted = {p.pid for p in procs}
    while pid > 1 and pid not in wanted:
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return pid


def _jobs(prefix: str, n: int, run_s: float, gate: Path | None = None) -> list[dict[str, Any]]:
    """``gate``: RUN waits until that file exists (then sleeps ``run_s``)."""
    task: dict[str, Any] = {"run_s": run_s, "sandbox": True}
    if gate is not None:
        task["gate_file"] = str(gate)
    return [{"job_id": f"{prefix}{i}", "environment": "io", "task": task} for i in range(n)]


async def _collect(session: Any, want: set[str], seen: dict[str, list[dict[str, str]]],
                   timeout: float) -> None:
    """Read trajectories (acking each) until every id of ``want`` arrived; a second delivery
    of an id is recorded, not hidden."""
    async with asyncio.timeout(timeout):
        async for t in session.trajectories():
            seen.setdefault(t.trajectory.job_id, []).append(
                {**dict(t.trajectory.metadata), "reward": str(t.trajectory.reward)})
            await session.ack([t.delivery_id])
            if want <= set(seen):
                return


@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_ray_cluster_spreads_jobs_survives_a_node_kill_and_uses_a_joining_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in LocalRayCluster.DRIVER_ENV.items():
        monkeypatch.setenv(key, value)
    cluster = LocalRayCluster(env={"PYTHONPATH": str(ROOT)})
    server: Server | None = None
    try:
        await asyncio.to_thread(cluster.start)
        procs = [await asyncio.to_thread(cluster.add_node, 3) for _ in range(2)]
        cfg = load_config(None, [
            "server.port=0", f"server.state_dir={tmp_path}/state", "llm.backends=[]",
            "server.grace_s=0.2", f"cluster.ray={cluster.address}", "cluster.poll_s=0.5",
            'cluster.handlers={"io": "tests.server.cluster.handlers:IoHandler"}',
            f"cluster.node_state_dir={tmp_path}/nodes"], environ={})
        server = await Server(cfg, registry=HandlerRegistry()).start()
        sched = server.scheduler
        assert sched is not None
        nodes = sched.nodes
        await assert_eventually(lambda: len(nodes) == 2, timeout=180,
                                message="both nodes' agents started")
        # Which Popen is which node: an agent descends from its node's `ray start`.
        group = {name: _node_process(nodes.get(name).pid, procs)  # type: ignore[union-attr]
                 for name in nodes.names()}
        assert sorted(group.values()) == sorted(p.pid for p in procs)

        seen: dict[str, list[dict[str, str]]] = {}
        async with RolloutClient(server.address) as client, client.session("t") as s:
            # RUN waits on a gate until the kill: otherwise a node whose INITs ran seconds
            # ahead of the other's (a loaded machine) could finish its jobs before both nodes
            # were seen running, and the kill would hit no job in RUN.
            gate = tmp_path / "gate"
            first = _jobs("a", 12, run_s=2.0, gate=gate)
            await s.submit(first)
            live = sched._live

            def running_on() -> dict[str, set[str]]:
                by: dict[str, set[str]] = {}
                for j in live.values():
                    if j.node is not None and j.stage is Stage.RUN:
                        by.setdefault(j.node.name, set()).add(j.job_id)
                return by

            await assert_eventually(lambda: len(running_on()) == 2, timeout=120,
                                    message="jobs running on both nodes at once")
            victim = sorted(group)[1]
            doomed = running_on()[victim]
            cluster.kill(next(p for p in procs if p.pid == group[victim]))
            gate.touch()
            await _collect(s, {j["job_id"] for j in first}, seen, timeout=180)

            assert {k: len(v) for k, v in seen.items()} == {j["job_id"]: 1 for j in first}
            assert all(v[0]["reward"] == "1.0" for v in seen.values())
            survivor = sorted(group)[0]
            assert {v[0][NODE_KEY] for v in seen.values()} == {survivor}
            for j in doomed:  # re-run from INIT on the node that lives, counted as a crash
                assert seen[j][0][NODE_KEY] == survivor
                rec = await sched.get(j)
                assert rec is not None and rec.attempts == 2
            assert victim in nodes.lost and sched.node_losses >= len(doomed)

            # A node joining mid-run takes work.
            await asyncio.to_thread(cluster.add_node, 3)
            await assert_eventually(lambda: len(nodes) == 2, timeout=180,
                                    message="the new node's agent started")
            (joined,) = set(nodes.names()) - set(group)
            second = _jobs("b", 9, run_s=1.0)
            await s.submit(second)
            await _collect(s, {j["job_id"] for j in second}, seen, timeout=120)
            assert all(len(seen[j["job_id"]]) == 1 for j in second)
            # Jobs land on several nodes: the survivor and the newcomer both delivered.
            assert {seen[j["job_id"]][0][NODE_KEY] for j in second} == {survivor, joined}
        # Nothing was delivered twice over the whole run.
        assert all(len(v) == 1 for v in seen.values())
    finally:
        if server is not None:
            await server.stop(0.2)
        await asyncio.to_thread(cluster.stop)
        # The killed node could not destroy its sandboxes (its processes died with it; the
        # directories stay): reap them as a restarted agent on that host would.
        for sandboxes in (tmp_path / "nodes").glob("*/sandboxes"):
            reap_stale(sandboxes)
