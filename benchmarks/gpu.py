"""``python -m rollout.benchmarks.gpu``: an engine behind the service against the same engine
called directly, for a lent GPU machine (``benchmarks/gpu_run.sh`` installs, checks, runs it).

Both sides run the same multi-turn session loop (:func:`session`): turn k's prompt is turn
k-1's prompt + its output + a fixed observation, as an agent's turns are. *Direct*: the
driver calls the engine itself (``Engine.generate``), ``C`` sessions at once. *Service*: a
real server process (loopback gRPC, SQLite store, the backend pool, ``C`` RUN workers) runs
the same loop as the RUN stage of ``C`` jobs of the ``gpu-turns`` environment, submitted over
one ``StreamRollouts`` session. Per concurrency: output tokens/s over the wall time and p50 /
p99 of one turn's latency (the engine call as the loop sees it), and trajectories per
GPU-hour (every job that finished with its turns done counts as accepted here).

``--dry-run``: the same driver on the CPU with the scripted backend (a testing engine that
replays fixed text after ``--latency-ms``, tokenized byte by byte): it shows that everything
but the model works, in seconds, with no GPU and no weights. Real runs name a vLLM server
(``--vllm-url``, ``--model``, ``--tokenizer``): both sides then talk to that one engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.runtime.handler import AgentHandler, HandlerRegistry, JobContext, RunOutcome
from rollout.runtime.llm import GenerateRequest, GenerateResult
from rollout.runtime.types import Reward, SamplingParams, TerminationReason, Turn

OBSERVATION = list(range(300, 332))
"""The tool result appended after every turn's output (32 tokens)."""
Generate = Callable[[GenerateRequest], Awaitable[GenerateResult]]


@dataclass
class SessionResult:
    output_tokens: int = 0
    turn_ms: list[float] = field(default_factory=list)


async def session(generate: Generate, session_id: str, turns: int, prompt_len: int,
                  max_tokens: int) -> SessionResult:
    """One multi-turn session: the loop both sides run, so they differ only in the path."""
    out = SessionResult()
    prompt = [100 + (i % 200) for i in range(prompt_len)]
    sampling = SamplingParams(temperature=1.0, max_tokens_per_turn=max_tokens)
    for k in range(turns):
        t = time.perf_counter()
        res = await generate(GenerateRequest(prompt_ids=list(prompt), sampling=sampling,
                                             max_tokens=max_tokens, session_id=session_id,
                                             seed=k))
        out.turn_ms.append((time.perf_counter() - t) * 1e3)
        out.output_tokens += len(res.output_ids)
        prompt += list(res.output_ids) + OBSERVATION
    return out


class TurnsHandler(AgentHandler):
    """``gpu-turns``: RUN is :func:`session` against the server's backend pool; the turn
    latencies go back in the trajectory's metadata."""

    name = "gpu-turns"

    async def init(self, ctx: JobContext) -> None:
        return None

    async def run(self, ctx: JobContext) -> RunOutcome:
        assert ctx.llm is not None, "the gpu-turns environment needs an LLM backend"
        task = ctx.spec.task
        res = await session(ctx.llm.generate, ctx.spec.job_id, int(task["turns"]),
                            int(task["prompt_len"]), int(task["max_tokens"]))
        with contextlib.suppress(Exception):
            await ctx.llm.end_session(ctx.spec.job_id)
        return RunOutcome(
            turns=[Turn(prompt_ids=[1], output_ids=[2], output_logprobs=[0.0])],
            termination=TerminationReason.NO_TOOL_CALL,
            metadata={"turn_ms": ",".join(f"{x:.3f}" for x in res.turn_ms),
                      "output_tokens": str(res.output_tokens)})

    async def eval(self, ctx: JobContext) -> Reward:
        return Reward(1.0)


# ----------------------------------------------------------------------------- engines


class ByteTokenizer:
    """The dry run's tokenizer: one id per byte (the scripted engine only encodes text)."""

    eos_token_id = 2

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + b for b in text.encode()]


async def make_engine(args: argparse.Namespace) -> Any:
    if args.dry_run:
        from rollout.server.llm.scripted import ScriptedEngine

        reply = "x" * max(1, args.max_tokens - 1)  # + end of turn = max_tokens tokens
        return ScriptedEngine(ByteTokenizer(), lambda sid, k: reply,
                              latency_s=args.latency_ms / 1e3)
    from rollout.server.llm.factory import build_engine

    engine, _ = await build_engine({"kind": "vllm", "url": args.vllm_url, "model": args.model,
                                    "tokenizer": args.tokenizer or args.model,
                                    "protocol": args.protocol}, 0)
    return engine


# ----------------------------------------------------------------------------- the two paths


