"""``rollout quickstart``: the whole system on the embedded defaults, in one command.

Starts a real server in this process (gRPC on loopback, SQLite job store under ``<out-dir>/state``,
bubblewrap sandboxes, the in-process transformers engine with SmolLM2-135M-Instruct on the
CPU), submits a mixed batch of the shipped tasks through the real client, shows live progress
per stage, and leaves behind the trajectories as JSONL and a timeline plot of every job's
INIT / RUN / EVAL spans, which shows the stages of different jobs overlapping.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rich.console import Console

from rollout.client.aio import RolloutClient
from rollout.client.specs import job_spec
from rollout.entrypoints.cli import ClientSettings
from rollout.entrypoints.submit import submit_specs
from rollout.runtime.envs.common import DATA_DIR
from rollout.runtime.tasksets.shipped import job_line, load_tasks, read_task_file
from rollout.server.app import Server
from rollout.server.config import load_config
from rollout.v1 import job_pb2

MIX = {"math": 8, "code": 4, "swe": 2}
SAMPLING = {"temperature": 0.7, "top_p": 0.95, "max_tokens_per_turn": 128,
            "total_token_budget": 4096}
# RUN gets ten minutes: on a 2-core machine shared with other work, the first turns of a batch
# (prefill of every job's prompt) alone have taken five.
# A tool call gets 20 s: a small model's endless loop then costs a job 20 s per call, not the
# 60 s default, and the batch ends in about the time of its other jobs.
LIMITS = {"max_turns": 4, "init_timeout": "120s", "run_timeout": "600s", "eval_timeout": "180s",
          "tool_timeout": "20s"}
SEED_STRIDE = 1_000_003
"""Job i samples with ``seed + i * SEED_STRIDE`` (turn k adds k), as ``rollout submit
--samples`` does, so no two jobs share a random stream and one seed reproduces the batch."""


def quickstart_tasks(env: str) -> list[dict[str, Any]]:
    """``data/quickstart-<env>.jsonl`` where it exists, else the shipped set of ``env``.

    The quickstart sets are easy on purpose: a 135M-parameter model fails the shipped math
    problems (docs/architecture.md), and a demo where every job ends the same way shows nothing.
    """
    path = DATA_DIR / f"quickstart-{env}.jsonl"
    return read_task_file(path, env) if path.exists() else load_tasks(env)


def build_specs(mix: dict[str, int], run_id: str, seed: int) -> list[job_pb2.JobSpec]:
    specs: list[job_pb2.JobSpec] = []
    for env, n in mix.items():
        tasks = quickstart_tasks(env)
        for k in range(n):  # cycle when asked for more jobs than tasks
            task = tasks[k % len(tasks)]
            tid = task.get("id") or task.get("instance_id")
            line = job_line(env, task, job_id=f"qs-{run_id}-{tid}-{k}",
                            sampling={**SAMPLING, "seed": seed + len(specs) * SEED_STRIDE},
                            limits=LIMITS)
            specs.append(job_spec(line))
    return specs


async def _timeline(address: str, job_ids: list[str], path: Path) -> None:
    """Plot each job's stage spans from the store's timings (queue waits left blank)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = []
    async with RolloutClient(address) as client:
        for job_id in job_ids:
            resp = await client.get_job(job_id)
            t0 = resp.job.create_time.ToNanoseconds() / 1e9
            t = resp.timings
            spans, cursor = [], t0
            for queue, run, color in ((t.init_queue, t.init, "tab:blue"),
                                      (t.run_queue, t.run, "tab:orange"),
                                      (t.eval_queue, t.eval, "tab:green")):
                cursor += queue.ToNanoseconds() / 1e9
                dur = run.ToNanoseconds() / 1e9
                spans.append((cursor, dur, color, queue.ToNanoseconds() / 1e9))
                cursor += dur
            rows.append((job_id, spans))
    if not rows:
        return
    start = min(s[0][0] - s[0][3] for _, s in rows)
    fig, ax = plt.subplots(figsize=(11, 0.35 * len(rows) + 1.8))
    for i, (_job_id, spans) in enumerate(rows):
        for begin, dur, color, waited in spans:
            if waited > 0.01:  # queued for this stage: the pipeline holding the job back
                ax.broken_barh([(begin - waited - start, waited)], (i - 0.25, 0.5),
                               color="lightgrey")
            ax.broken_barh([(begin - start, max(dur, 0.15))], (i - 0.4, 0.8), color=color)
    ax.set_yticks(range(len(rows)), [j.split("-", 2)[-1] for j, _ in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first job was accepted")
    ax.set_title("rollout quickstart: each job's stages")
    ax.legend(handles=[Patch(color=c, label=n) for n, c in (
        ("INIT", "tab:blue"), ("RUN", "tab:orange"), ("EVAL", "tab:green"),
        ("queued", "lightgrey"))], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fresh_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")


async def run(args: argparse.Namespace, console: Console) -> int:
    # Fewer RUN workers than jobs, so the plot shows jobs queueing for RUN while INIT and EVAL
    # of others go on, and so the jobs in RUN share the CPU between fewer prompts (their RUN
    # deadline runs while they wait on the model, not while they queue); --set
    # pipeline.run_workers=N overrides it.
    # Its own state directory, inside --out-dir: a `rollout serve` beside it keeps ./.rollout
    # (one server per state directory; the second would refuse to start).
    cfg = load_config(args.config, overrides=[f"server.port={args.port}",
                                              f"server.state_dir={Path(args.out_dir) / 'state'}",
                                              "pipeline.run_workers=4", *args.set])
    console.print("[bold]rollout quickstart[/]: starting an in-process server "
                  "(bubblewrap sandboxes, SmolLM2-135M-Instruct on the CPU)…")
    t0 = time.monotonic()
    server = await Server(cfg).start()
    console.print(f"server on {server.address} ready in {time.monotonic() - t0:.1f} s "
                  f"(state in {cfg.state_path})")
    out_dir = Path(args.out_dir)
    traj_path = out_dir / "trajectories.jsonl"
    _fresh_file(traj_path)
    run_id = time.strftime("%Y%m%d-%H%M%S")
    seed = args.seed if args.seed is not None else random.randrange(1_000_000)
    console.print(f"seed {seed} (run again with --seed {seed} for the same sampling streams)")
    specs = build_specs(args.mix, run_id, seed)
    settings = ClientSettings(address=server.address, token=cfg.server.auth_token or None,
                              client_id=f"quickstart-{run_id}")
    # A fresh file each run (the summary says "written to", not "appended to"). Ctrl-C
    # cancels what is unfinished: the state directory outlives this run, and a job left there
    # would be recovered and run again by the next quickstart's server.
    submit_args: Any = SimpleNamespace(out=str(traj_path), progress=True, appending=False,
                                       on_interrupt="cancel")
    try:
        with traj_path.open("a") as out:
            code = await submit_specs(submit_args, settings, console, specs, out)
        plot = out_dir / "timeline.png"
        await _timeline(server.address, [s.job_id for s in specs], plot)
    finally:
        await server.stop(grace_s=2)
    console.print(f"trajectories: {traj_path}\ntimeline:     {plot}\n"
                  f"seed:         {seed}\ntotal:        {time.monotonic() - t0:.1f} s")
    return code


def _parse_mix(text: str) -> dict[str, int]:
    mix = {}
    for part in text.split(","):
        env, sep, n = part.partition("=")
        if not sep or not n.strip().isdigit():
            raise argparse.ArgumentTypeError(f"--mix wants ENV=N,…; got {part!r}")
        mix[env.strip()] = int(n)
    return mix


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollout quickstart", description=__doc__)
    p.add_argument("--out-dir", default="quickstart-out",
                   help="where trajectories.jsonl, timeline.png and the server's state/ go")
    p.add_argument("--config", help="TOML configuration file (defaults are embedded)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting, e.g. pipeline.run_workers=8")
    p.add_argument("--port", type=int, default=0, help="server port (0: any free port)")
    p.add_argument("--mix", type=_parse_mix, default=MIX, metavar="ENV=N,…",
                   help="jobs per environment (default: math=8,code=4,swe=2)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed of the batch (default: a fresh one, printed)")
    args = p.parse_args(argv)
    return asyncio.run(run(args, Console()))
