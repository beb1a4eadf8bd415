"""``rollout submit FILE.jsonl --out OUT.jsonl``: run a file of jobs, keep every trajectory.

Crash safety is the point of the design: a trajectory is acknowledged only after its line is
written and flushed, and the output file is appended to. The default client id is derived
from the output path, so re-running the same command after a crash (or Ctrl-C) re-opens the
same session: the server replays exactly the trajectories that were not yet written, the
re-submitted jobs are recognised as duplicates, and nothing runs or lands in the file twice.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rollout.client.aio import RolloutClient
from rollout.client.errors import RolloutError
from rollout.client.specs import group_specs, job_spec
from rollout.client.trajectory import to_json
from rollout.entrypoints.cli import ClientSettings, CliError
from rollout.entrypoints.submit_ids import (
    ID_TAKEN,
    EarlierRuns,
    check_prefix,
    file_stem,
    fresh_prefix,
    id_rule,
)
from rollout.entrypoints.summary import RunStats
from rollout.entrypoints.tables import cli_console
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb

SUBMIT_BATCH = 500
_STAGES = (job_pb2.STAGE_INIT, job_pb2.STAGE_RUN, job_pb2.STAGE_EVAL)
_TERMINAL = {job_pb2.Job.STATE_SUCCEEDED, job_pb2.Job.STATE_FAILED, job_pb2.Job.STATE_CANCELLED}


def default_client_id(out: str) -> str:
    return "submit-" + hashlib.sha256(str(Path(out).resolve()).encode()).hexdigest()[:16]


def load_specs(path: str, samples: int = 1, finish_after: int = 0,
               job_prefix: str | None = None) -> list[job_pb2.JobSpec]:
    """One job per line (or a group of ``samples`` jobs); ids default to ``<stem>-<line>``.
    ``job_prefix`` replaces the stem and also goes before ids and group ids the file names,
    so that every job of the file gets an id no earlier run used."""
    if samples < 1:
        raise CliError("INVALID_ARGUMENT", "BAD_FLAG", "--samples must be at least 1")
    stem = check_prefix(job_prefix) if job_prefix else file_stem(path)
    specs: list[job_pb2.JobSpec] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                data = json.loads(line)
                if not isinstance(data, dict):
                    raise ValueError("a line must be a JSON object")
                named = "job_id" in data or "jobId" in data
                data.setdefault("job_id", f"{stem}-{lineno}")
                spec = job_spec(data)
                if job_prefix and named:
                    spec.job_id = f"{job_prefix}-{spec.job_id}"
                if job_prefix and spec.group.group_id:
                    spec.group.group_id = f"{job_prefix}-{spec.group.group_id}"
            except ValueError as exc:
                raise CliError("INVALID_ARGUMENT", "BAD_INPUT",
                               f"{path}:{lineno}: {exc}") from None
            if samples > 1 or finish_after:
                gid = spec.group.group_id or spec.job_id
                specs += group_specs(spec, samples, gid, finish_after)
            else:
                specs.append(spec)
    if not specs:
        raise CliError("INVALID_ARGUMENT", "BAD_INPUT", f"{path} holds no jobs")
    return specs


class _Waiting:
    """What the run still waits for, one line under the bars: the unfinished jobs heard from
    least recently, with their stage and turns, so a slow tail says what it is doing."""

    SHOWN = 3

    def __init__(self, specs: list[job_pb2.JobSpec]) -> None:
        now = time.monotonic()
        self.jobs: dict[str, tuple[str, int, float]] = {
            s.job_id: ("queued", 0, now) for s in specs}
        """Unfinished job -> (stage, turns done, when last heard of)."""

    def heard(self, job_id: str, stage: int | None = None, turns: int | None = None) -> None:
        if job_id not in self.jobs:
            return
        old_stage, old_turns, _ = self.jobs[job_id]
        name = job_pb2.Stage.Name(stage).removeprefix("STAGE_") if stage else old_stage
        self.jobs[job_id] = (name, old_turns if turns is None else turns, time.monotonic())

    def done(self, job_id: str) -> None:
        self.jobs.pop(job_id, None)

    def line(self) -> str:
        if not self.jobs:
            return ""
        now = time.monotonic()
        quiet = sorted(self.jobs.items(), key=lambda kv: kv[1][2])[:self.SHOWN]
        parts = [f"{job_id} ({stage}, {turns} turns, last heard {now - at:.0f} s ago)"
                 for job_id, (stage, turns, at) in quiet]
        more = len(self.jobs) - len(quiet)
        return "waiting on " + "; ".join(parts) + (f"; +{more} more" if more > 0 else "")


class _Bars:
    """One bar per stage (jobs past that stage), one for finished jobs by outcome; the RUN bar's
    label counts agent turns, generated tokens and tool calls as turns finish, so it moves while
    jobs are inside RUN."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.p = progress
        self.outcomes: dict[str, int] = defaultdict(int)
        self.turns = 0
        # Latest running totals per job (a RUN retry restarts its counts, so the latest frame
        # of a job wins rather than adding up both attempts).
        self._run_totals: dict[str, tuple[int, int]] = {}
        self._past: dict[str, set[int]] = defaultdict(set)
        self._done: set[str] = set()  # a replayed `finished` must not count twice
        if progress is not None:
            self.tasks = {st: progress.add_task(self._stage_label(st), total=total)
                          for st in _STAGES}
            self.done = progress.add_task(self._done_label(), total=total)

    def _stage_label(self, stage: int) -> str:
        name = job_pb2.Stage.Name(stage).removeprefix("STAGE_")
        if stage != job_pb2.STAGE_RUN:
            return name
        tokens = sum(t for t, _ in self._run_totals.values())
        calls = sum(c for _, c in self._run_totals.values())
        return f"{name} · {self.turns} turns · {tokens} tokens · {calls} tool calls"

    def _done_label(self) -> str:
        o = self.outcomes
        return (f"done [green]✓{o['ok']}[/] [yellow]⏱{o['deadline']}[/] "
                f"[red]✗{o['fail'] + o['cancel']}[/]")

    def turn(self, job_id: str, progress: pb.StageProgress) -> None:
        """One agent turn finished somewhere (a ``StageProgress`` EVENT_TURN frame)."""
        self.turns += 1
        self._run_totals[job_id] = (progress.output_tokens, progress.tool_calls)
        if self.p is not None:
            self.p.update(self.tasks[job_pb2.STAGE_RUN],
                          description=self._stage_label(job_pb2.STAGE_RUN))

    def stage_finished(self, job_id: str, stage: job_pb2.Stage) -> None:
        if self.p is not None and stage in self.tasks and stage not in self._past[job_id]:
            self._past[job_id].add(stage)
            self.p.advance(self.tasks[stage])

    def job_done(self, job_id: str, outcome: str) -> None:
        """``outcome``: ok, deadline, fail or cancel (:attr:`JobOutcome.outcome`)."""
        if job_id in self._done:
            return
        self._done.add(job_id)
        self.outcomes[outcome] += 1
        for st in _STAGES:  # a failed job never passes its later stages; fill them in
            self.stage_finished(job_id, st)
        if self.p is not None:
            self.p.update(self.done, advance=1, description=self._done_label())


