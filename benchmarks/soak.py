"""``rollout bench soak``: many clients with random disconnects and a server SIGKILLed now and
then; the books must balance.

A real server process (loopback gRPC, SQLite store, the ``sleep`` environment with a few
milliseconds per stage, so kills land inside stages, in queues and in commits) runs on a fixed
port and state directory. N clients, each a raw ``StreamRollouts`` stream with its own client
id, submit their jobs gradually, acknowledge every trajectory, and cut their own connection at
random (exponential gaps). M times during the run the server is killed with SIGKILL and started
again on the same port and state. Clients reconnect with ``acked_through`` = the highest id up to
which they received every delivery, and re-submit jobs they never saw accepted (idempotent).

When the run ends the disruptions stop and every client drains. Printed, per the issue:

- submitted: jobs the server accepted (each counted once, however often re-submitted);
- delivered once: jobs whose trajectory arrived under exactly one delivery id;
- lost: accepted jobs never delivered;
- duplicated after ack: deliveries re-sent although a session had opened with an
  ``acked_through`` covering them (the server committed that ack before replaying);
- re-issued ids: one (client, delivery id) carrying two different jobs;
- failed by restarts: jobs that ended FAILED (the ``sleep`` environment never fails by itself);
- server RSS at the start (first process, after start-up) and at the end (last process, after the
  drain), and the peak seen in between.

All but the first two must be 0; the exit status is 1 otherwise. Baseline in the same run: the
same clients and jobs with no kills and no disconnects, so the cost of the chaos shows.

Run: ``rollout bench soak [--clients 8 --jobs 300 --kills 3 --duration 90]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- server process


def _serve(state_dir: str, port: int) -> int:
    """Child process: a real server on ``port`` with the bench environments, no LLM."""
    from rollout.benchmarks.handlers import serve_until_signalled
    from rollout.server.config import load_config

    cfg = load_config(None, [f"server.port={port}", f"server.state_dir={state_dir}",
                             "server.heartbeat_s=1", "llm.backends=[]",
                             "pipeline.init_workers=8", "pipeline.run_workers=8",
                             "pipeline.eval_workers=8"], environ={})
    return serve_until_signalled(cfg, grace_s=0.5)


class ServerProcess:
    """Starts, SIGKILLs and restarts the server child on one port and state directory."""

    def __init__(self, state_dir: str, port: int) -> None:
        self.state_dir = state_dir
        self.port = port
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0
        self._log = open(Path(state_dir).parent / "server.log", "ab")

    async def start(self) -> None:
        for attempt in range(50):  # the port of a killed server may take a moment to free
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "rollout.benchmarks.soak", "--serve", self.state_dir,
                "--port", str(self.port), cwd=ROOT, stdout=asyncio.subprocess.PIPE,
                stderr=self._log)
            assert proc.stdout is not None
            async with asyncio.timeout(120):  # not wait_for: 3.11's can drop a cancel
                line = (await proc.stdout.readline()).decode().split()
            if line and line[0] == "PORT":
                self.proc = proc
                self.starts += 1
                return
            await proc.wait()
            await asyncio.sleep(0.1 * (attempt + 1))
        raise RuntimeError(f"the soak server did not start; see {self._log.name}")

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)

    async def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(30):
                await self.proc.wait()
        except TimeoutError:
            self.kill()
            await self.proc.wait()
        self.proc = None
        self._log.close()

    def rss_mb(self) -> float:
        if self.proc is None:
            return 0.0
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------- clients


@dataclass
class Books:
    """One client's ledger, kept across its sessions."""

    client_id: str
    jobs: list[str]
    accepted: set[str] = field(default_factory=set)
    delivered: dict[str, set[int]] = field(default_factory=dict)
    """Job id -> the delivery ids it arrived under."""
    by_id: dict[int, str] = field(default_factory=dict)
    received: set[int] = field(default_factory=set)
    acked_through: int = 0
    """Every delivery id up to here was received (and acked)."""
    confirmed: int = 0
    """acked_through of the latest session that opened: the server committed it."""
    failed: dict[str, str] = field(default_factory=dict)
    dup_after_ack: int = 0
    reissued: int = 0
    sessions: int = 0
    cuts: int = 0

    def done(self) -> bool:
        return (len(self.delivered) == len(self.jobs)
                and self.acked_through >= max(self.received, default=0))

    def on_delivery(self, delivery_id: int, job_id: str) -> None:
        if delivery_id <= self.confirmed:
            self.dup_after_ack += 1
        other = self.by_id.get(delivery_id)
        if other is not None and other != job_id:
            self.reissued += 1
        self.by_id[delivery_id] = job_id
        self.delivered.setdefault(job_id, set()).add(delivery_id)
        self.received.add(delivery_id)
        while self.acked_through + 1 in self.received:
            self.acked_through += 1


@dataclass
class Chaos:
    """What disturbs the run; switched off for the drain and the baseline."""

    on: bool = True
    mean_cut_s: float = 2.0
    cut_after_submit: float = 0.2
    """Chance that a client cuts its stream within a few ms of sending a batch (the window in
    which the batch is being committed)."""


