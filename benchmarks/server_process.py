"""A benchmark's server in its own process, and the client side that drives it.

``BenchServer`` starts ``python -m rollout.benchmarks.server_process STATE_DIR`` (a real server:
loopback gRPC, SQLite store, the bench environments, no LLM backend, so the process never
imports torch), optionally with ``--workers N`` (stage work in N node agents on a private
local Ray, as ``rollout serve --workers N``) and under cProfile. ``stream_jobs`` drives it
through one ``StreamRollouts`` session and counts what came back per job, so a benchmark can
say that every job finished exactly once. CPU is read from /proc for the server process and
for all its descendants (Ray's GCS, raylet and node-agent processes with ``--workers``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STAGE_TIMINGS = ("init_queue", "init", "run_queue", "run", "eval_queue", "eval")
"""The ``StageTimings`` fields of a trajectory, in order."""


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _stat(pid: int) -> list[str]:
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of one process's live threads, summed per thread name (the event loop runs
    in ``MainThread``'s kernel name, the process name; Ray's and gRPC's C++ threads have
    their own names)."""
    out: dict[str, float] = {}
    tck = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            name = raw[raw.index("(") + 1:raw.rindex(")")]
            name = "main thread" if tid == str(pid) else name.rstrip("0123456789_-.")
            fields = raw.rsplit(")", 1)[1].split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tck
    return out


def machine_busy_s() -> float:
    """CPU seconds all cores of this machine spent running its own processes since boot (not
    idle, not iowait, not stolen by the hypervisor)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4] - fields[7]) / os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """``pid`` and every live descendant."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                children.setdefault(int(_stat(int(entry))[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def tree_cpu_s(pid: int) -> tuple[float, int]:
    """CPU seconds of ``pid`` and its live descendants together, and how many processes that
    is. (A descendant that exited between two readings takes its CPU with it; Ray's processes
    live as long as the server.)"""
    total, count = 0.0, 0
    for p in tree(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += cpu_s(p)
            count += 1
    return total, count


class BenchServer:
    """``async with BenchServer(tmp, workers=2) as srv:`` … ``srv.address``, ``srv.pid``."""

    def __init__(self, state_dir: str | Path, *, workers: int = 0, slots: int = 8,
                 stage_workers: int = 8, profile: str | Path | None = None,
                 start_timeout_s: float = 240.0, dashboard: bool = False,
                 pythonpath: str | Path | None = None) -> None:
        self.state_dir = str(state_dir)
        self.dashboard = dashboard
        self.dashboard_port = 0
        self.workers = workers
        self.slots = slots
        self.stage_workers = stage_workers
        self.profile = profile
        self.start_timeout_s = start_timeout_s
        self.pythonpath = pythonpath
        """A tree whose ``rollout`` package is another checkout's (``baseline_tree``): the
        server runs that code, e.g. the commit before a change, in the same run."""
        self.proc: asyncio.subprocess.Process | None = None
        self.port = 0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def __aenter__(self) -> BenchServer:
        from rollout.server.cluster.local_cluster import LocalRayCluster

        args = [sys.executable, "-m", "rollout.benchmarks.server_process", self.state_dir,
                "--workers", str(self.workers), "--slots", str(self.slots),
                "--stage-workers", str(self.stage_workers)]
        if self.profile:
            args += ["--profile", str(self.profile)]
        if self.dashboard:
            args.append("--dashboard")
        # Ray (--workers) turns token authentication on by default; this private instance
        # listens on loopback only, as the cluster tests' does.
        env = {**os.environ, **LocalRayCluster.DRIVER_ENV, "RAY_USAGE_STATS_ENABLED": "0"}
        if self.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(
                [str(self.pythonpath), *filter(None, [os.environ.get("PYTHONPATH")])])
        self.proc = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.PIPE, env=env)
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(self.start_timeout_s):
                line = (await self.proc.stdout.readline()).decode().split()
        except BaseException:
            await self.stop()
            raise
        if not line or line[0] != "PORT":
            await self.stop()
            raise RuntimeError(f"bench server (workers={self.workers}) did not start")
        self.port = int(line[1])
        if len(line) > 2:
            self.dashboard_port = int(line[2])
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(60):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()


PACKAGES = ("client", "entrypoints", "benchmarks", "server", "runtime", "trainer_adapters")
"""Top folders of a checkout that the install maps to ``rollout.<name>``."""


def baseline_tree(ref: str, into: Path) -> Path:
    """The code of git commit ``ref`` of this checkout, unpacked below ``into`` (``git
    archive``: no worktree, no branch touched), with a ``rollout`` package of links laid out
    as the install maps it; put the returned path first on PYTHONPATH to run that code."""
    import io
    import subprocess
    import tarfile

    repo = Path(__file__).resolve().parents[1]
    # Only what runs: other folders may hold links that the safe extraction refuses.
    blob = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", ref, "--",
                           *PACKAGES, "proto"], capture_output=True, check=True).stdout
    src = into / "src"
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(src, filter="data")
    tree_ = into / "tree"
    (tree_ / "rollout").mkdir(parents=True)
    for pkg in PACKAGES:
        (tree_ / "rollout" / pkg).symlink_to(src / pkg)
    (tree_ / "rollout" / "v1").symlink_to(src / "proto" / "rollout" / "v1")
    (tree_ / "rollout" / "__init__.py").symlink_to(src / "proto" / "rollout" / "__init__.py")
    return tree_