@contextlib.asynccontextmanager
async def _waiting_line(progress: Progress | None, waiting: _Waiting) -> AsyncIterator[None]:
    """Refresh the "waiting on" line once a second (it ages while nothing happens)."""
    if progress is None:
        yield
        return
    task = progress.add_task("", total=None, start=False)

    async def refresh() -> None:
        while True:
            progress.update(task, description=waiting.line())
            await asyncio.sleep(1.0)

    ticker = asyncio.create_task(refresh())
    try:
        yield
    finally:
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
        progress.update(task, description=waiting.line(), visible=bool(waiting.jobs))


def run_submit(args: argparse.Namespace, settings: ClientSettings,
               console: Console | None = None) -> int:
    console = console or cli_console()
    if getattr(args, "fresh", False):
        args.job_prefix = fresh_prefix(args.file)
        console.print(f"--fresh: job ids are {args.job_prefix}-<line>; to resume this run "
                      f"after a crash, repeat the command with --job-prefix {args.job_prefix} "
                      "instead of --fresh", markup=False, highlight=False)
    specs = load_specs(args.file, args.samples, args.finish_after,
                       getattr(args, "job_prefix", None))
    with open(args.out, "a") as out:
        return asyncio.run(submit_specs(args, settings, console, specs, out))


async def submit_specs(args: argparse.Namespace, settings: ClientSettings, console: Console,
                       specs: list[job_pb2.JobSpec], out: TextIO) -> int:
    """Submit, show live progress, write each trajectory to ``out`` and ack it once written.
    ``args`` needs ``out`` and ``progress``, and may set ``appending`` (False: ``out`` is a
    fresh file, and the summary says "written to") and ``on_interrupt`` (``ask``, ``cancel``
    or ``keep``: what Ctrl-C does with the unfinished jobs); also used by ``rollout
    quickstart``."""
    client_id = settings.client_id or default_client_id(args.out)
    waiting = _Waiting(specs)
    try:
        return await _submit(args, settings, console, specs, out, client_id, waiting)
    except asyncio.CancelledError:  # Ctrl-C: asyncio.run cancels us, then raises it
        await _on_interrupt(args, settings, console, client_id, sorted(waiting.jobs))
        raise


