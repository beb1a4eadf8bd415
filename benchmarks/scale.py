"""``rollout bench scale``: throughput of an I/O-bound environment on 1, 2 and 4 Ray nodes.

A local multi-node Ray cluster on this machine (``server/cluster/local_cluster.py``: a head
and nodes, each its own ``ray start`` process group with its own ``rollout_node`` /
``rollout_slots`` resources) and one server with ``cluster.ray`` pointing at it, driven over
loopback gRPC by one ``StreamRollouts`` session. The environment (``scale-io``, below) is I/O
bound like an agent waiting on tools: INIT opens a bubblewrap sandbox, RUN makes ``--calls``
tool calls through the sandbox's persistent bash, each ``sleep --sleep-s; echo``, and EVAL
checks every call's output came back.

Rows, all in this run:
- baseline: the single-process server (no Ray) with as many RUN slots as one node has, and
  with as many as four nodes have;
- 1, 2, 4 nodes: nodes join the running server one after another (a node that joins takes
  work at once); each row runs ``--waves`` x (nodes x slots) jobs; scaling efficiency is
  throughput / (nodes x throughput on 1 node);
- a node killed mid-run: on 4 nodes, one node is SIGKILLed (its whole process group) while
  jobs run on it; lost (accepted, never delivered) and duplicated (delivered twice) must be 0.
Exit status 1 when anything is lost or duplicated.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rollout.runtime.handler import (
    AgentHandler,
    HandlerError,
    HandlerRegistry,
    JobContext,
    RunOutcome,
)
from rollout.runtime.types import Reward, TerminationReason, Turn

ENV = "scale-io"
_TURN = Turn(prompt_ids=[1, 2, 3], output_ids=[4, 5], output_logprobs=[-0.5, -0.25])


class IoBoundHandler(AgentHandler):
    """Sandbox + bash + sleep-dominated tool calls (task: ``calls``, ``sleep_s``)."""

    name = ENV

    async def init(self, ctx: JobContext) -> None:
        sandbox = await ctx.open_sandbox()
        await sandbox.bash()  # the persistent shell starts in INIT, as a real agent's would
        ctx.state["sandbox"] = sandbox

    async def run(self, ctx: JobContext) -> RunOutcome:
        bash = await ctx.state["sandbox"].bash()
        outputs = []
        for i in range(int(ctx.spec.task.get("calls", 2))):
            res = await bash.run(f"sleep {float(ctx.spec.task.get('sleep_s', 1.0))}; echo call{i}")
            outputs.append(res.output.strip())
        return RunOutcome(turns=[_TURN], termination=TerminationReason.NO_TOOL_CALL,
                          metadata={"outputs": ",".join(outputs)})

    async def eval(self, ctx: JobContext) -> Reward:
        assert ctx.outcome is not None
        calls = int(ctx.spec.task.get("calls", 2))
        if ctx.outcome.metadata["outputs"] != ",".join(f"call{i}" for i in range(calls)):
            raise HandlerError("a tool call's output did not come back")
        return Reward(1.0)


@dataclass
class Row:
    name: str
    nodes: int
    jobs: int
    seconds: float
    lost: int = 0
    duplicated: int = 0
    failed: int = 0

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds


async def _drive(address: str, prefix: str, n: int, task: dict[str, Any],
                 during: Any = None) -> tuple[float, int, int, int]:
    """Submit ``n`` jobs in one session, receive and ack every trajectory. Returns (seconds,
    lost, duplicated, failed); ``during(started)`` runs beside the session (fault injection)."""
    from rollout.client.aio import RolloutClient

    ids = [f"{prefix}-{i}" for i in range(n)]
    seen: dict[str, int] = {}
    failed = 0
    async with RolloutClient(address) as client, client.session(f"bench-{prefix}") as s:
        t0 = time.perf_counter()
        await s.submit([{"job_id": j, "environment": ENV, "task": task} for j in ids])
        side = asyncio.ensure_future(during()) if during is not None else None
        try:
            async with asyncio.timeout(600):
                async for t in s.trajectories():
                    seen[t.trajectory.job_id] = seen.get(t.trajectory.job_id, 0) + 1
                    failed += t.trajectory.reward != 1.0
                    await s.ack([t.delivery_id])
                    if len(seen) == n:
                        break
        finally:
            if side is not None:
                await side
        seconds = time.perf_counter() - t0
        await asyncio.sleep(0.5)  # a late duplicate would arrive here
        while not s._events.empty():
            frame = s._events.get_nowait()
            if getattr(frame, "WhichOneof", lambda _: "")("kind") == "trajectory":
                seen[frame.trajectory.trajectory.job_id] += 1
    lost = sum(1 for j in ids if j not in seen)
    duplicated = sum(c - 1 for c in seen.values())
    return seconds, lost, duplicated, failed


def _config(state: Path, extra: list[str]) -> Any:
    from rollout.server.config import load_config

    return load_config(None, [f"server.state_dir={state}", "server.port=0", "llm.backends=[]",
                              "server.grace_s=0.5", *extra], environ={})


async def _single_process(tmp: Path, slots: int, jobs: int, task: dict[str, Any]) -> Row:
    from rollout.server.app import Server

    reg = HandlerRegistry()
    reg.register(ENV, IoBoundHandler())
    cfg = _config(tmp / f"single-{slots}", [
        f"pipeline.init_workers={slots}", f"pipeline.run_workers={slots}",
        f"pipeline.eval_workers={slots}"])
    server = await Server(cfg, registry=reg).start()
    try:
        sec, lost, dup, failed = await _drive(server.address, f"single{slots}", jobs, task)
    finally:
        await server.stop(0.5)
    return Row(f"single process, {slots} slots", 0, jobs, sec, lost, dup, failed)


async def _cluster_rows(tmp: Path, counts: list[int], slots: int, waves: int,
                        task: dict[str, Any], kill: bool, console: Console) -> list[Row]:
    from rollout.runtime.types import Stage
    from rollout.server.app import Server
    from rollout.server.cluster.local_cluster import LocalRayCluster

    os.environ.update(LocalRayCluster.DRIVER_ENV)
    rows: list[Row] = []
    cluster = LocalRayCluster()
    server = None
    try:
        console.print("starting a local Ray head …")
        await asyncio.to_thread(cluster.start)
        top = max(counts)
        big = top * slots * 4  # the server's stage pools never limit: node slots do
        cfg = _config(tmp / "cluster", [
            f"cluster.ray={cluster.address}", "cluster.poll_s=0.5",
            f'cluster.handlers={{"{ENV}": "rollout.benchmarks.scale:IoBoundHandler"}}',
            f"cluster.node_state_dir={tmp}/nodes", f"pipeline.init_workers={big}",
            f"pipeline.run_workers={big}", f"pipeline.eval_workers={big}"])
        procs: list[Any] = []
        for n in sorted(counts):
            while len(procs) < n:
                console.print(f"starting Ray node {len(procs) + 1} …")
                procs.append(await asyncio.to_thread(cluster.add_node, slots))
            if server is None:
                reg = HandlerRegistry()
                reg.register(ENV, IoBoundHandler())
                server = await Server(cfg, registry=reg).start()
            assert server.scheduler is not None
            nodes = server.scheduler.nodes
            async with asyncio.timeout(240):
                while len(nodes) < n:
                    await asyncio.sleep(0.2)
            jobs = waves * n * slots
            sec, lost, dup, failed = await _drive(server.address, f"n{n}", jobs, task)
            rows.append(Row(f"{n} node{'s' if n > 1 else ''} x {slots} slots", n, jobs, sec,
                            lost, dup, failed))
        if kill and server is not None:
            assert server.scheduler is not None
            sched = server.scheduler
            live = sched._live
            victim = sorted(sched.nodes.names())[-1]

            async def kill_one() -> None:
                async with asyncio.timeout(120):
                    while not any(j.node is not None and j.node.name == victim
                                  and j.stage is Stage.RUN for j in live.values()):
                        await asyncio.sleep(0.05)
                node = sched.nodes.get(victim)
                pid = getattr(node, "pid", 0)
                for proc in procs:  # the node's `ray start` is an ancestor of its agent
                    if _descends(pid, proc.pid):
                        console.print(f"killing node {victim} (process group {proc.pid})")
                        cluster.kill(proc)
                        return

            n = len(procs)
            jobs = waves * n * slots
            sec, lost, dup, failed = await _drive(server.address, "kill", jobs, task, kill_one)
            rows.append(Row(f"{n} nodes, one killed mid-run", n, jobs, sec, lost, dup, failed))
    finally:
        if server is not None:
            await server.stop(0.5)
        await asyncio.to_thread(cluster.stop)
        from rollout.runtime.sandbox import reap_stale

        for sandboxes in (tmp / "nodes").glob("*/sandboxes"):
            reap_stale(sandboxes)
    return rows


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


def render(rows: list[Row], console: Console) -> None:
    one = next((r for r in rows if r.nodes == 1), None)
    table = Table(title="rollout bench scale: I/O-bound environment (measured in this run)")
    for col in ("configuration", "jobs", "seconds", "jobs/s", "efficiency", "lost",
                "duplicated", "failed"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for r in rows:
        eff = (f"{100 * r.rate / (r.nodes * one.rate):.0f}%"
               if one is not None and r.nodes and "killed" not in r.name else "")
        table.add_row(r.name, str(r.jobs), f"{r.seconds:.1f}", f"{r.rate:.2f}", eff,
                      str(r.lost), str(r.duplicated), str(r.failed))
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollout bench scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="1,2,4", help="node counts (default 1,2,4)")
    parser.add_argument("--slots", type=int, default=4, help="jobs per node (default 4)")
    parser.add_argument("--waves", type=int, default=3,
                        help="jobs per row = waves x nodes x slots (default 3)")
    parser.add_argument("--calls", type=int, default=2, help="tool calls per job (default 2)")
    parser.add_argument("--sleep-s", type=float, default=1.0,
                        help="sleep in each tool call (default 1.0)")
    parser.add_argument("--no-kill", action="store_true", help="skip the node-kill row")
    args = parser.parse_args(argv)
    if shutil.which("bwrap") is None:
        Console(stderr=True).print("bubblewrap (bwrap) is not installed")
        return 2
    counts = sorted({int(x) for x in args.nodes.split(",") if x.strip()})
    task = {"calls": args.calls, "sleep_s": args.sleep_s}
    console = Console(width=max(Console().width, 110))  # the table stays one line per row
    tmp = Path(tempfile.mkdtemp(prefix="rollout-bench-scale-"))

    async def run() -> list[Row]:
        rows = [await _single_process(tmp, args.slots, args.waves * args.slots, task),
                await _single_process(tmp, max(counts) * args.slots,
                                      args.waves * max(counts) * args.slots, task)]
        rows += await _cluster_rows(tmp, counts, args.slots, args.waves, task,
                                    not args.no_kill, console)
        return rows

    try:
        rows = asyncio.run(run())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    render(rows, console)
    bad = sum(r.lost + r.duplicated for r in rows)
    if bad:
        console.print(f"[red]{bad} trajectories lost or duplicated[/red]")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