@dataclass
class Row:
    path: str
    concurrency: int
    sessions: int
    turns: int
    wall_s: float
    output_tokens: int
    turn_ms: list[float]
    finished: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def pct(self, q: float) -> float:
        s = sorted(self.turn_ms)
        return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else 0.0

    def summary(self, gpus: int) -> dict[str, Any]:
        return {"path": self.path, "concurrency": self.concurrency, "sessions": self.sessions,
                "turns": self.turns, "wall_s": round(self.wall_s, 4),
                "output_tokens": self.output_tokens,
                "tokens_per_s": round(self.tokens_per_s, 1),
                "turn_p50_ms": round(statistics.median(self.turn_ms), 3),
                "turn_p99_ms": round(self.pct(0.99), 3), "finished": self.finished,
                "trajectories_per_gpu_hour": round(
                    self.finished / (self.wall_s / 3600) / max(gpus, 1))}


async def run_direct(engine: Any, c: int, args: argparse.Namespace) -> Row:
    t = time.perf_counter()
    results = await asyncio.gather(*(
        session(engine.generate, f"direct-{c}-{i}", args.turns, args.prompt_len,
                args.max_tokens) for i in range(c)))
    wall = time.perf_counter() - t
    for i in range(c):
        with contextlib.suppress(Exception):
            await engine.release_session(f"direct-{c}-{i}")
    return Row("direct", c, c, args.turns, wall, sum(r.output_tokens for r in results),
               [x for r in results for x in r.turn_ms], c)


async def run_service(address: str, c: int, args: argparse.Namespace) -> Row:
    from google.protobuf import struct_pb2

    from rollout.client.aio import RolloutClient
    from rollout.v1 import job_pb2

    specs = []
    for i in range(c):
        task = struct_pb2.Struct()
        task.update({"turns": args.turns, "prompt_len": args.prompt_len,
                     "max_tokens": args.max_tokens})
        specs.append(job_pb2.JobSpec(job_id=f"svc-{c}-{i}-{os.getpid()}",
                                     environment="gpu-turns", task=task))
    tokens, turn_ms, finished = 0, [], 0
    async with RolloutClient(address) as client, client.session(
            f"gpu-bench-{c}-{os.getpid()}", progress=False, heartbeat_s=0) as s:
        t = time.perf_counter()
        await s.submit(specs)
        done = 0
        async for frame in s.events():
            kind = frame.WhichOneof("kind")
            if kind == "trajectory":
                meta = frame.trajectory.trajectory.metadata
                if "turn_ms" in meta:
                    turn_ms += [float(x) for x in meta["turn_ms"].split(",") if x]
                    tokens += int(meta["output_tokens"])
                await s.ack([frame.trajectory.delivery_id])
            elif kind == "finished":
                done += 1
                finished += frame.finished.state == job_pb2.Job.STATE_SUCCEEDED
                if done == c:
                    break
            elif kind == "rejected":
                raise RuntimeError(f"job rejected: {frame.rejected}")
        wall = time.perf_counter() - t
        await s.aclose()
    return Row("service", c, c, args.turns, wall, tokens, turn_ms, finished)


class ServiceProcess:
    """The server in its own process (``serve`` below), as a deployment runs it."""

    def __init__(self, args: argparse.Namespace, state_dir: str, workers: int) -> None:
        self.argv = [sys.executable, "-m", "rollout.benchmarks.gpu", "serve", state_dir,
                     "--workers", str(workers), *_engine_flags(args)]
        self.proc: asyncio.subprocess.Process | None = None
        self.address = ""

    async def __aenter__(self) -> ServiceProcess:
        self.proc = await asyncio.create_subprocess_exec(*self.argv,
                                                         stdout=asyncio.subprocess.PIPE)
        assert self.proc.stdout is not None
        async with asyncio.timeout(300):
            line = (await self.proc.stdout.readline()).decode().split()
        if not line or line[0] != "PORT":
            raise RuntimeError("the benchmark server did not start")
        self.address = f"127.0.0.1:{line[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                async with asyncio.timeout(60):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def _engine_flags(args: argparse.Namespace) -> list[str]:
    if args.dry_run:
        return ["--dry-run", "--max-tokens", str(args.max_tokens),
                "--latency-ms", str(args.latency_ms)]
    return ["--vllm-url", args.vllm_url, "--model", args.model,
            "--tokenizer", args.tokenizer or args.model, "--protocol", args.protocol]


async def serve(args: argparse.Namespace) -> int:
    """The child: a production server with the ``gpu-turns`` environment and this engine."""
    from rollout.server.app import Server
    from rollout.server.config import Config
    from rollout.server.llm.backend_pool import BackendPool

    cfg = Config()
    cfg.server.port = 0
    cfg.server.state_dir = args.state_dir
    cfg.server.heartbeat_s = 0
    cfg.llm.backends = []
    cfg.pipeline.init_workers = cfg.pipeline.eval_workers = 8
    cfg.pipeline.run_workers = args.workers
    registry = HandlerRegistry()
    registry.register("gpu-turns", TurnsHandler())
    pool = BackendPool()
    pool.add(await make_engine(args))
    await pool.start()

    async def no_sandbox(**_: Any) -> Any:
        raise RuntimeError("gpu-turns needs no sandbox")

    server = await Server(cfg, registry=registry, llm=pool, sandbox_factory=no_sandbox).start()
    print("PORT", server.port, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)
    await pool.close()
    return 0


