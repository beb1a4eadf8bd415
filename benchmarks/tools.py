"""``rollout bench tools``: tool latency inside bubblewrap sandboxes, beside baselines.

Measured in one run on this machine:

* a trivial bash command through the ``bash`` tool API (pty + sentinel) in a sandbox, beside
  a tmux send-keys/capture-pane loop (how the reference system drove its shells);
* IPython ``1+1`` over the ``ipc`` transport (kernel inside the sandbox), beside ``tcp``;
* sandbox create + first command + destroy, beside a bare ``bwrap ... true`` spawn;
* ``chain``: a cold launch line and a first command, link by link (:func:`bench_chain`);
* the warm pool (``sandbox.pool_size``): a sandbox ready from the pool (taken, the job's
  files written) and ready + its first command (run in the parked launch), beside a cold
  create and a cold create + first command, and the bare ``bwrap ... true`` spawn.

Targets: bash p50 <= 1 ms and p95 <= 2 ms; IPython ipc p50 <= 5 ms; lifecycle p50 <= 30 ms;
pool ready p50 <= 2 ms; cold create + first command p50 <= 10 ms.
The reference system's published figures (780 ms tmux, 420 ms pty per shell command) are
printed for context; they were not measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rollout.runtime.sandbox import Sandbox, SandboxConfig, create_sandbox, procs
from rollout.runtime.sandbox.pool import PoolSettings, SandboxPool
from rollout.runtime.tools import make_tools
from rollout.runtime.tools.ipython import IPythonKernel

REFERENCE_TMUX_MS = 780.0
REFERENCE_PTY_MS = 420.0


@dataclass
class Row:
    name: str
    samples: list[float]
    target_p50: float | None = None
    target_p95: float | None = None

    @property
    def p50(self) -> float:
        return statistics.median(self.samples)

    @property
    def p95(self) -> float:
        s = sorted(self.samples)
        return s[min(len(s) - 1, round(0.95 * (len(s) - 1)))]

    @property
    def ok(self) -> bool | None:
        if self.target_p50 is None and self.target_p95 is None:
            return None
        return ((self.target_p50 is None or self.p50 <= self.target_p50)
                and (self.target_p95 is None or self.p95 <= self.target_p95))


async def _timed(n: int, fn: Callable[[], Awaitable[object]], warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        await fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


async def bench_bash(cfg: SandboxConfig, n: int) -> Row:
    async with await create_sandbox(cfg) as sb:
        (tool,) = make_tools(sb, names=("bash",))

        async def one() -> None:
            res = await tool({"command": "true"})
            assert not res.is_error, res.output
        return Row("bash `true` via tool API (pty, bwrap)", await _timed(n, one), 1.0, 2.0)


def _tmux_samples(n: int) -> list[float]:
    """send-keys + capture-pane polling until the command's output shows up."""
    name = f"bench-{uuid.uuid4().hex[:8]}"
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "200", "-y", "50",
                    "bash --norc --noprofile"], check=True)
    try:
        out = []
        for i in range(n + 3):
            marker = f"DONE{i}x"
            t = time.perf_counter()
            subprocess.run(["tmux", "send-keys", "-t", name, f"true; echo {marker[:4]}''"
                            f"{marker[4:]}", "Enter"], check=True)
            while marker not in subprocess.run(
                    ["tmux", "capture-pane", "-p", "-t", name], capture_output=True,
                    text=True).stdout:
                pass
            if i >= 3:
                out.append((time.perf_counter() - t) * 1e3)
            if i % 20 == 0:
                subprocess.run(["tmux", "send-keys", "-t", name, "clear", "Enter"], check=True)
                subprocess.run(["tmux", "clear-history", "-t", name], check=True)
        return out
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], check=False)


async def bench_ipython(cfg: SandboxConfig, n: int) -> tuple[Row, Row]:
    rows = []
    for transport, network in (("ipc", "none"), ("tcp", "loopback")):
        # tcp needs the host's network namespace to reach the kernel; ipc needs none.
        async with await create_sandbox(cfg, network=network) as sb:  # type: ignore[arg-type]
            kernel = await IPythonKernel.start(sb, transport=transport)  # type: ignore[arg-type]
            try:
                async def one(k: IPythonKernel = kernel) -> None:
                    res = await k.execute("1+1")
                    assert res.output == "2\n", res.output
                samples = await _timed(n, one)
            finally:
                await kernel.close()
        rows.append(Row(f"IPython `1+1` over {transport} (kernel in bwrap)", samples,
                        5.0 if transport == "ipc" else None))
    return rows[0], rows[1]