async def _session(stub: Any, books: Books, released: Any, chaos: Chaos,
                   rng: random.Random) -> None:
    """One StreamRollouts session: submit what is due, take and ack deliveries, maybe cut."""
    from google.protobuf import duration_pb2

    from rollout.v1 import job_pb2
    from rollout.v1 import rollout_service_pb2 as pb

    requests: asyncio.Queue[Any] = asyncio.Queue()
    hb = duration_pb2.Duration(seconds=1)
    await requests.put(pb.StreamRolloutsRequest(open=pb.OpenSession(
        client_id=books.client_id, acked_through=books.acked_through, progress=False,
        heartbeat_interval=hb, max_unacked=256)))
    opened_with = books.acked_through

    call = stub.StreamRollouts()
    in_flight: set[str] = set()

    async def writer() -> None:  # one writer: grpc.aio takes one write at a time
        while (item := await requests.get()) is not None:
            await call.write(item)
        await call.done_writing()

    async def submitter() -> None:
        while True:
            due = [j for j in released() if j not in books.accepted and j not in in_flight]
            for i in range(0, len(due), 100):
                chunk = due[i:i + 100]
                in_flight.update(chunk)
                await requests.put(pb.StreamRolloutsRequest(submit=pb.SubmitJobs(jobs=[
                    job_pb2.JobSpec(job_id=j, environment="sleep", task={
                        "init_s": rng.uniform(0, 0.02), "run_s": rng.uniform(0, 0.03),
                        "eval_s": rng.uniform(0, 0.01)}) for j in chunk])))
                if chaos.on and rng.random() < chaos.cut_after_submit:
                    await asyncio.sleep(rng.uniform(0, 0.005))
                    books.cuts += 1
                    call.cancel()
                    return
            await asyncio.sleep(0.2)

    async def cutter() -> None:
        while True:
            await asyncio.sleep(rng.expovariate(1 / chaos.mean_cut_s))
            if chaos.on:
                books.cuts += 1
                call.cancel()
                return

    tasks = [asyncio.create_task(writer()), asyncio.create_task(submitter()),
             asyncio.create_task(cutter())]
    try:
        first = await call.read()
        if first is grpc_eof() or first.WhichOneof("kind") != "opened":
            return
        books.sessions += 1
        books.confirmed = max(books.confirmed, opened_with)
        while not books.done():
            frame = await call.read()
            if frame is grpc_eof():
                return
            kind = frame.WhichOneof("kind")
            if kind == "accepted":
                books.accepted.add(frame.job_id)
                in_flight.discard(frame.job_id)
            elif kind == "rejected":
                in_flight.discard(frame.job_id)  # overloaded or shutting down: submit again
            elif kind == "trajectory":
                did = frame.trajectory.delivery_id
                books.accepted.add(frame.job_id)
                books.on_delivery(did, frame.job_id)
                await requests.put(pb.StreamRolloutsRequest(
                    ack=pb.AckTrajectories(delivery_ids=[did])))
            elif kind == "finished":
                if frame.finished.state == job_pb2.Job.STATE_FAILED:
                    books.failed[frame.job_id] = frame.finished.error.reason
        await requests.put(None)  # half-close: everything is received and acked
        with contextlib.suppress(Exception):
            while await call.read() is not grpc_eof():
                pass
    finally:
        for t in tasks:
            t.cancel()
        call.cancel()


def grpc_eof() -> Any:
    import grpc

    return grpc.aio.EOF


async def _client(address: str, books: Books, released: Any, chaos: Chaos,
                  rng: random.Random, deadline: float) -> None:
    import grpc

    from rollout.v1 import rollout_service_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        while not books.done() and time.monotonic() < deadline:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
                await _session(stub, books, released, chaos, rng)
            if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise asyncio.CancelledError
            if not books.done():
                await asyncio.sleep(rng.uniform(0.05, 0.3))


# ----------------------------------------------------------------------------- one run


@dataclass
class Result:
    name: str
    seconds: float
    submitted: int
    delivered_once: int
    lost: int
    dup_after_ack: int
    reissued: int
    failed: int
    kills: int
    cuts: int
    rss_start: float
    rss_end: float
    rss_peak: float
    reasons: dict[str, int]