@dataclass
class StreamResult:
    """What one session of ``n`` jobs measured and received."""

    jobs: int
    seconds: float = 0.0
    frames: int = 0
    """Response frames on the wire."""
    events: int = 0
    """Progress events seen (a batched frame counts once per event)."""
    finished: Counter[str] = field(default_factory=Counter)
    """``finished`` frames per job id."""
    trajectories: Counter[str] = field(default_factory=Counter)
    """Trajectory frames per job id."""
    reward_one: int = 0
    """Trajectories with reward 1.0 (every bench environment's correct result)."""
    pids: set[str] = field(default_factory=set)
    """Processes that ran RUN, where the environment reports it (``cpu``)."""
    stage_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGE_TIMINGS, 0.0))
    """Per ``StageTimings`` field, the sum over all trajectories (seconds)."""

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds if self.seconds else 0.0

    def exactly_once(self, ids: list[str]) -> bool:
        """Every id finished once and delivered one trajectory; no other id appeared."""
        want = Counter(ids)
        return self.finished == want and self.trajectories == want


def job_ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{k}" for k in range(n)]


async def stream_jobs(client: Any, n: int, prefix: str, progress: bool, *,
                      environment: str = "noop", task: dict[str, Any] | None = None,
                      batch: int = 250, batch_progress: bool = True,
                      batch_frames: bool = True) -> StreamResult:
    """Submit ``n`` jobs over one session in batches, ack every trajectory, and return what
    came back. The clock stops when the last job's ``finished`` frame arrives."""
    from rollout.v1 import job_pb2

    specs = [job_pb2.JobSpec(job_id=job_id, environment=environment,
                             task={"k": k, **(task or {})})
             for k, job_id in enumerate(job_ids(prefix, n))]
    out = StreamResult(jobs=n)

    def count(frame: Any) -> None:
        out.frames += 1

    async with client.session(f"bench-{prefix}", progress=progress, heartbeat_s=0,
                              batch_progress=batch_progress, batch_frames=batch_frames,
                              on_wire=count) as session:
        t0 = time.perf_counter()

        async def submit_all() -> None:
            for i in range(0, n, batch):
                await session.submit(specs[i:i + batch])

        submitter = asyncio.create_task(submit_all())
        done, acks = 0, []
        async for frame in session.events():
            kind = frame.WhichOneof("kind")
            if kind == "trajectory":
                traj = frame.trajectory.trajectory
                out.trajectories[traj.job_id] += 1
                out.reward_one += traj.reward == 1.0
                if "pid" in traj.metadata:
                    out.pids.add(traj.metadata["pid"])
                for name in STAGE_TIMINGS:
                    out.stage_s[name] += getattr(traj.timings, name).ToTimedelta() \
                        .total_seconds()
                acks.append(frame.trajectory.delivery_id)
                if len(acks) >= batch:
                    await session.ack(acks)
                    acks = []
            elif kind == "finished":
                out.finished[frame.job_id] += 1
                done += 1
                if done == n:
                    break
            elif kind == "progress":
                out.events += 1
            elif kind == "rejected":
                raise RuntimeError(f"job rejected: {frame.rejected}")
        if acks:
            await session.ack(acks)
        out.seconds = time.perf_counter() - t0
        await submitter
        await session.aclose()
    return out


def main(argv: list[str] | None = None) -> int:
    """The child process: serve until SIGTERM (``BenchServer`` reads ``PORT <n>``)."""
    from rollout.benchmarks.handlers import serve_until_signalled
    from rollout.server.config import Config

    p = argparse.ArgumentParser(prog="python -m rollout.benchmarks.server_process")
    p.add_argument("state_dir")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--stage-workers", type=int, default=8)
    p.add_argument("--profile", help="write the server process's cProfile stats here")
    p.add_argument("--dashboard", action="store_true", help="serve the dashboard on a free port")
    args = p.parse_args(argv)
    cfg = Config()
    cfg.server.port = 0
    cfg.server.state_dir = args.state_dir
    cfg.server.heartbeat_s = 0
    cfg.llm.backends = []
    if args.dashboard:
        cfg.server.dashboard_port = 0
    cfg.pipeline.init_workers = cfg.pipeline.run_workers = cfg.pipeline.eval_workers = \
        args.stage_workers
    if args.workers:
        cfg.cluster.workers = args.workers
        cfg.cluster.slots_per_node = args.slots
        cfg.cluster.node_state_dir = os.path.join(args.state_dir, "nodes")
    if not args.profile:
        return serve_until_signalled(cfg, grace_s=0)
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    try:
        return serve_until_signalled(cfg, grace_s=0)
    finally:
        prof.disable()
        prof.dump_stats(args.profile)


if __name__ == "__main__":
    sys.exit(main())