async def bench_lifecycle(cfg: SandboxConfig, n: int) -> Row:
    async def one() -> None:
        sb = await create_sandbox(cfg, workspace_files={"task.txt": "x"})
        try:
            res = await sb.exec("cat task.txt")
            assert res.stdout == "x", res
        finally:
            await sb.destroy()
    return Row("sandbox create + first command + destroy", await _timed(n, one), 30.0)


async def bench_pool(cfg: SandboxConfig, n: int) -> list[Row]:
    """Pool rows beside cold ones, interleaved so both see the same machine. Each pooled
    sample waits until the pool is full again, so the background refill of the previous
    sample does not run inside this one (in a busy server it runs beside other jobs)."""
    pool = SandboxPool(cfg, PoolSettings(size=2))
    pool.start()
    files = {"task.txt": "x"}
    ready, ready_first, cold, cold_first = [], [], [], []
    try:
        for i in range(n + 3):
            async with asyncio.timeout(60):
                while pool.ready_count() < 2:
                    await asyncio.sleep(0.005)
            t0 = time.perf_counter()
            sb = await create_sandbox(cfg, pool=pool, workspace_files=files)
            t1 = time.perf_counter()
            res = await sb.exec("cat task.txt")
            t2 = time.perf_counter()
            assert res.stdout == "x" and getattr(sb, "parked_pid", None) is None, res
            await sb.destroy()
            t3 = time.perf_counter()
            cb = await create_sandbox(cfg, workspace_files=files)
            t4 = time.perf_counter()
            res = await cb.exec("cat task.txt")
            t5 = time.perf_counter()
            assert res.stdout == "x", res
            await cb.destroy()
            if i >= 3:  # warm-up
                ready.append((t1 - t0) * 1e3)
                ready_first.append((t2 - t0) * 1e3)
                cold.append((t4 - t3) * 1e3)
                cold_first.append((t5 - t3) * 1e3)
        assert pool.stats().misses == 0
    finally:
        await pool.close()
    return [Row("pool: sandbox ready (taken, files written)", ready, 2.0),
            Row("pool: ready + first command (parked launch)", ready_first),
            Row("cold: sandbox created (files written)", cold),
            Row("cold: created + first command", cold_first, 10.0)]


