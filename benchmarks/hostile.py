"""``rollout bench hostile``: well-behaved tenants beside hostile ones, against the same load
without them (issue 31's mixed soak).

A real server process (loopback gRPC, SQLite store, the model gateway over a scripted policy
with the real SmolLM2 tokenizer, the dashboard, two tenants with their own tokens) runs twice
on fresh state, for the same well-behaved work:

- **good tenant**: ``--jobs`` harness-style jobs (``gw-good``: RUN opens a gateway lease and
  makes ``--calls`` chat requests over its Unix socket, each resending the growing
  conversation, timing every request as the harness sees it);
- **hostile tenant**, second run only, all at once:
  - ``gw-hostile`` jobs whose RUN starts a separate process that floods the job's own gateway
    socket with ``--flood`` half-sent requests (every other job: keeps posting chat bodies just
    under the 8 MiB cap from four connections);
  - ``--pages`` live dashboard pages opened with its token and never read;
  - cut clients: sessions that submit jobs and drop their connection, over and over;
  - at the end, one SIGKILL of the server and a restart on the same state, after which every
    good job must still be SUCCEEDED.

Printed: the good tenant's jobs/s and gateway latency (p50, p99) in each run and their ratio
(goal: within 1.5x), the server's peak RSS and open descriptors, and the server log's size
(no log flood). Keep it short on a shared machine: the defaults take about a minute.

Run: ``rollout bench hostile [--jobs 120 --calls 8 --hostile 2 --flood 2000 --pages 30]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.runtime.handler import AgentHandler, HandlerRegistry, JobContext, RunOutcome
from rollout.runtime.types import Reward, TerminationReason

GOOD, EVIL = "good-tenant-token-0123", "evil-tenant-token-0123"
CLIENTS = [{"client_id": "good", "token": GOOD}, {"client_id": "evil", "token": EVIL}]
GIANT = 8 * 1024 * 1024 - 4096

FLOOD_SCRIPT = r'''
import json, socket, sys, threading, time
path, key, count, giant = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
mode = sys.argv[5]
held = []
def flood():
    for _ in range(count):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(2)
        try:
            s.connect(path)
            s.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 99")
            held.append(s)
        except OSError:
            s.close()
def giants():
    body = json.dumps({"model": "m", "messages": [{"role": "user",
                       "content": "lorem ipsum " * (giant // 12)}]}).encode()
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer " + key
            + "\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            "Connection: close\r\n\r\n" % len(body)).encode()
    while True:
        try:
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(30)
            s.connect(path)
            s.sendall(head + body)
            while s.recv(65536):
                pass
            s.close()
        except OSError:
            time.sleep(0.05)
if mode == "giant":
    for _ in range(4):
        threading.Thread(target=giants, daemon=True).start()
    while True:
        time.sleep(1.0)
while True:
    flood()
    time.sleep(1.0)
    held = [s for s in held if s.fileno() != -1]
'''


# ----------------------------------------------------------------------------- environments


class GoodHarness(AgentHandler):
    """A harness that behaves: ``task["calls"]`` requests, each the conversation so far."""

    name = "gw-good"

    async def init(self, ctx: JobContext) -> None:
        return None

    async def run(self, ctx: JobContext) -> RunOutcome:
        import aiohttp

        assert ctx.gateway is not None and ctx.llm is not None
        lease = await ctx.gateway.open(ctx.spec, ctx.llm)
        latencies: list[float] = []
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Count with me: 1."}]
        try:
            async with aiohttp.ClientSession(
                    connector=aiohttp.UnixConnector(path=lease.socket_path),
                    headers={"Authorization": f"Bearer {lease.api_key}"}) as http:
                for i in range(int(ctx.spec.task.get("calls", 4))):
                    t0 = time.monotonic()
                    async with http.post("http://gw/v1/chat/completions",
                                         json={"model": "m", "messages": messages}) as r:
                        answer = await r.json()
                        if r.status != 200:
                            raise RuntimeError(f"gateway answered {r.status}: {answer}")
                    latencies.append(time.monotonic() - t0)
                    messages += [answer["choices"][0]["message"],
                                 {"role": "user", "content": f"{i + 2}."}]
        finally:
            capture = await ctx.gateway.close(lease)
        await asyncio.to_thread(_append, Path(str(ctx.spec.task["latency_file"])),
                                json.dumps(latencies) + "\n")
        return RunOutcome(turns=capture.turns, segments=capture.segments,
                          termination=TerminationReason.NO_TOOL_CALL)

    async def eval(self, ctx: JobContext) -> Reward:
        return Reward(1.0)


def _append(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(line)


class HostileHarness(AgentHandler):
    """A harness that floods its own gateway socket from a separate process for
    ``task["seconds"]``: half-sent requests and chat bodies just under the cap."""

    name = "gw-hostile"

    async def init(self, ctx: JobContext) -> None:
        return None

    async def run(self, ctx: JobContext) -> RunOutcome:
        assert ctx.gateway is not None and ctx.llm is not None
        lease = await ctx.gateway.open(ctx.spec, ctx.llm)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", FLOOD_SCRIPT, lease.socket_path, lease.api_key,
            str(int(ctx.spec.task.get("flood", 2000))), str(GIANT),
            str(ctx.spec.task.get("mode", "flood")),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL)
        try:
            await asyncio.sleep(float(ctx.spec.task.get("seconds", 30)))
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            capture = await ctx.gateway.close(lease)
        return RunOutcome(turns=capture.turns, segments=capture.segments,
                          termination=TerminationReason.NO_TOOL_CALL)

    async def eval(self, ctx: JobContext) -> Reward:
        return Reward(0.0)


# ----------------------------------------------------------------------------- server process


def _serve(state_dir: str, port: int) -> int:
    from transformers import AutoTokenizer

    from rollout.benchmarks.handlers import register_bench_handlers
    from rollout.server.app import Server
    from rollout.server.config import load_config
    from rollout.server.llm.backend_pool import BackendPool
    from rollout.server.llm.scripted import ScriptedEngine
    from rollout.server.llm.smollm2 import smollm2_dir

    cfg = load_config(None, [f"server.port={port}", f"server.state_dir={state_dir}",
                             "server.dashboard_port=0", f"server.clients={json.dumps(CLIENTS)}",
                             "llm.backends=[]", "pipeline.init_workers=8",
                             "pipeline.run_workers=8", "pipeline.eval_workers=8"], environ={})

    async def run() -> None:
        tok: Any = AutoTokenizer.from_pretrained(str(smollm2_dir()))
        engine = ScriptedEngine(tok, lambda session, turn: f"Number {turn + 2}.",
                                end_of_turn_id=tok.convert_tokens_to_ids("<|im_end|>"))
        pool = BackendPool([engine], health_interval_s=0)
        await pool.start()
        registry = HandlerRegistry()
        register_bench_handlers(registry)
        registry.register("gw-good", GoodHarness())
        registry.register("gw-hostile", HostileHarness())
        server = await Server(cfg, registry=registry, llm=pool,
                              sandbox_factory=_no_sandbox).start()
        assert server.dashboard is not None
        print(f"PORT {server.port} {server.dashboard.port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop(0.5)
        await pool.close()

    asyncio.run(run())
    return 0


async def _no_sandbox(**options: Any) -> Any:
    raise RuntimeError("the hostile bench runs no sandboxes")


@dataclass
class Sample:
    rss_mb: float = 0.0
    fds: int = 0
    threads: list[asyncio.Task[Any]] = field(default_factory=list)


class ServerProcess:
    def __init__(self, state_dir: Path, port: int, log: Path) -> None:
        self.state_dir, self.port, self.log_path = state_dir, port, log
        self.proc: asyncio.subprocess.Process | None = None
        self.dashboard_port = 0
        self.peak = Sample()

    async def start(self) -> None:
        log = self.log_path.open("ab")
        for _ in range(50):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "rollout.benchmarks.hostile", "--serve",
                str(self.state_dir), "--port", str(self.port), stdout=asyncio.subprocess.PIPE,
                stderr=log)
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 120)
            if line.startswith(b"PORT"):
                self.proc = proc
                self.dashboard_port = int(line.split()[2])
                return
            await proc.wait()
            await asyncio.sleep(0.2)
        raise RuntimeError(f"the server did not start (see {self.log_path})")

    def sample(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            pid = self.proc.pid
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    self.peak.rss_mb = max(self.peak.rss_mb, int(line.split()[1]) / 1024)
            self.peak.fds = max(self.peak.fds, len(os.listdir(f"/proc/{pid}/fd")))

    def cpu_s(self) -> float:
        """CPU seconds the server process has used (user + system)."""
        if self.proc is None:
            return 0.0
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    async def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
            await self.proc.wait()
            self.proc = None

    async def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                await self.kill()
            self.proc = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------- hostile load


async def _unread_pages(port: int, count: int, held: list[asyncio.StreamWriter]) -> int:
    """Open live dashboard pages with the hostile token and never read them."""
    served = 0
    for _ in range(count):
        with contextlib.suppress(OSError, TimeoutError, asyncio.IncompleteReadError):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET /live/overview HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                         f"Authorization: Bearer {EVIL}\r\n\r\n".encode())
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            held.append(writer)
            served += head.startswith(b"HTTP/1.1 200")
    return served


async def _cut_clients(address: str, stop: asyncio.Event) -> int:
    """Sessions that submit work and drop their connection, over and over."""
    import grpc

    from rollout.v1 import rollout_service_pb2 as pb
    from rollout.v1 import rollout_service_pb2_grpc as pb_grpc

    cuts = 0
    while not stop.is_set():
        channel = grpc.aio.insecure_channel(address)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        queue.put_nowait(pb.StreamRolloutsRequest(open=pb.OpenSession(client_id="evil")))
        spec = {"job_id": f"cut-{cuts}", "environment": "sleep",
                "task": {"init_s": 0.01, "run_s": 0.05, "eval_s": 0.01}}
        from rollout.client.specs import job_spec

        queue.put_nowait(pb.StreamRolloutsRequest(submit=pb.SubmitJobs(jobs=[job_spec(spec)])))

        call = pb_grpc.RolloutServiceStub(channel).StreamRollouts(
            _requests(queue), metadata=[("authorization", f"Bearer {EVIL}")])
        with contextlib.suppress(Exception):
            async with asyncio.timeout(0.3):
                async for _ in call:
                    pass
        await channel.close(grace=None)  # cut, not closed
        cuts += 1
        await asyncio.sleep(0.2)
    return cuts


async def _requests(queue: asyncio.Queue[Any]) -> Any:
    while True:
        yield await queue.get()


# ----------------------------------------------------------------------------- one run


@dataclass
class RunResult:
    label: str
    jobs: int = 0
    succeeded: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    rss_mb: float = 0.0
    fds: int = 0
    log_bytes: int = 0
    cpu_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def pct(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))]


def _merged(a: RunResult, b: RunResult) -> RunResult:
    """Two baseline runs as one: their jobs, time, latencies and CPU added, peaks the larger."""
    return RunResult("baseline", jobs=a.jobs + b.jobs, succeeded=a.succeeded + b.succeeded,
                     seconds=a.seconds + b.seconds, latencies=a.latencies + b.latencies,
                     rss_mb=max(a.rss_mb, b.rss_mb), fds=max(a.fds, b.fds),
                     log_bytes=max(a.log_bytes, b.log_bytes), cpu_s=a.cpu_s + b.cpu_s,
                     notes=[f"baseline runs before and after the hostile one: "
                            f"{a.jobs / a.seconds:.2f} and {b.jobs / b.seconds:.2f} jobs/s"])


async def _run(args: argparse.Namespace, root: Path, hostile: bool,
               again: bool = False) -> RunResult:
    from rollout.client.aio import RolloutClient

    label = "with hostile tenant" if hostile else "baseline"
    state = root / ("hostile" if hostile else "baseline-2" if again else "baseline")
    log = root / f"{state.name}.log"
    server = ServerProcess(state, _free_port(), log)
    await server.start()
    address = f"127.0.0.1:{server.port}"
    result = RunResult(label)
    latency_file = root / f"{state.name}-latencies.jsonl"
    stop = asyncio.Event()
    held: list[asyncio.StreamWriter] = []
    background: list[asyncio.Task[Any]] = []

    async def sampler() -> None:
        while not stop.is_set():
            server.sample()
            await asyncio.sleep(0.2)

    background.append(asyncio.create_task(sampler()))
    async with RolloutClient(address, token=GOOD) as good, \
            RolloutClient(address, token=EVIL) as evil:
        await _finish(good, {"job_id": "warm-up", "environment": "gw-good",  # not timed
                             "task": {"calls": 2, "latency_file": str(root / "warm-up")}})
        if hostile:
            for i in range(args.hostile):
                background.append(asyncio.create_task(_drain(evil.submit_rollout({
                    "job_id": f"hostile-{i}", "environment": "gw-hostile",
                    "task": {"flood": args.flood, "seconds": 3600,
                             "mode": "giant" if i % 2 else "flood"},
                    "limits": {"run_timeout_s": 3600}}, progress=False))))
            background.append(asyncio.create_task(_cut_clients(address, stop)))
            served = await _unread_pages(server.dashboard_port, args.pages, held)
            floods, giants = (args.hostile + 1) // 2, args.hostile // 2
            result.notes.append(f"hostile: {floods} job(s) flooding their socket with "
                                f"{args.flood} half-sent requests each, {giants} job(s) "
                                "posting ~8 MiB chat bodies from 4 connections without "
                                f"pause, {served} of {args.pages} unread live pages served "
                                "(the per-identity cap), clients cutting their sessions")
            await asyncio.sleep(3.0)  # let the floods build up before timing
        t0, cpu0 = time.monotonic(), server.cpu_s()
        ids = [f"good-{i}" for i in range(args.jobs)]
        ends = await asyncio.gather(*(_finish(good, {
            "job_id": job_id, "environment": "gw-good",
            "task": {"calls": args.calls, "latency_file": str(latency_file)}}) for job_id in ids))
        result.seconds = time.monotonic() - t0
        result.cpu_s = server.cpu_s() - cpu0
        result.jobs = len(ids)
        result.succeeded = sum(1 for e in ends if e == "STATE_SUCCEEDED")
        if hostile:  # the good tenant's dashboard page is served beside the unread ones
            ok = await _dashboard_page(server.dashboard_port)
            result.notes.append(f"good tenant's live page beside them: {ok}")
    stop.set()
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    for w in held:
        w.close()
    if hostile:  # SIGKILL and restart on the same state: nothing of the good tenant is lost
        await server.kill()
        t1 = time.monotonic()
        await server.start()
        restart = time.monotonic() - t1
        async with RolloutClient(f"127.0.0.1:{server.port}", token=GOOD) as good:
            states = [(await good.get_job(i)).job.state for i in ids]
        kept = sum(1 for s in states if s == 3)  # job_pb2.Job.STATE_SUCCEEDED
        result.notes.append(f"after SIGKILL + restart ({restart:.1f} s): {kept}/{len(ids)} "
                            "good jobs SUCCEEDED")
    server.sample()
    await server.stop()
    result.rss_mb, result.fds = server.peak.rss_mb, server.peak.fds
    result.log_bytes = log.stat().st_size if log.exists() else 0
    if latency_file.exists():
        for line in latency_file.read_text().splitlines():
            result.latencies.extend(json.loads(line))
    return result


async def _drain(frames: Any) -> None:
    with contextlib.suppress(Exception):
        async for _ in frames:
            pass


async def _finish(client: Any, spec: dict[str, Any]) -> str:
    state = "?"
    async for frame in client.submit_rollout(spec, progress=False):
        if frame.WhichOneof("kind") == "finished":
            from rollout.v1 import job_pb2

            state = job_pb2.Job.State.Name(frame.finished.state)
    return state


async def _dashboard_page(port: int) -> str:
    with contextlib.suppress(Exception):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET /live/overview HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                     f"Authorization: Bearer {GOOD}\r\n\r\n".encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        first = await asyncio.wait_for(reader.readuntil(b"\n\n"), 10)
        writer.close()
        return "served" if head.startswith(b"HTTP/1.1 200") and b"parts" in first else \
            head.split(b"\r\n", 1)[0].decode()
    return "no answer"


def _table(base: RunResult, hostile: RunResult) -> str:
    def row(name: str, a: str, b: str, ratio: str = "") -> str:
        return f"| {name} | {a} | {b} | {ratio} |"

    jps_a, jps_b = base.jobs / base.seconds, hostile.jobs / hostile.seconds
    lines = ["| good tenant | baseline (two runs) | with hostile tenant | ratio |",
             "| --- | --- | --- | --- |",
             row("jobs SUCCEEDED", f"{base.succeeded}/{base.jobs}",
                 f"{hostile.succeeded}/{hostile.jobs}"),
             row("jobs/s", f"{jps_a:.2f}", f"{jps_b:.2f}", f"{jps_a / jps_b:.2f}x slower"),
             row("gateway p50 latency", f"{base.pct(0.5) * 1e3:.1f} ms",
                 f"{hostile.pct(0.5) * 1e3:.1f} ms", f"{hostile.pct(0.5) / base.pct(0.5):.2f}x"),
             row("gateway p99 latency", f"{base.pct(0.99) * 1e3:.1f} ms",
                 f"{hostile.pct(0.99) * 1e3:.1f} ms",
                 f"{hostile.pct(0.99) / base.pct(0.99):.2f}x"),
             row("server CPU while timed", f"{base.cpu_s:.1f} s", f"{hostile.cpu_s:.1f} s"),
             row("server peak RSS", f"{base.rss_mb:.0f} MB", f"{hostile.rss_mb:.0f} MB"),
             row("server peak open fds", str(base.fds), str(hostile.fds)),
             row("server log", f"{base.log_bytes / 1024:.1f} KiB",
                 f"{hostile.log_bytes / 1024:.1f} KiB")]
    return "\n".join(lines + [f"- {n}" for n in base.notes + hostile.notes])


async def _main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="rollout-hostile-") as tmp:
        root = Path(tmp)
        # Baseline on both sides of the hostile run: on a shared machine the load drifts.
        first = await _run(args, root, hostile=False)
        hostile = await _run(args, root, hostile=True)
        second = await _run(args, root, hostile=False, again=True)
        base = _merged(first, second)
        print(f"rollout bench hostile: {args.jobs} good jobs x {args.calls} gateway calls; "
              f"load average {os.getloadavg()[0]:.2f}")
        print(_table(base, hostile))
        ok = base.succeeded == base.jobs and hostile.succeeded == hostile.jobs
        return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollout bench hostile", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--jobs", type=int, default=120, help="good tenant's jobs per run")
    p.add_argument("--calls", type=int, default=8, help="gateway requests per good job")
    p.add_argument("--hostile", type=int, default=2,
                   help="hostile harness jobs (half flood connections, half post ~8 MiB bodies)")
    p.add_argument("--flood", type=int, default=2000,
                   help="half-sent connections each flooding job opens (and re-opens)")
    p.add_argument("--pages", type=int, default=30, help="unread live dashboard pages")
    p.add_argument("--serve", metavar="STATE_DIR", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return _serve(args.serve, args.port)
    return asyncio.run(_main(args))


if __name__ == "__main__":
    sys.exit(main())
