"""``rollout bench stalled``: N sessions stop reading while long trajectories finish for them;
the server's memory must stay under a ceiling, and every trajectory must arrive exactly once
when the clients read again.

A real server process (loopback gRPC, SQLite store, the ``long`` environment: each trajectory
``--turns`` turns of ``--prompt`` + ``--output`` tokens) runs with ``pipeline.delivery_memory_
bytes`` = ``--budget-mb`` and ``session_memory_bytes`` = ``--share-mb``. N clients each open a
``StreamRollouts`` session, submit ``--jobs`` jobs, and read nothing until every job has
finished (a trainer stuck in a long optimiser step, or a hung client). The server's RSS is
sampled all along. Then the clients resume: the even ones read on from the same stream, the odd
ones drop it and reconnect (their trajectories replay from the store). Each acknowledges what
it reads, and the books are checked: every job delivered once, none missing, none twice.

Baselines measured in the same run, same jobs:
- ``reading``: the same clients read and acknowledge as trajectories arrive (what the server
  needs when nobody stalls);
- ``stalled, no budget``: the budget set far above anything (what a stalled reader cost before
  the budget: each session kept up to ``max_unacked`` trajectories in memory).

Printed per run: trajectories, their size as the budget counts them (decoded objects) and on
the wire, RSS at start / peak / growth, the budget's own peak (``rollout_delivery_memory_
peak_bytes``), the ceiling, delivered once / missing / twice. The exit status is 1 when the
budgeted run passes the ceiling or its books do not balance.

Run: ``rollout bench stalled [--sessions 4 --jobs 24 --turns 2000 --budget-mb 256
--share-mb 64 --ceiling-mb 1024]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.benchmarks.soak import _free_port

ROOT = Path(__file__).resolve().parents[1]


def _serve(state_dir: str, port: int, metrics_port: int, budget_mb: float,
           share_mb: float) -> int:
    from rollout.benchmarks.handlers import serve_until_signalled
    from rollout.server.config import load_config

    cfg = load_config(None, [
        f"server.port={port}", f"server.state_dir={state_dir}", "server.heartbeat_s=1",
        f"server.metrics_port={metrics_port}",
        "llm.backends=[]", "pipeline.init_workers=4", "pipeline.run_workers=4",
        "pipeline.eval_workers=4", f"pipeline.delivery_memory_bytes={int(budget_mb * 2**20)}",
        f"pipeline.session_memory_bytes={int(share_mb * 2**20)}"], environ={})
    return serve_until_signalled(cfg, grace_s=0.5)


class ServerProcess:
    def __init__(self, state_dir: str, budget_mb: float, share_mb: float) -> None:
        self.state_dir = state_dir
        self.args = [str(budget_mb), str(share_mb)]
        self.port = _free_port()
        self.metrics_port = _free_port()
        self.proc: asyncio.subprocess.Process | None = None
        self._log = open(Path(state_dir).parent / "server.log", "ab")

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rollout.benchmarks.stalled", "--serve", self.state_dir,
            "--port", str(self.port), "--serve-budget", str(self.metrics_port), *self.args,
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=self._log)
        assert self.proc.stdout is not None
        async with asyncio.timeout(120):
            line = (await self.proc.stdout.readline()).decode().split()
        if not line or line[0] != "PORT":
            raise RuntimeError(f"the bench server did not start; see {self._log.name}")

    async def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        try:
            async with asyncio.timeout(30):
                await self.proc.wait()
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        self._log.close()

    def metric(self, name: str) -> float:
        """One sample of the server's Prometheus endpoint (its own count of held bytes)."""
        import urllib.request

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise KeyError(f"{name} is not among the server's metrics")

    def rss_mb(self) -> float:
        if self.proc is None:
            return 0.0
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0


@dataclass
class Client:
    client_id: str
    jobs: list[str]
    got: dict[str, int] = field(default_factory=dict)
    """Job id -> times its trajectory was read."""
    wire_bytes: int = 0


async def _session(address: str, c: Client, *, submit: bool, read: asyncio.Event,
                   task: dict[str, float]) -> None:
    """Open, optionally submit, then read (once ``read`` is set) and ack until every job of the
    client arrived. Each client has its own connection, as separate trainers do: a stream
    nobody reads fills its connection's flow-control window, and every other call on that
    connection would wait behind it."""
    import grpc

    from rollout.v1 import rollout_service_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        await _stream(pb_grpc.RolloutServiceStub(channel), c, submit=submit, read=read,
                      task=task)