async def bench_chain(sb: Sandbox, n: int) -> list[Row]:
    """Where a cold launch's time goes, link by link, on a real sandbox whose workspace holds
    ``task.txt``: its launcher line running ``true`` spawned as the server spawns it (by the
    spawner thread, which is in the sandboxes' memory cgroup, so the launch is born inside),
    the same line spawned by another thread (its prologue joins the cgroup), the line with the
    host's ``nsswitch.conf`` (as before the curated ``/etc`` answered account lookups from its
    files alone), the line as it was before the prologue set the rlimits (a ``prlimit``
    exec), then that line with one more link taken out per row. Then the first command's own
    links: the line running ``bash -c 'cat task.txt'`` (the command's shell), spawned as
    ``exec()`` spawns it (stdout and stderr pipes read to their end, its own process group),
    the same with a session of its own (as every launch had before), and ``exec()`` itself on
    this live sandbox (the Python path: the spawner hop, the pidfd, the event loop).
    Interleaved, so every variant sees the same machine."""
    import concurrent.futures
    import os

    from rollout.runtime.sandbox import hardening

    full = sb.command_argv(["true"])
    env = sb.spawn_env()
    bwrap_on = full[full.index("bwrap"):]
    seccomp = full[5] if full[0] == "dash" and "--seccomp" in full else None
    cgroup = Path(full[4]) if full[0] == "dash" and full[4] != "-" else None
    limits = sb.limits  # type: ignore[attr-defined]
    with_prlimit = ["prlimit", *limits.prlimit_args(), "--", *bwrap_on]
    before = [*hardening.launch_wrapper(cgroup, Path(seccomp) if seccomp else None),
              *with_prlimit]
    cut = bwrap_on.index("setpriv") if "setpriv" in bwrap_on else len(bwrap_on) - 1
    no_setpriv = [*bwrap_on[:cut], "true"]
    seal = full.index("--remount-ro") if "--remount-ro" in full else len(full) - 1
    host_nss = [*full[:seal], "--ro-bind", "/etc/nsswitch.conf", "/etc/nsswitch.conf",
                *full[seal:]]
    first = [*full[:-1], "bash", "-c", "cat task.txt"]
    piped: dict[str, object] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE,
                                "stdin": subprocess.DEVNULL}
    group: dict[str, object] = {**piped, "process_group": 0}
    session: dict[str, object] = {**piped, "start_new_session": True}
    raw: list[tuple[str, list[str], bool, dict[str, object]]] = [
        ("full launch line, spawned as the server does (born in the cgroup)", full, True, {}),
        ("before: the host's nsswitch.conf (NSS modules load in the uid drop)", host_nss,
         True, {}),
        ("full launch line, spawned by another thread (joins the cgroup)", full, False, {}),
        ("before: prlimit exec instead of ulimit builtins (born in the cgroup)", before, True,
         {}),
        ("  without the prologue, prlimit kept (seccomp fd passed directly)", with_prlimit,
         False, {}),
        ("  without prlimit", bwrap_on, False, {}), ("  without setpriv", no_setpriv, False, {}),
        ("first command: the line running `bash -c 'cat task.txt'`", first, True,
         {"stdout": subprocess.DEVNULL}),
        ("  spawned as exec() does (pipes read to the end, own process group)", first, True,
         group),
        ("  before: the same in a session of its own", first, True, session)]
    other = concurrent.futures.ThreadPoolExecutor(1)
    loop = asyncio.get_running_loop()

    def one(argv: list[str], how: dict[str, object]) -> float:
        fds: tuple[int, ...] = ()
        if seccomp and argv[0] not in ("sh", "dash"):
            fd = os.open(seccomp, os.O_RDONLY)
            fds = (fd,)
            argv = [str(fd) if a == "9" and argv[j - 1] == "--seccomp" else a
                    for j, a in enumerate(argv)]
        try:
            t = time.perf_counter()
            proc = subprocess.Popen(argv, env=env, pass_fds=fds, **how)  # type: ignore[call-overload]
            proc.communicate()
            ms = (time.perf_counter() - t) * 1e3
            if proc.returncode != 0:
                raise subprocess.CalledProcessError(proc.returncode, argv)
            return ms
        finally:
            for fd in fds:
                os.close(fd)

    async def via_exec(cmd: str | list[str]) -> float:
        t = time.perf_counter()
        res = await sb.exec(cmd)
        ms = (time.perf_counter() - t) * 1e3
        assert res.exit_code == 0, res
        return ms

    await procs.in_spawner(lambda: None)  # its cgroup join has run
    names = [name for name, *_ in raw] + [
        "  exec(\"cat task.txt\") on this live sandbox (the whole Python path)",
        "  exec([\"true\"]) on this live sandbox (no bash)"]
    samples: list[list[float]] = [[] for _ in names]
    try:
        for i in range(n + 3):
            got = []
            for _, argv, here, how in raw:
                got.append(await procs.in_spawner(one, argv, how) if here else
                           await loop.run_in_executor(other, one, argv, how))
            got.append(await via_exec("cat task.txt"))
            got.append(await via_exec(["true"]))
            if i >= 3:
                for k, ms in enumerate(got):
                    samples[k].append(ms)
    finally:
        other.shutdown()
    return [Row(f"chain: {name}", x) for name, x in zip(names, samples, strict=True)]


async def bench_pool_tools(cfg: SandboxConfig, n: int) -> list[Row]:
    """A job's first tool call from INIT on: with the pool's tools started ahead
    (``sandbox.pool_tools``) against a cold sandbox whose tool starts on first use; bash and
    IPython samples alternate, pooled and cold interleaved."""
    pool = SandboxPool(cfg, PoolSettings(size=1, tools=("bash", "python")))
    pool.start()
    rows: dict[str, list[float]] = {k: [] for k in ("pb", "cb", "pp", "cp")}

    async def first_call(sb: Sandbox, tool: str) -> None:
        if tool == "bash":
            res = await (await sb.bash()).run("cat task.txt")
            assert res.output.strip() == "x", res
        else:
            out = await (await sb.ipython()).execute("1+1")
            assert out.output == "2\n", out

    try:
        for i in range(2 * n + 2):
            tool = "bash" if i % 2 == 0 else "python"
            async with asyncio.timeout(120):
                while pool.ready_count() < 1:
                    await asyncio.sleep(0.005)
            await asyncio.sleep(0.15)  # the refill's delay: let nothing else run meanwhile
            for pooled in (True, False):
                t = time.perf_counter()
                sb = await create_sandbox(cfg, pool=pool if pooled else None,
                                          workspace_files={"task.txt": "x"})
                await first_call(sb, tool)
                ms = (time.perf_counter() - t) * 1e3
                await sb.destroy()
                if i >= 2:
                    rows[("p" if pooled else "c") + tool[0]].append(ms)
    finally:
        await pool.close()
    return [Row("pool (tools started): ready + first bash-tool command", rows["pb"]),
            Row("cold: created + bash started + first command", rows["cb"]),
            Row("pool (tools started): ready + first IPython call", rows["pp"]),
            Row("cold: created + kernel started + first IPython call", rows["cp"])]


