"""``rollout bench pipeline --workers N[,M,...]``: the server's throughput with stage work in N
local processes (``rollout serve --workers N``) against the single-process server.

For each worker count (and always 0, the single-process server, as the baseline of the same
run) a fresh server process is started (``server_process.BenchServer``; with N > 0 it starts N node
agents on a private local Ray and announces its port only once all have joined, so no row
times their start). A short warm-up session runs first; then the same ``--jobs`` jobs of one
environment go through one ``StreamRollouts`` session with stage progress off, and again with
progress on (coalesced into ``progress_batch`` frames, what the client asks for by default).

Environments (``--env``):
- ``noop``: stages return at once. What is left is the server's own work per job (gRPC front,
  scheduler, SQLite store, and with N > 0 one Ray call per stage and per release), all of it in
  the server process, so extra processes cannot help and the Ray hops cost.
- ``cpu``: each stage does ``--iters`` steps of pure-Python work (``handlers.CpuHandler``).
  In the single-process server that work shares one core and one GIL with the front; with
  N > 0 it runs in the agents, so up to min(N, cores) of it proceeds at once.

Columns: jobs/s with progress off and on; on/off; speed-up against the baseline's jobs/s (off,
on); CPU of the server's whole process tree (front, Ray's GCS and raylet, agents) as percent
of one core, and of the front process alone in ms per job; the mean time a job spent inside
its three stages and queued before them (the trajectories' ``StageTimings``, measured by the
server); and whether every job finished exactly once with reward 1.0. A second table names
the processes. ``--profile DIR`` writes each server's cProfile stats (front process) there.
Exit status 1 when any job did not finish exactly once or got a reward other than 1.0.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rollout.benchmarks.handlers import CPU_ITERS
from rollout.benchmarks.server_process import (
    BenchServer,
    StreamResult,
    cpu_s,
    job_ids,
    machine_busy_s,
    stream_jobs,
    thread_cpu_s,
    tree_cpu_s,
)

ENVS = ("noop", "cpu")
DEFAULT_JOBS = {"noop": 2000, "cpu": 96}
"""Jobs per measured session when ``--jobs`` is not given (a few seconds each on 2 cores)."""


@dataclass
class Mode:
    """One session (progress off or on) against one server."""

    result: StreamResult
    ids: list[str]
    tree_cpu_s: float
    front_cpu_s: float
    others_s: float = 0.0
    """CPU the rest of the machine (not the server's tree, not this benchmark) used meanwhile:
    the shared machine's other load."""
    front_threads_s: dict[str, float] = field(default_factory=dict)
    """The front process's CPU during the session per thread name (threads that started
    during it count from zero)."""

    @property
    def ok(self) -> bool:
        return self.result.exactly_once(self.ids) and self.result.reward_one == len(self.ids)


@dataclass
class WorkersRow:
    workers: int
    off: Mode
    on: Mode
    processes: int
    """Processes in the server's tree while it served (front, Ray's own, agents)."""
    rss_mb: float

    @property
    def ok(self) -> bool:
        return self.off.ok and self.on.ok


async def _measure(srv: BenchServer, client: Any, n: int, prefix: str, progress: bool,
                   env: str, task: dict[str, Any]) -> Mode:
    tree0, _ = tree_cpu_s(srv.pid)
    front0, threads0 = cpu_s(srv.pid), thread_cpu_s(srv.pid)
    busy0, own0 = machine_busy_s(), time.process_time()
    res = await stream_jobs(client, n, prefix, progress, environment=env, task=task)
    tree1, _ = tree_cpu_s(srv.pid)
    others = machine_busy_s() - busy0 - (time.process_time() - own0) - (tree1 - tree0)
    threads = {name: secs - threads0.get(name, 0.0)
               for name, secs in thread_cpu_s(srv.pid).items()}
    return Mode(res, job_ids(prefix, n), tree1 - tree0, cpu_s(srv.pid) - front0,
                max(0.0, others), threads)


async def measure_workers(counts: list[int], env: str, jobs: int, *, iters: int = CPU_ITERS,
                          slots: int = 8, warmup: int = 0, profile_dir: str | None = None,
                          console: Console | None = None) -> list[WorkersRow]:
    """One row per worker count (0 first, added when missing), each on a fresh server."""
    from rollout.benchmarks.server_process import rss_mb
    from rollout.client.aio import RolloutClient

    task: dict[str, Any] = {"iters": iters} if env == "cpu" else {}
    rows: list[WorkersRow] = []
    for workers in sorted({0, *counts}):
        with tempfile.TemporaryDirectory(prefix="rollout-bench-workers-") as tmp:
            profile = (os.path.join(profile_dir, f"server-{env}-workers{workers}.prof")
                       if profile_dir else None)
            if console is not None:
                console.print(f"workers={workers}: starting the server"
                              + (f" and {workers} node agents" if workers else "") + " …")
            # The stage pools never limit with agents: their slots (N x slots) do.
            async with BenchServer(tmp, workers=workers, slots=slots,
                                   stage_workers=slots * max(1, workers),
                                   profile=profile) as srv, \
                    RolloutClient(srv.address) as client:
                if warmup:
                    await stream_jobs(client, warmup, "w", False, environment=env, task=task)
                off = await _measure(srv, client, jobs, "off", False, env, task)
                on = await _measure(srv, client, jobs, "on", True, env, task)
                _, processes = tree_cpu_s(srv.pid)
                rows.append(WorkersRow(workers, off, on, processes, rss_mb(srv.pid)))
    return rows


def render(rows: list[WorkersRow], env: str, jobs: int, iters: int, slots: int,
           console: Console) -> None:
    base = next(r for r in rows if r.workers == 0)
    what = (f"cpu: {iters:,} pure-Python steps per stage" if env == "cpu"
            else "noop: stages return at once")
    cores = os.cpu_count() or 1
    t = Table(title=f"rollout bench pipeline --workers: {jobs} jobs per row, env {what}, "
                    f"{slots} slots per worker; {cores} cores, load {os.getloadavg()[0]:.2f}")
    for col in ("workers", "jobs/s off", "jobs/s on", "on/off", "speed-up off/on",
                "CPU % off/on", "CPU ms/job front/rest", "in stages/queued ms", "exactly once"):
        t.add_column(col, justify="left" if col == "workers" else "right")
    for r in rows:
        off, on = r.off.result, r.on.result
        in_stages = sum(off.stage_s[k] for k in ("init", "run", "eval")) / jobs * 1e3
        queued = sum(off.stage_s[k] for k in ("init_queue", "run_queue", "eval_queue")) \
            / jobs * 1e3
        t.add_row(
            f"{r.workers} (baseline)" if r.workers == 0 else str(r.workers),
            f"{off.rate:,.1f}", f"{on.rate:,.1f}", f"{on.rate / off.rate:.2f}",
            f"{off.rate / base.off.result.rate:.2f}x / {on.rate / base.on.result.rate:.2f}x",
            f"{100 * r.off.tree_cpu_s / off.seconds:.0f} / "
            f"{100 * r.on.tree_cpu_s / on.seconds:.0f}",
            f"{r.off.front_cpu_s / jobs * 1e3:.1f} / "
            f"{(r.off.tree_cpu_s - r.off.front_cpu_s) / jobs * 1e3:.1f}",
            f"{in_stages:.1f} / {queued:.1f}",
            "yes" if r.ok else _why(r))
    console.print(t)
    p = Table(title="server processes; the front process's CPU per job by thread (progress off)")
    p.add_column("workers")
    for col in ("processes", "front RSS MB", "RUN ran in (pids)", "others' CPU % off/on"):
        p.add_column(col, justify="right")
    p.add_column("front CPU ms/job: main thread (event loop) | busiest other threads")
    for r in rows:
        pids = r.off.result.pids | r.on.result.pids
        threads = dict(r.off.front_threads_s)
        main = threads.pop("main thread", 0.0)
        others = sorted(threads.items(), key=lambda kv: -kv[1])[:4]
        split = f"{main / jobs * 1e3:.2f} | " + ", ".join(
            f"{name} {secs / jobs * 1e3:.2f}" for name, secs in others if secs > 0)
        p.add_row(str(r.workers), str(r.processes), f"{r.rss_mb:.0f}",
                  str(len(pids)) if pids else "-",
                  f"{100 * r.off.others_s / r.off.result.seconds:.0f} / "
                  f"{100 * r.on.others_s / r.on.result.seconds:.0f}", split)
    console.print(p)
    console.print(
        "workers 0 = the single-process server; N = stage work in N node-agent processes. "
        "off/on: stage progress off / on (batched frames). CPU %: the server's whole process "
        "tree, 100 = one core busy. CPU ms/job (progress off): the server (front) process, and "
        "the rest of its tree (agents, Ray's GCS and raylet). in stages / queued: a job's "
        "mean time inside INIT+RUN+EVAL and queued before them (server's StageTimings, "
        "progress off). exactly once: every job finished once, one trajectory, "
        "reward 1.0, in both sessions. others' CPU %: what the rest of the machine (other "
        "users) kept busy meanwhile, 100 = one core. Thread names are the kernel's: "
        "'python' = Python threads (the store's writer; with Ray also Ray's Python-side "
        "threads), the others are Ray's and gRPC's C++ threads.")


def _why(row: WorkersRow) -> str:
    parts = []
    for mode in (row.off, row.on):
        res = mode.result
        lost = sum(1 for j in mode.ids if res.finished[j] == 0)
        dup = sum(max(0, c - 1) for c in res.finished.values())
        parts.append(f"NO: {lost} lost, {dup} duplicated, "
                     f"{len(mode.ids) - res.reward_one} reward != 1")
    return " | ".join(parts)


def run(counts: list[int], env: str, jobs: int | None, iters: int, slots: int,
        profile_dir: str | None) -> int:
    console = Console(width=max(Console().width, 140))
    n = jobs or DEFAULT_JOBS[env]
    if profile_dir:
        Path(profile_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = asyncio.run(measure_workers(counts, env, n, iters=iters, slots=slots,
                                       warmup=min(n, 4 * slots), profile_dir=profile_dir,
                                       console=console))
    render(rows, env, n, iters, slots, console)
    console.print(f"({time.perf_counter() - t0:.0f} s in all)")
    if profile_dir:
        console.print(f"cProfile stats of each server's front process: {profile_dir} (the "
                      "front ran under cProfile: its rates above are lower than without)")
    bad = [r.workers for r in rows if not r.ok]
    if bad:
        console.print(f"[red]jobs not finished exactly once with reward 1 at workers={bad}[/red]")
    return 1 if bad else 0