# ----------------------------------------------------------------------------- driver


async def check(args: argparse.Namespace) -> int:
    """Seconds, not minutes: the engine answers one turn directly and through the service."""
    t = time.perf_counter()
    engine = await make_engine(args)
    try:
        res = await session(engine.generate, "check", 1, 8, 4)
        assert res.output_tokens > 0, "the engine returned no tokens"
    finally:
        with contextlib.suppress(Exception):
            await engine.close()
    with tempfile.TemporaryDirectory() as tmp:
        async with ServiceProcess(args, tmp, 2) as srv:
            row = await run_service(srv.address, 2, argparse.Namespace(
                turns=1, prompt_len=8, max_tokens=4))
    assert row.finished == 2 and row.output_tokens > 0, row
    print(f"check passed in {time.perf_counter() - t:.1f} s: the engine answers directly and "
          "through the service", flush=True)
    return 0


async def bench(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    warm = argparse.Namespace(**{**vars(args), "turns": 1})
    engine = await make_engine(args)
    try:
        await run_direct(engine, 2, warm)  # connections, the engine's first batches
        for c in args.concurrency:
            rows.append(await run_direct(engine, c, args))
            print(json.dumps(rows[-1].summary(args.gpus)), flush=True)
    finally:
        with contextlib.suppress(Exception):
            await engine.close()
    with tempfile.TemporaryDirectory() as tmp:
        async with ServiceProcess(args, tmp, max(args.concurrency)) as srv:
            await run_service(srv.address, 2, warm)
            for c in args.concurrency:
                rows.append(await run_service(srv.address, c, args))
                print(json.dumps(rows[-1].summary(args.gpus)), flush=True)
    return rows


def render(rows: list[Row], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    what = ("dry run: scripted backend on the CPU, "
            f"{args.latency_ms:g} ms per turn" if args.dry_run else f"vLLM {args.model}")
    t = Table(title=f"rollout bench gpu ({what}; {args.turns} turns per session, "
                    f"{args.prompt_len}-token prompt, {args.max_tokens} tokens per turn)")
    for col in ("concurrent sessions", "path", "tokens/s", "turn p50 ms", "turn p99 ms",
                "service / direct tokens/s", "trajectories per GPU-hour"):
        t.add_column(col, justify="right")
    direct = {r.concurrency: r for r in rows if r.path == "direct"}
    for r in sorted(rows, key=lambda r: (r.concurrency, r.path)):
        s = r.summary(args.gpus)
        ratio = (f"{r.tokens_per_s / direct[r.concurrency].tokens_per_s:.2f}"
                 if r.path == "service" and r.concurrency in direct else "")
        t.add_row(str(r.concurrency), "direct (baseline)" if r.path == "direct" else
                  "behind the service", f"{s['tokens_per_s']:,.0f}",
                  f"{s['turn_p50_ms']:.2f}", f"{s['turn_p99_ms']:.2f}", ratio,
                  f"{s['trajectories_per_gpu_hour']:,}" if r.path == "service" else "")
    Console(width=150).print(t)


def _counts(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rollout.benchmarks.gpu",
                                description=__doc__.split("\n\n")[0] if __doc__ else "")
    p.add_argument("mode", nargs="?", default="bench", choices=("bench", "check", "serve"))
    p.add_argument("state_dir", nargs="?", default="", help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true",
                   help="the scripted backend on the CPU instead of a vLLM server")
    p.add_argument("--vllm-url", default="http://127.0.0.1:8001")
    p.add_argument("--model", default="", help="the model name the vLLM server serves")
    p.add_argument("--tokenizer", default="", help="tokenizer directory (default: --model)")
    p.add_argument("--protocol", choices=("completions", "generate"), default="completions",
                   help="how the HTTP engine talks to vLLM (generate: vLLM >= 0.14 started "
                        "with --enable-scale-out)")
    p.add_argument("--concurrency", type=_counts, default=[64, 256])
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--latency-ms", type=float, default=20.0,
                   help="dry run: the scripted engine's time per turn")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--workers", type=int, default=256, help=argparse.SUPPRESS)
    p.add_argument("--json", metavar="FILE", help="also write the rows here")
    args = p.parse_args(argv)
    if not args.dry_run and not args.model:
        p.error("name the served model with --model (or use --dry-run)")
    if args.mode == "serve":
        return asyncio.run(serve(args))
    if args.mode == "check":
        return asyncio.run(check(args))
    rows = asyncio.run(bench(args))
    render(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"dry_run": args.dry_run, "model": args.model, "args": {
                k: v for k, v in vars(args).items() if k not in ("mode", "state_dir")},
             "rows": [r.summary(args.gpus) for r in rows],
             "load_average": os.getloadavg()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