async def _on_interrupt(args: argparse.Namespace, settings: ClientSettings, console: Console,
                        client_id: str, unfinished: list[str]) -> None:
    """Say what Ctrl-C leaves behind, and cancel it when asked: the jobs keep running on the
    server otherwise (a re-run of the same command collects them)."""
    if not unfinished:
        return
    mode = getattr(args, "on_interrupt", "ask")
    if mode == "ask" and sys.stdin.isatty():
        try:
            answer = await asyncio.to_thread(
                input, f"\n{len(unfinished)} job(s) of this run are unfinished on the server. "
                       "Cancel them? [y/N] ")
        except (EOFError, KeyboardInterrupt):
            answer = ""
        mode = "cancel" if answer.strip().lower() in ("y", "yes") else "keep"
    if mode == "cancel":
        from rollout.entrypoints.job_commands import cancel_each

        async with RolloutClient(settings.address, token=settings.token) as client:
            cancelled = await cancel_each(client, unfinished)
        console.print(f"cancelled {len(cancelled)} unfinished job(s) of this run",
                      markup=False, highlight=False)
        return
    console.print(f"{len(unfinished)} job(s) of this run keep running on the server; re-run "
                  "the same command to collect their trajectories, or cancel them with: "
                  f"rollout jobs cancel --all-mine --client-id {client_id}",
                  markup=False, highlight=False, soft_wrap=True)


async def _submit(args: argparse.Namespace, settings: ClientSettings, console: Console,
                  specs: list[job_pb2.JobSpec], out: TextIO, client_id: str,
                  waiting: _Waiting) -> int:
    stats = RunStats(specs)
    earlier = EarlierRuns()
    progress = (Progress(TextColumn("{task.description:>6}"), BarColumn(), MofNCompleteColumn(),
                         TimeElapsedColumn(), console=console, transient=False)
                if args.progress else None)
    bars = _Bars(progress, len(specs))
    async with RolloutClient(settings.address, token=settings.token) as client:
        # One unary call first: a session retries a broken connection (it resumes), so a
        # stopped server or a missing token would otherwise surface only after its retries.
        await client.status()
    async with RolloutClient(settings.address, token=settings.token) as client, \
            client.session(client_id, progress=bool(args.progress)) as session, \
            _waiting_line(progress, waiting):
        with progress or contextlib.nullcontext():
            for i in range(0, len(specs), SUBMIT_BATCH):
                await session.submit(specs[i:i + SUBMIT_BATCH])
            await session.close()
            async for frame in session.events():
                kind = frame.WhichOneof("kind")
                if kind == "trajectory":
                    out.write(json.dumps(to_json(frame.trajectory.trajectory)) + "\n")
                    out.flush()  # written before acknowledged: a crash never loses one
                    stats.trajectory(frame.trajectory.trajectory)
                    earlier.trajectory_written(frame.trajectory.trajectory.job_id)
                    await session.ack([frame.trajectory.delivery_id])
                elif kind == "finished":
                    waiting.done(frame.job_id)
                    stats.finished(frame.job_id, frame.finished)
                    earlier.job_finished(frame.job_id)
                    bars.job_done(frame.job_id, stats.jobs[frame.job_id].outcome)
                elif kind == "progress":
                    p = frame.progress
                    waiting.heard(frame.job_id, p.stage, p.turns if p.turns else None)
                    if p.event == pb.StageProgress.EVENT_FINISHED:
                        bars.stage_finished(frame.job_id, p.stage)
                    elif p.event == pb.StageProgress.EVENT_TURN:
                        bars.turn(frame.job_id, p)
                elif kind == "accepted":
                    earlier.accepted(frame.job_id, frame.accepted)
                    waiting.heard(frame.job_id)
                    if frame.accepted.state in _TERMINAL:
                        waiting.done(frame.job_id)
                        stats.already_done += 1  # finished in an earlier run of this command
                        bars.job_done(frame.job_id, "ok" if frame.accepted.state
                                      == job_pb2.Job.STATE_SUCCEEDED else "fail")
                elif kind == "rejected" and frame.rejected.reason == ID_TAKEN:
                    waiting.done(frame.job_id)
                    earlier.taken_by_another(frame.job_id)  # reported below, with what to do
                    bars.job_done(frame.job_id, "earlier")
                elif kind == "rejected":
                    waiting.done(frame.job_id)
                    stats.rejected.append(frame.job_id)
                    bars.job_done(frame.job_id, "fail")
                    err = RolloutError.from_rejected(frame.rejected)
                    console.print(f"[red]rejected[/] {frame.job_id}: {err.one_line()}",
                                  markup=True, highlight=False)
    console.print(stats.table())
    console.print(stats.endings_table())
    for note in stats.zero_reward_notes():
        console.print(note, markup=False, highlight=False)
    for note in stats.starved_notes():
        console.print(note, markup=False, highlight=False)
    verb = "appended to" if getattr(args, "appending", True) else "written to"
    console.print(f"{stats.written} trajectories {verb} {args.out} "
                  f"(client id {client_id}); {stats.already_done} finished in an earlier run; "
                  f"{len(stats.rejected)} rejected")
    rule = id_rule(getattr(args, "file", None), getattr(args, "job_prefix", None))
    for line in earlier.report(len(specs), args.out, rule):
        console.print(line, markup=False, highlight=False)
    return 1 if stats.rejected else 0