async def _run(name: str, clients: int, jobs: int, kills: int, duration: float,
               mean_cut_s: float, seed: int, drain_s: float, bursts: int) -> Result:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="rollout-soak-") as tmp:
        server = ServerProcess(str(Path(tmp) / "state"), _free_port())
        await server.start()
        await asyncio.sleep(0.5)
        rss_start = server.rss_mb()
        peak = rss_start
        address = f"127.0.0.1:{server.port}"
        chaos = Chaos(on=kills > 0 or mean_cut_s > 0, mean_cut_s=mean_cut_s or 1e9,
                      cut_after_submit=0.2 if mean_cut_s else 0.0)
        t0 = time.monotonic()
        # Jobs arrive in bursts (a trainer step's batch), so there is a backlog (jobs waiting
        # in queues, jobs between stages) when the server is killed shortly after a burst.
        gap = duration * 0.8 / bursts
        ledgers = [Books(f"soak-{c}", [f"c{c}-j{k}" for k in range(jobs)])
                   for c in range(clients)]

        def released_for(b: Books) -> Any:
            def released() -> list[str]:
                due = min(bursts, int((time.monotonic() - t0) / gap) + 1)
                return b.jobs[:len(b.jobs) * due // bursts]
            return released

        deadline = t0 + duration + drain_s
        tasks = [asyncio.create_task(_client(address, b, released_for(b), chaos,
                                             random.Random(rng.random()), deadline))
                 for b in ledgers]
        # Kills come in quick succession into the first burst's backlog: the same jobs are
        # interrupted again and again (queued, between stages, inside stages, committing).
        kill_at = [0.5 + 1.5 * i + rng.uniform(0, 0.5) for i in range(kills)]
        done_kills = 0
        try:
            while any(not t.done() for t in tasks):
                now = time.monotonic() - t0
                peak = max(peak, server.rss_mb())
                if kill_at and now >= kill_at[0]:
                    kill_at.pop(0)
                    server.kill()
                    assert server.proc is not None
                    await server.proc.wait()
                    done_kills += 1
                    await server.start()
                if now >= duration:
                    chaos.on = False
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.25)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            seconds = time.monotonic() - t0
            rss_end = server.rss_mb()
            await server.stop()
    accepted = sum(len(b.accepted) for b in ledgers)
    once = sum(1 for b in ledgers for ids in b.delivered.values() if len(ids) == 1)
    lost = sum(1 for b in ledgers for j in b.accepted if j not in b.delivered)
    twice = sum(1 for b in ledgers for ids in b.delivered.values() if len(ids) > 1)
    reasons: dict[str, int] = {}
    for b in ledgers:
        for r in b.failed.values():
            reasons[r] = reasons.get(r, 0) + 1
    return Result(name, seconds, accepted, once, lost,
                  sum(b.dup_after_ack for b in ledgers) + twice,
                  sum(b.reissued for b in ledgers), sum(len(b.failed) for b in ledgers),
                  done_kills, sum(b.cuts for b in ledgers), rss_start, rss_end,
                  max(peak, rss_end), reasons)


# ----------------------------------------------------------------------------- main


async def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"soak: {args.clients} clients x {args.jobs} jobs, {args.kills} SIGKILLs and "
                  f"disconnects every ~{args.cut_s:g}s per client over {args.duration:g}s")
    chaos = await _run("chaos", args.clients, args.jobs, args.kills, args.duration, args.cut_s,
                       args.seed, args.drain, args.bursts)
    rows = [chaos]
    if not args.no_baseline:
        rows.append(await _run("baseline (no kills, no cuts)", args.clients, args.jobs, 0,
                               args.duration, 0, args.seed, args.drain, args.bursts))
    t = Table(title="soak: the books after the run (all but the first two must be 0)")
    for col in ("run", "s", "kills", "cuts", "submitted", "delivered once", "lost",
                "duplicated after ack", "re-issued ids", "failed by restarts",
                "RSS start MB", "RSS end MB", "RSS peak MB"):
        t.add_column(col, justify="right" if col != "run" else "left")
    for r in rows:
        t.add_row(r.name, f"{r.seconds:.0f}", str(r.kills), str(r.cuts), str(r.submitted),
                  str(r.delivered_once), str(r.lost), str(r.dup_after_ack), str(r.reissued),
                  str(r.failed), f"{r.rss_start:.0f}", f"{r.rss_end:.0f}", f"{r.rss_peak:.0f}")
    console.print(t)
    bad = [r for r in rows if r.lost or r.dup_after_ack or r.reissued or r.failed
           or r.submitted != args.clients * args.jobs]
    for r in bad:
        console.print(f"[red]{r.name}: books do not balance[/red] (failure reasons: "
                      f"{r.reasons or 'none'}; submitted {r.submitted} of "
                      f"{args.clients * args.jobs})")
    if not bad:
        console.print("[green]every accepted job delivered exactly once; none lost, none "
                      "re-issued, none failed by the restarts[/green]")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollout bench soak", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (N)")
    p.add_argument("--jobs", type=int, default=300, help="jobs per client")
    p.add_argument("--kills", type=int, default=3, help="server SIGKILLs during the run (M)")
    p.add_argument("--duration", type=float, default=90.0,
                   help="length of the chaos: jobs arrive in bursts over its first 80%%; the "
                        "run ends once every job is delivered and acked")
    p.add_argument("--bursts", type=int, default=3,
                   help="bursts the jobs arrive in (the kills hit the first one's backlog, "
                        "1.5-2 s apart; later bursts meet only client disconnects)")
    p.add_argument("--cut-s", type=float, default=2.0,
                   help="mean seconds between a client's own disconnects")
    p.add_argument("--drain", type=float, default=120.0,
                   help="seconds allowed after the chaos for everything to arrive")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-baseline", action="store_true", help="skip the undisturbed run")
    p.add_argument("--serve", metavar="STATE_DIR", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return _serve(args.serve, args.port)
    return asyncio.run(_bench(args))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
