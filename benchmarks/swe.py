"""``rollout bench swe``: SWE task INIT and EVAL cost for a repeated repository.

Measured in one run on this machine, on one shipped task whose environment must be built
(default ``rollout__unitconv-1``: a dependency that only the wheelhouse has):

* INIT with a cold environment cache: the venv is built (no network, from the wheelhouse),
  then the repository is checked out; every sample starts from an empty cache;
* INIT with a warm cache, as every later job of the same repository sees it: the cached venv
  is bound read-only, only the checkout remains;
* baseline: INIT of the same task without its environment (the server's interpreter), which
  is what INIT does for a task without one;
* EVAL of the gold patch on the warm environment: stop the agent, copy its workspace into a
  grading sandbox, fresh ``.git`` at base, restore, test patch, the named tests; with the
  honeypot tests planted (the default) and, interleaved as its baseline, without them.

The wheelhouse must hold the task's packages (``python -m rollout.runtime.tasksets.shipped prepare
runtime/envs/data/swe.jsonl`` fills it; registry access is needed only that once).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rollout.runtime.envs.swe.handler import SweHandler
from rollout.runtime.envs.swe.taskenv import user_wheelhouses
from rollout.runtime.handler import JobContext
from rollout.runtime.sandbox import SandboxConfig, create_sandbox
from rollout.runtime.tasksets.shipped import fill_wheelhouse, load_tasks
from rollout.runtime.types import JobSpec, Limits


@dataclass
class Row:
    name: str
    samples: list[float]

    @property
    def p50(self) -> float:
        return statistics.median(self.samples)

    @property
    def worst(self) -> float:
        return max(self.samples)


def _ctx(task: Mapping[str, Any], factory: Any, i: int) -> JobContext:
    spec = JobSpec(job_id=f"bench-swe-{i}", environment="swe", task=dict(task),
                   limits=Limits(init_timeout_s=900.0, eval_timeout_s=300.0))
    return JobContext(spec=spec, sandbox_factory=factory)


async def _init_once(task: Mapping[str, Any], factory: Any, i: int) -> float:
    handler = SweHandler()
    ctx = _ctx(task, factory, i)
    async with ctx.resources:
        started = time.perf_counter()
        await handler.init(ctx)
        return (time.perf_counter() - started) * 1000


async def _eval_gold(task: Mapping[str, Any], factory: Any, i: int, *,
                     honeypots: bool = True) -> float:
    handler = SweHandler(honeypots=honeypots)
    ctx = _ctx(task, factory, i)
    async with ctx.resources:
        await handler.init(ctx)
        sandbox = ctx.state["env.sandbox"]
        applied = await sandbox.exec(["git", "apply", "-"], stdin=task["patch"].encode(),
                                     timeout=60)
        if not applied.ok:
            raise RuntimeError(f"the gold patch does not apply: {applied.output}")
        started = time.perf_counter()
        reward = await handler.eval(ctx)
        took = (time.perf_counter() - started) * 1000
    if reward.value != 1.0:
        raise RuntimeError(f"the gold patch earned {reward.value}: {reward.info}")
    return took


async def run(task_id: str, cold: int, warm: int) -> list[Row]:
    task = next((t for t in load_tasks("swe") if t["instance_id"] == task_id), None)
    if task is None or "spec" not in task:
        raise SystemExit(f"no shipped swe task {task_id!r} with an environment spec")
    await asyncio.to_thread(fill_wheelhouse, [task], user_wheelhouses()[0])
    tmp = Path(tempfile.mkdtemp(prefix="rbench-swe", dir="/tmp"))
    factory = functools.partial(create_sandbox, SandboxConfig(state_dir=tmp / "state"))
    previous = os.environ.get("ROLLOUT_SWE_ENV_CACHE")
    try:
        plain = {k: v for k, v in task.items() if k not in ("spec", "version")}
        cold_ms = []
        for i in range(cold):
            os.environ["ROLLOUT_SWE_ENV_CACHE"] = str(tmp / f"cold-{i}")
            cold_ms.append(await _init_once(task, factory, i))
        # Warm: the cache the last cold sample filled, as the next job of this repo finds it;
        # interleaved with the baseline so both see the same machine load.
        warm_ms, baseline = [], []
        for i in range(warm):
            warm_ms.append(await _init_once(task, factory, i))
            baseline.append(await _init_once(plain, factory, i))
        # With and without the honeypot tests, interleaved: the same machine load for both.
        eval_ms, eval_plain = [], []
        for i in range(max(3, warm // 3)):
            eval_ms.append(await _eval_gold(task, factory, i))
            eval_plain.append(await _eval_gold(task, factory, i, honeypots=False))
    finally:
        if previous is None:
            os.environ.pop("ROLLOUT_SWE_ENV_CACHE", None)
        else:
            os.environ["ROLLOUT_SWE_ENV_CACHE"] = previous
        shutil.rmtree(tmp, ignore_errors=True)
    return [Row("INIT, cold env cache (builds the venv)", cold_ms),
            Row("INIT, warm env cache (same repository again)", warm_ms),
            Row("baseline: INIT without the task's environment", baseline),
            Row("EVAL of the gold patch (grading sandbox, warm env)", eval_ms),
            Row("baseline: the same EVAL without honeypot tests", eval_plain)]


def render(rows: list[Row], task_id: str, console: Console) -> None:
    table = Table(title=f"rollout bench swe: {task_id} (ms; measured in this run)")
    for col in ("measurement", "n", "p50", "max"):
        table.add_column(col, justify="left" if col == "measurement" else "right")
    for r in rows:
        table.add_row(r.name, str(len(r.samples)), f"{r.p50:.0f}", f"{r.worst:.0f}")
    console.print(table)
    cold, warm, base = rows[0], rows[1], rows[2]
    console.print(f"warm INIT is {cold.p50 / warm.p50:.0f}x faster than cold and costs "
                  f"{warm.p50 - base.p50:+.0f} ms against INIT without an environment")
    honey, plain = rows[3], rows[4]
    console.print(f"EVAL with honeypot tests is {honey.p50 / plain.p50:.2f}x the EVAL without "
                  "(goal <= 1.2x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollout bench swe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="rollout__unitconv-1",
                        help="a shipped swe task with a spec (default rollout__unitconv-1)")
    parser.add_argument("--cold", type=int, default=2, help="cold samples (default 2)")
    parser.add_argument("--warm", type=int, default=10, help="warm samples (default 10)")
    args = parser.parse_args(argv)
    if shutil.which("bwrap") is None:
        Console(stderr=True).print("bubblewrap (bwrap) is not installed")
        return 2
    rows = asyncio.run(run(args.task, max(1, args.cold), max(1, args.warm)))
    render(rows, args.task, Console())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