async def _stream(stub: Any, c: Client, *, submit: bool, read: asyncio.Event,
                  task: dict[str, float]) -> None:
    from rollout.v1 import job_pb2
    from rollout.v1 import rollout_service_pb2 as pb

    requests: asyncio.Queue[Any] = asyncio.Queue()
    await requests.put(pb.StreamRolloutsRequest(open=pb.OpenSession(
        client_id=c.client_id, progress=False)))
    if submit:
        await requests.put(pb.StreamRolloutsRequest(submit=pb.SubmitJobs(jobs=[
            job_pb2.JobSpec(job_id=j, environment="long", task=task) for j in c.jobs])))

    async def feed() -> Any:
        while (req := await requests.get()) is not None:
            yield req

    call = stub.StreamRollouts(feed())
    await read.wait()
    async for f in call:
        if f.WhichOneof("kind") == "trajectory":
            c.got[f.job_id] = c.got.get(f.job_id, 0) + 1
            c.wire_bytes += f.ByteSize()
            await requests.put(pb.StreamRolloutsRequest(
                ack=pb.AckTrajectories(delivery_ids=[f.trajectory.delivery_id])))
            if set(c.got) >= set(c.jobs):
                await requests.put(None)
                break


@dataclass
class Result:
    name: str
    trajectories: int
    traj_mb: float
    wire_mb: float
    rss_start: float
    rss_peak: float
    budget_peak_mb: float
    once: int
    missing: int
    twice: int
    seconds: float


async def _finished(stub: Any, n: int) -> bool:
    from rollout.v1 import rollout_service_pb2 as pb

    st = await stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)
    return sum(v for k, v in st.jobs_by_state.items()
               if k in ("SUCCEEDED", "FAILED", "CANCELLED")) >= n


async def _run(name: str, args: argparse.Namespace, *, stall: bool, budget_mb: float,
               share_mb: float) -> Result:
    import grpc

    from rollout.benchmarks.handlers import long_turns
    from rollout.runtime.types import Trajectory
    from rollout.server.pipeline.delivery_budget import held_bytes
    from rollout.v1 import rollout_service_pb2_grpc as pb_grpc

    task = {"turns": args.turns, "prompt": args.prompt, "output": args.output,
            "run_s": args.run_s}
    clients = [Client(f"stalled-{i}", [f"s{i}-j{k}" for k in range(args.jobs)])
               for i in range(args.sessions)]
    total = args.sessions * args.jobs
    with tempfile.TemporaryDirectory(prefix="rollout-stalled-") as tmp:
        server = ServerProcess(str(Path(tmp) / "state"), budget_mb, share_mb)
        await server.start()
        await asyncio.sleep(0.5)
        rss_start = peak = server.rss_mb()
        t0 = time.monotonic()
        sampling = True

        async def sample() -> None:
            nonlocal peak
            while sampling:
                peak = max(peak, server.rss_mb())
                await asyncio.sleep(0.1)

        sampler = asyncio.create_task(sample())
        try:
            address = f"127.0.0.1:{server.port}"
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.RolloutServiceStub(channel)
                read = asyncio.Event()
                if not stall:
                    read.set()
                first = [asyncio.create_task(_session(address, c, submit=True, read=read,
                                                      task=task)) for c in clients]
                async with asyncio.timeout(args.timeout):
                    while not await _finished(stub, total):
                        await asyncio.sleep(0.5)
                    if stall:
                        await asyncio.sleep(2)  # everything finished; nobody has read
                        dropped = first[1::2]  # the odd clients drop the stalled stream
                        for t in dropped:
                            t.cancel()
                        await asyncio.gather(*dropped, return_exceptions=True)
                        again = [asyncio.create_task(_session(address, c, submit=False,
                                                              read=read, task=task))
                                 for i, c in enumerate(clients) if i % 2]
                        read.set()
                        first = [t for i, t in enumerate(first) if not i % 2] + again
                    await asyncio.gather(*(t for t in first if not t.done()))
        finally:
            sampling = False
            await sampler
            seconds = time.monotonic() - t0
            budget_peak = await asyncio.to_thread(
                server.metric, "rollout_delivery_memory_peak_bytes")
            await server.stop()
    size = held_bytes(Trajectory(job_id="s0-j0", turns=long_turns("s0-j0", task)))
    got = [n for c in clients for n in c.got.values()]
    return Result(name, total, size / 2**20,
                  sum(c.wire_bytes for c in clients) / max(1, len(got)) / 2**20,
                  rss_start, peak, budget_peak / 2**20, sum(1 for n in got if n == 1),
                  sum(1 for c in clients for j in c.jobs if j not in c.got),
                  sum(1 for n in got if n > 1), seconds)


