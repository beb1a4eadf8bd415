"""``rollout bench pipeline``: what the pipeline itself costs, and whether its stages overlap.

(a) Overhead. A real server process (loopback gRPC, SQLite store, ``noop`` environment) is
    driven by the async client: submit N jobs in batches over one ``StreamRollouts`` session,
    receive every trajectory, acknowledge it. Target: >= 2,500 jobs/s end to end on 2 cores,
    with the frames that are ready together written as one (``batch_frames``, the client's
    default); the row of an older client, one write per frame, is the baseline.
    The same again with stage progress on (6 events per job): coalesced into ``progress_batch``
    frames (what the client asks for by default; target: within 1.5x of progress off), and one
    frame per event as an older client gets it.
    Baseline, same run: the same scheduler and store in-process, without gRPC, which shows what
    the transport adds. Then 10,000 jobs are queued behind busy workers and the server's
    resident memory is read from /proc (target: < 300 MB). The server process never imports
    torch: it is started with no LLM backend.
(b) Overlap. The ``sleep`` environment sleeps per stage (default 40/60/20 ms) as if waiting on
    I/O. With equal pools of W workers, the bound is W / max(stage time); the target is >= 90 %
    of it. Baseline, same run: one "coupled" pool of 3W workers, each running the three stages
    back to back (bound 3W / sum(stage times)). With pure sleeps the coupled pool can be
    faster, because no stage's workers idle; what stage pools buy is isolation (a slow EVAL never
    holds a sandbox or an LLM slot) and per-resource sizing, shown by the "sized pools" row.

(d) With ``--dashboard N``: throughput with the web dashboard open on busy pages by N viewers
    against none open, in one run of one server; see ``pipeline_dashboard.py``.

(c) Worker processes, with ``--workers N[,M,...]`` instead of (a) and (b): the server's
    throughput with stage work in N local processes (``rollout serve --workers N``) against the
    single-process server in the same run, progress off and on, with the CPU of the server's
    whole process tree, on the ``noop`` or the CPU-bound ``cpu`` environment (``--env``); see
    ``pipeline_workers.py``.

Run: ``.venv/bin/rollout bench pipeline [--jobs 5000]``;
``.venv/bin/rollout bench pipeline --workers 1,2 --env cpu``;
``.venv/bin/rollout bench pipeline --dashboard 3``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rollout.benchmarks import pipeline_workers
from rollout.benchmarks.handlers import CPU_ITERS, SleepHandler, register_bench_handlers
from rollout.benchmarks.server_process import (
    BenchServer,
    baseline_tree,
    cpu_s,
    rss_mb,
    stream_jobs,
)
from rollout.runtime.handler import HandlerRegistry, JobContext
from rollout.runtime.types import JobSpec
from rollout.server.scheduler import JobFinished, PipelineConfig, Scheduler, TrajectoryReady
from rollout.server.store import JobStore

# ----------------------------------------------------------------------------- in-process


async def _inproc_run(n: int, env: str, task: dict[str, Any], cfg: PipelineConfig,
                      batch: int = 200) -> tuple[float, tuple[int, int]]:
    """Submit n jobs and consume + ack every delivery in-process; returns (seconds, writes)."""
    with tempfile.TemporaryDirectory() as tmp:
        registry = HandlerRegistry()
        register_bench_handlers(registry)
        store = JobStore(Path(tmp) / "jobs.sqlite3")
        await store.open()
        sched = Scheduler(store, registry, config=cfg)
        await sched.start()
        sub = await sched.attach("bench", progress=False)
        t0 = time.perf_counter()

        async def submit_all() -> None:
            for i in range(0, n, batch):
                specs = [JobSpec(job_id=f"j{k}", environment=env, task=task)
                         for k in range(i, min(n, i + batch))]
                await sched.submit(specs, "bench")

        submitter = asyncio.create_task(submit_all())
        done, acks = 0, []
        async for ev in sub:
            if isinstance(ev, TrajectoryReady):
                acks.append(ev.delivery_id)
                if len(acks) >= batch:
                    await sched.ack("bench", acks)
                    acks = []
            elif isinstance(ev, JobFinished):
                done += 1
                if done == n:
                    break
        if acks:
            await sched.ack("bench", acks)
        elapsed = time.perf_counter() - t0
        await submitter
        writes = store.write_stats
        await sched.stop(0)
        await store.close()
        return elapsed, writes


async def _coupled_run(n: int, workers: int, task: dict[str, Any]) -> float:
    """Baseline for (b): one pool whose workers run INIT, RUN and EVAL back to back."""
    handler = SleepHandler()
    queue: asyncio.Queue[JobSpec] = asyncio.Queue()
    for k in range(n):
        queue.put_nowait(JobSpec(job_id=f"c{k}", environment="sleep", task=task))

    async def worker() -> None:
        while not queue.empty():
            ctx = JobContext(spec=queue.get_nowait())
            await handler.init(ctx)
            ctx.outcome = await handler.run(ctx)
            await handler.eval(ctx)
            await ctx.resources.aclose()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- over gRPC


async def _grpc_run(n: int, queued: int) -> dict[str, float]:
    from rollout.client.aio import RolloutClient
    from rollout.v1 import job_pb2

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        async with BenchServer(tmp) as srv, RolloutClient(srv.address) as client:
            out["rss_idle_mb"] = rss_mb(srv.pid)
            # The server's first session pays for code paths run the first time: not a row's.
            await stream_jobs(client, min(n, 500), "warm-", progress=False)
            # Progress off and on, batched (what the client asks for by default) and one
            # write per frame (older clients), each on a fresh session (and job ids) of the
            # same server, so the rows share everything else.
            for key, progress, batched in (("off", False, True), ("unbatched", False, False),
                                           ("batched", True, True), ("single", True, False)):
                cpu0, client0 = cpu_s(srv.pid), time.process_time()
                res = await stream_jobs(client, n, key[:2], progress=progress,
                                        batch_progress=batched, batch_frames=batched)
                out[f"{key}_s"] = res.seconds
                out[f"{key}_cpu_ms"] = (cpu_s(srv.pid) - cpu0) / n * 1e3
                out[f"{key}_client_ms"] = (time.process_time() - client0) / n * 1e3
                out[f"{key}_frames"] = res.frames / n
                out[f"{key}_events"] = res.events / n
            out["rss_after_mb"] = rss_mb(srv.pid)

            # Memory with `queued` jobs waiting: 8 INIT workers sleep, the rest queue.
            hold = [job_pb2.JobSpec(job_id=f"q{k}", environment="sleep",
                                    task={"init_s": 3600}) for k in range(queued)]
            async with client.session("bench-hold", heartbeat_s=0) as session:
                for i in range(0, queued, 1000):
                    await session.submit(hold[i:i + 1000])
                answered = 0
                async for frame in session.events():
                    if frame.WhichOneof("kind") in ("accepted", "rejected"):
                        answered += 1
                        if answered == queued:
                            break
                status = await client.status()
                out["queued_seen"] = float(sum(
                    s.queue_depth for s in getattr(status, "stages", [])))
                out["rss_queued_mb"] = rss_mb(srv.pid)
                await session.aclose()
    return out


async def _before_after(n: int, ref: str, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """No-op jobs through a server running commit ``ref`` and one running this checkout,
    both up at once and driven alternately by the same client code, ``rounds`` sessions
    each: (jobs/s, server CPU ms per job) per session."""
    from rollout.client.aio import RolloutClient

    out: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        tree = await asyncio.to_thread(baseline_tree, ref, Path(tmp) / "baseline")
        async with BenchServer(Path(tmp) / "before", pythonpath=tree) as old, \
                BenchServer(Path(tmp) / "after") as new, \
                RolloutClient(old.address) as c_old, RolloutClient(new.address) as c_new:
            for key, client in (("before", c_old), ("after", c_new)):
                await stream_jobs(client, min(n, 500), f"warm-{key}-", progress=False)
            for r in range(rounds):
                for key, srv, client in (("before", old, c_old), ("after", new, c_new)):
                    cpu0 = cpu_s(srv.pid)
                    res = await stream_jobs(client, n, f"{key}{r}-", progress=False)
                    out[key].append((res.rate, (cpu_s(srv.pid) - cpu0) / n * 1e3))
    return out


def _load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


# ----------------------------------------------------------------------------- main


async def _bench(args: argparse.Namespace) -> int:
    console = Console(width=max(120, Console().width))
    ok = True
    if args.only in (None, "overhead"):
        g = await _grpc_run(args.jobs, args.queued)
        cfg = PipelineConfig(init_workers=8, run_workers=8, eval_workers=8)
        base_s, (txns, ops) = await _inproc_run(args.jobs, "noop", {}, cfg)
        t = Table(title=f"(a) overhead: {args.jobs} no-op jobs end to end (submit -> ack)")
        for col in ("path", "jobs/s", "target", "notes"):
            t.add_column(col)
        rate = args.jobs / g["off_s"]
        batched = args.jobs / g["batched_s"]
        ok &= rate >= 2500 and g["rss_queued_mb"] < 300 and rate / batched <= 1.5

        def notes(key: str) -> str:
            return (f"CPU ms/job: server {g[f'{key}_cpu_ms']:.2f}, client "
                    f"{g[f'{key}_client_ms']:.2f}; {g[f'{key}_frames']:.2f} frames/job "
                    f"({g[f'{key}_events']:.0f} progress events)")

        t.add_row("gRPC loopback + SQLite (server process)", f"{rate:,.0f}", ">= 2,500",
                  notes("off"))
        t.add_row("  same, one write per frame (older clients: no batch_frames)",
                  f"{args.jobs / g['unbatched_s']:,.0f}",
                  f"batched / this = {g['unbatched_s'] / g['off_s']:.2f}", notes("unbatched"))
        t.add_row("  same, stage progress on, batched", f"{batched:,.0f}",
                  f"off / on <= 1.5 (here {rate / batched:.2f})", notes("batched"))
        t.add_row("  same, stage progress on, one write per frame and event (older clients)",
                  f"{args.jobs / g['single_s']:,.0f}",
                  f"off / on = {g['single_s'] / g['off_s']:.2f}", notes("single"))
        t.add_row("baseline: in-process scheduler + SQLite", f"{args.jobs / base_s:,.0f}", "",
                  f"group commit: {ops / max(txns, 1):.0f} writes/transaction")
        console.print(t)
        m = Table(title="(a) server resident memory")
        for col in ("moment", "RSS MB", "target"):
            m.add_column(col)
        m.add_row("idle, after start", f"{g['rss_idle_mb']:.0f}", "")
        m.add_row(f"after {args.jobs} jobs", f"{g['rss_after_mb']:.0f}", "")
        m.add_row(f"{args.queued:,} jobs queued ({g['queued_seen']:.0f} waiting for INIT)",
                  f"{g['rss_queued_mb']:.0f}", "< 300")
        console.print(m)
    if args.baseline and args.only in (None, "overhead"):
        load0 = _load()
        ba = await _before_after(args.jobs, args.baseline, args.rounds)
        t = Table(title=f"(a) before / after: {args.jobs} no-op jobs per session over gRPC + "
                        f"SQLite, {args.rounds} sessions each, alternating, same run "
                        f"(load {load0} -> {_load()})")
        for col in ("server code", "jobs/s per session", "median", "server CPU ms/job (median)",
                    "target"):
            t.add_column(col)
        med: dict[str, float] = {}
        for key, label in (("before", f"before: commit {args.baseline}"),
                           ("after", "after: this checkout")):
            rates = sorted(r for r, _ in ba[key])
            cpus = sorted(c for _, c in ba[key])
            med[key] = rates[len(rates) // 2]
            t.add_row(label, ", ".join(f"{r:,.0f}" for r, _ in ba[key]), f"{med[key]:,.0f}",
                      f"{cpus[len(cpus) // 2]:.3f}", ">= 2,500" if key == "after" else "")
        console.print(t)
        console.print(f"after / before (median jobs/s): {med['after'] / med['before']:.2f}x")
        ok &= med["after"] >= 2500
    if args.only in (None, "overlap"):
        s_init, s_run, s_eval = (float(x) / 1000 for x in args.sleeps.split(","))
        task = {"init_s": s_init, "run_s": s_run, "eval_s": s_eval}
        w, n = args.pool_workers, args.overlap_jobs
        eq = PipelineConfig(init_workers=w, run_workers=w, eval_workers=w)
        eq_s, _ = await _inproc_run(n, "sleep", task, eq)
        coupled_s = await _coupled_run(n, 3 * w, task)
        total = 3 * w
        times = (s_init, s_run, s_eval)
        sized = [max(1, round(total * x / sum(times))) for x in times]
        sz = PipelineConfig(init_workers=sized[0], run_workers=sized[1], eval_workers=sized[2])
        sized_s, _ = await _inproc_run(n, "sleep", task, sz)
        bound_eq = w / max(times)
        bound_coupled = total / sum(times)
        bound_sized = min(k / x for k, x in zip(sized, times, strict=True))
        t = Table(title=f"(b) overlap: {n} jobs, stage sleeps {args.sleeps} ms, "
                        f"{total} workers in all (n-job bound: with the pipeline's fill and "
                        "drain)")
        for col in ("configuration", "jobs/s", "bound", "of bound", "n-job bound",
                    "of n-job bound"):
            t.add_column(col)
        eq_rate = n / eq_s
        ok &= eq_rate >= 0.9 * bound_eq
        rows = ((f"pipeline, equal pools {w}/{w}/{w}", eq_s, bound_eq, (w, w, w), times),
                (f"baseline: coupled pool of {total}", coupled_s, bound_coupled, (total,),
                 (sum(times),)),
                (f"pipeline, sized pools {sized[0]}/{sized[1]}/{sized[2]}", sized_s,
                 bound_sized, tuple(sized), times))
        for k, (name, secs, bound, pools, stage_s) in enumerate(rows):
            finite = n / _makespan(n, pools, stage_s)
            if k == 0:
                ok &= n / secs >= 0.95 * finite
            t.add_row(name, f"{n / secs:.1f}", f"{bound:.1f}", f"{n / secs / bound:.0%}"
                      + (" (≥ 90%)" if k == 0 else ""), f"{finite:.1f}",
                      f"{n / secs / finite:.0%}" + (" (≥ 95%)" if k == 0 else ""))
        console.print(t)
    console.print("[green]targets met[/green]" if ok else "[red]some targets missed[/red]")
    return 0


def _makespan(n: int, pools: tuple[int, ...], stage_s: tuple[float, ...]) -> float:
    """The shortest time ``n`` jobs can take through stages of ``pools`` workers each and
    ``stage_s`` seconds each: the busiest stage's ceil(n / workers) rounds, plus the other
    stages of its first job before it and of its last job after it (filling and draining the
    pipeline, which the steady-state bound leaves out)."""
    total = sum(stage_s)
    return max(-(-n // k) * x + total - x for k, x in zip(pools, stage_s, strict=True))


def _counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 0:
        raise argparse.ArgumentTypeError(
            f"--workers wants worker counts like 2 or 1,2,4 (0 = single process), got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollout bench pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, help="jobs for (a) (default 5000) or per --workers "
                   "session (default 2000 noop, 96 cpu)")
    p.add_argument("--queued", type=int, default=10_000, help="jobs held queued for the RSS check")
    p.add_argument("--overlap-jobs", type=int, default=400, help="sleep jobs for (b)")
    p.add_argument("--pool-workers", type=int, default=8, help="workers per stage pool in (b)")
    p.add_argument("--sleeps", default="40,60,20", help="INIT,RUN,EVAL sleep in ms for (b)")
    p.add_argument("--only", choices=("overhead", "overlap"))
    p.add_argument("--baseline", metavar="GIT_REF",
                   help="also run (a) on a server running commit GIT_REF of this checkout "
                        "(git archive, nothing checked out) beside one running this checkout, "
                        "alternating sessions, one table")
    p.add_argument("--rounds", type=int, default=3,
                   help="with --baseline: sessions per server (default 3)")
    p.add_argument("--workers", type=_counts, metavar="N[,M,...]",
                   help="instead of (a) and (b): servers with stage work in N, M, ... local "
                        "processes (rollout serve --workers) against the single-process "
                        "server (0, always measured), one table")
    p.add_argument("--env", choices=pipeline_workers.ENVS, default="noop",
                   help="with --workers: the environment (default noop)")
    p.add_argument("--iters", type=int, default=CPU_ITERS,
                   help="with --env cpu: pure-Python steps per stage")
    p.add_argument("--slots", type=int, default=8,
                   help="with --workers: jobs one worker process holds at once")
    p.add_argument("--profile", metavar="DIR",
                   help="with --workers: write each server's cProfile stats into DIR")
    p.add_argument("--dashboard", type=int, metavar="VIEWERS",
                   help="instead of (a) and (b): throughput with the web dashboard open on "
                        "busy pages by VIEWERS viewers against none open, same server, one "
                        "table (pipeline_dashboard.py)")
    args = p.parse_args(argv)
    if args.dashboard is not None:
        if args.dashboard < 1:
            p.error("--dashboard wants a number of viewers >= 1")
        from rollout.benchmarks import pipeline_dashboard

        return pipeline_dashboard.main(args.jobs or 2000, args.dashboard)
    if args.workers is not None:
        return pipeline_workers.run(args.workers, args.env, args.jobs, args.iters, args.slots,
                                    args.profile)
    for flag in ("env", "profile"):
        if getattr(args, flag) != p.get_default(flag):
            p.error(f"--{flag} applies only with --workers")
    args.jobs = args.jobs or 5000
    return asyncio.run(_bench(args))


if __name__ == "__main__":
    sys.exit(main())