async def bench_bare_bwrap(n: int) -> Row:
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--dev", "/dev",
            "--proc", "/proc", "true"]

    async def one() -> None:
        await asyncio.to_thread(subprocess.run, argv, check=True)
    return Row("baseline: bare `bwrap ... true` spawn", await _timed(n, one))


PARTS = ("bash", "ipython", "sandbox", "chain", "pool-tools")


async def run(n: int, parts: tuple[str, ...] = PARTS) -> list[Row]:
    tmp = tempfile.mkdtemp(prefix="rbench", dir="/tmp")
    cfg = SandboxConfig(state_dir=Path(tmp) / "state")
    rows: list[Row] = []
    try:
        if "bash" in parts:
            rows.append(await bench_bash(cfg, n))
            rows.append(Row("baseline: tmux send-keys + capture-pane", await asyncio.to_thread(
                _tmux_samples, max(20, n // 20))))
        if "ipython" in parts:
            rows += await bench_ipython(cfg, max(50, n // 4))
        if "sandbox" in parts:
            rows.append(await bench_lifecycle(cfg, max(20, n // 20)))
            rows += await bench_pool(cfg, max(20, n // 20))
            rows.append(await bench_bare_bwrap(max(20, n // 20)))
        if "pool-tools" in parts:
            rows += await bench_pool_tools(cfg, max(5, n // 100))
        if "chain" in parts:
            sb = await create_sandbox(cfg, workspace_files={"task.txt": "x"})
            try:
                rows += await bench_chain(sb, max(20, n // 20))
            finally:
                await sb.destroy()
            if "sandbox" not in parts:
                rows.append(await bench_bare_bwrap(max(20, n // 20)))
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def render(rows: list[Row], console: Console) -> None:
    table = Table(title="rollout bench tools (ms; measured in this run)")
    for col in ("measurement", "n", "p50", "p95", "target", "met"):
        table.add_column(col, justify="left" if col == "measurement" else "right")
    for r in rows:
        target = " / ".join(t for t in (
            f"p50≤{r.target_p50:g}" if r.target_p50 is not None else "",
            f"p95≤{r.target_p95:g}" if r.target_p95 is not None else "") if t)
        met = {True: "[green]yes[/]", False: "[red]NO[/]", None: ""}[r.ok]
        table.add_row(r.name, str(len(r.samples)), f"{r.p50:.3f}", f"{r.p95:.3f}", target, met)
    console.print(table)
    by = {r.name: r for r in rows}
    bash, tmux = by.get("bash `true` via tool API (pty, bwrap)"), by.get(
        "baseline: tmux send-keys + capture-pane")
    ipc, tcp = by.get("IPython `1+1` over ipc (kernel in bwrap)"), by.get(
        "IPython `1+1` over tcp (kernel in bwrap)")
    if bash and tmux:
        console.print(f"tmux / pty bash (p50): [bold]{tmux.p50 / bash.p50:.0f}x[/] slower")
    if ipc and tcp:
        console.print(f"ipc vs tcp (p50): {ipc.p50:.2f} vs {tcp.p50:.2f} ms")
    ready, first = by.get("pool: sandbox ready (taken, files written)"), by.get(
        "pool: ready + first command (parked launch)")
    cold, bare = by.get("cold: created + first command"), by.get(
        "baseline: bare `bwrap ... true` spawn")
    if ready and first and cold and bare:
        console.print(f"p50: pool ready {ready.p50:.2f} ms, pool ready + first command "
                      f"{first.p50:.2f} ms, cold create + first command {cold.p50:.2f} ms, "
                      f"bare bwrap {bare.p50:.2f} ms")
    if bash:
        console.print(f"context, not measured here: the reference system publishes "
                      f"{REFERENCE_TMUX_MS:.0f} ms (tmux) and {REFERENCE_PTY_MS:.0f} ms (pty) "
                      f"per shell command; ours is {REFERENCE_PTY_MS / bash.p50:.0f}x below "
                      "its pty figure")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollout bench tools", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--iterations", type=int, default=2000,
                        help="bash samples (other rows scale from it; default 2000)")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when a target is missed (noisy machines: off by default)")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS[:3]),
                        help="which parts to run (default: bash ipython sandbox); `sandbox` is "
                             "the lifecycle, the warm pool and bare bwrap; `chain` profiles a "
                             "cold launch line and a first command link by link; `pool-tools`: "
                             "a job's first bash "
                             "and IPython call with the pool's tools started ahead vs cold")
    args = parser.parse_args(argv)
    if shutil.which("bwrap") is None:
        Console(stderr=True).print("bubblewrap (bwrap) is not installed")
        return 2
    rows = asyncio.run(run(args.iterations, tuple(args.only)))
    render(rows, Console())
    return 1 if args.strict and any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