async def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    console.print(f"stalled: {args.sessions} sessions x {args.jobs} jobs of {args.turns} turns "
                  f"({args.prompt}+{args.output} tokens each); budget {args.budget_mb:g} MB, "
                  f"share {args.share_mb:g} MB, ceiling {args.ceiling_mb:g} MB")
    budgeted = await _run("stalled, budget", args, stall=True, budget_mb=args.budget_mb,
                          share_mb=args.share_mb)
    rows = [budgeted]
    if not args.no_baseline:
        rows.append(await _run("reading (baseline)", args, stall=False,
                               budget_mb=args.budget_mb, share_mb=args.share_mb))
        rows.append(await _run("stalled, no budget (baseline)", args, stall=True,
                               budget_mb=1 << 30, share_mb=1 << 30))
    t = Table(title="stalled sessions: server memory and the books on resume")
    for col in ("run", "trajectories", "MB each (decoded)", "MB each (wire)", "RSS start MB",
                "RSS peak MB", "growth MB", "held peak MB", "ceiling MB", "delivered once",
                "missing", "twice", "s"):
        t.add_column(col, justify="left" if col == "run" else "right")
    for r in rows:
        t.add_row(r.name, str(r.trajectories), f"{r.traj_mb:.1f}", f"{r.wire_mb:.2f}",
                  f"{r.rss_start:.0f}", f"{r.rss_peak:.0f}", f"{r.rss_peak - r.rss_start:.0f}",
                  f"{r.budget_peak_mb:.0f}",
                  f"{args.ceiling_mb:g}" if r is budgeted else "-", str(r.once),
                  str(r.missing), str(r.twice), f"{r.seconds:.0f}")
    console.print(t)
    bad = []
    if budgeted.rss_peak > args.ceiling_mb:
        bad.append(f"RSS peak {budgeted.rss_peak:.0f} MB passed the ceiling")
    for r in rows:
        if r.missing or r.twice or r.once != r.trajectories:
            bad.append(f"{r.name}: {r.missing} missing, {r.twice} twice")
    for b in bad:
        console.print(f"[red]{b}[/red]")
    if not bad:
        console.print("[green]RSS under the ceiling with every session stalled; every "
                      "trajectory delivered exactly once on resume[/green]")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollout bench stalled", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sessions", type=int, default=4, help="stalled sessions (N)")
    p.add_argument("--jobs", type=int, default=24, help="jobs per session")
    p.add_argument("--turns", type=int, default=2000, help="turns per trajectory")
    p.add_argument("--prompt", type=int, default=60, help="prompt tokens per turn")
    p.add_argument("--output", type=int, default=20, help="output tokens per turn")
    p.add_argument("--run-s", type=float, default=1.0,
                   help="seconds each RUN takes (4 RUN workers): trajectories finish at an "
                        "agent's pace; with 0 they finish faster than the store commits them "
                        "and that backlog, not the sessions, sets the server's memory")
    p.add_argument("--budget-mb", type=float, default=256.0,
                   help="pipeline.delivery_memory_bytes, in MiB")
    p.add_argument("--share-mb", type=float, default=64.0,
                   help="pipeline.session_memory_bytes, in MiB")
    p.add_argument("--ceiling-mb", type=float, default=1024.0,
                   help="the server's RSS must stay under this with every session stalled")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on each run, seconds")
    p.add_argument("--no-baseline", action="store_true", help="only the budgeted run")
    p.add_argument("--serve", metavar="STATE_DIR", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--serve-budget", nargs=3, type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        metrics_port, budget_mb, share_mb = args.serve_budget
        return _serve(args.serve, args.port, int(metrics_port), budget_mb, share_mb)
    return asyncio.run(_bench(args))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
