"""The stage pipeline: how a job moves through the stage pools and how it ends.

``StageRunner`` owns what executing stages needs and nothing else: the three pools (queues and
worker slots), the nodes stage work runs on, the per-stage statistics, the tasks it spawned,
and the retry of terminal writes. It launches a stage task, hands a job to the next stage,
decides its terminal state, persists it, and reports it once durable. It does not own the live
jobs (:class:`~rollout.server.pipeline.job_registry.JobRegistry`: it asks it, and retires a job
there once its end is durable) nor the sessions
(:class:`~rollout.server.pipeline.delivery.Delivery`: it emits progress and deliveries into
it). ``server.scheduler.Scheduler`` composes the three behind the public API.

Invariants:
- A job is in exactly one place: a pool's queue, a pool's blocked list, a running stage task,
  or finishing. ``finishing`` is set the moment its terminal state is decided; from then on it
  can no longer be cancelled, and its resources are released before the state is written.
- A terminal job is announced (TrajectoryReady + JobFinished) only after its store transaction
  committed, so every delivery id a client sees is durable.
- Stopping the scheduler is not a terminal event: interrupted jobs stay QUEUED/RUNNING in the
  store and run again on the next start; their resources are released all the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from rollout.runtime.types import JobError, JobState, Stage, TerminationReason, Trajectory
from rollout.server.cluster.node import NodeLost, NodeSet
from rollout.server.metrics import SchedulerMetrics, StageStats, StageStatus
from rollout.server.pipeline.delivery import Delivery
from rollout.server.pipeline.delivery_budget import held_bytes
from rollout.server.pipeline.groups import GROUP_FINISHED
from rollout.server.pipeline.job_registry import JobRegistry
from rollout.server.pipeline.stage_pool import LiveJob, StagePool
from rollout.server.pipeline.stages import build_trajectory
from rollout.server.pipeline.subscription import JobFinished, TrajectoryReady
from rollout.server.store import FinishRecord, JobStore, now

log = logging.getLogger(__name__)
STAGES = (Stage.INIT, Stage.RUN, Stage.EVAL)


@dataclass(frozen=True)
class PipelineConfig:
    init_workers: int = 8
    run_workers: int = 8
    eval_workers: int = 8
    stage_queue_size: int = 1024
    """Jobs that may wait for RUN and for EVAL; a full queue holds the upstream job back."""
    max_pending_jobs: int = 100_000
    """Accepted, unfinished jobs server-wide; beyond it submit raises Overloaded."""
    max_in_flight_per_client: int = 0
    """Unfinished jobs per client id; 0 = only the server-wide cap applies."""
    cleanup_deadline_s: float = 30.0
    """Bound on each of handler.cleanup, resources.aclose and llm.end_session."""
    max_attempts: int = 3
    """A job whose stage was interrupted by a process crash this many times fails with
    TOO_MANY_ATTEMPTS instead of running again (it may be what crashes the server). Waiting in
    a queue during a crash, or a graceful stop, does not count."""
    finish_retry_s: tuple[float, float] = (0.05, 5.0)
    """First and longest pause between retries of a terminal write that failed (full disk,
    I/O error): the job stays live and unannounced until its end is durable."""
    status_window_s: float = 30.0
    """Window of the per-stage throughput in ``status()``."""
    retention_s: float = 86_400.0
    """Keep an acknowledged trajectory this long after its ack; 0 = forever (no pruning).
    See server/pipeline/retention.py."""
    job_retention_s: float = 604_800.0
    """Keep the job row (state, reward, error) this long after its trajectory was pruned;
    0 = forever."""
    prune_interval_s: float = 60.0
    """How often the retention pass runs."""
    replay_page: int = 256
    """Deliveries read from the store at a time when a client replays a backlog (memory per
    replaying client is about one page of trajectories)."""
    delivery_memory_bytes: int = 1 << 30
    """Memory that trajectories not yet written to their clients may take, all sessions
    together (server/pipeline/delivery_budget.py); the rest wait in the store."""
    session_memory_bytes: int = 256 << 20
    """The most of ``delivery_memory_bytes`` one session may hold."""

    def __post_init__(self) -> None:
        for name in ("init_workers", "run_workers", "eval_workers", "stage_queue_size",
                     "max_pending_jobs", "max_attempts", "delivery_memory_bytes",
                     "session_memory_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"pipeline.{name} must be at least 1")
        if self.retention_s < 0 or self.job_retention_s < 0 or self.prune_interval_s <= 0:
            raise ValueError("pipeline.retention_s and job_retention_s must be >= 0, "
                             "prune_interval_s > 0")


class StageRunner:
    """Pools, nodes and stage tasks; decides and persists how each job ends.

    Talks to the rest through three collaborators given at construction: the store (stage
    bookkeeping and terminal writes), the job registry (which jobs are live; it retires a job
    there once its end is durable), and delivery (progress and finished-job events go out
    through it).
    """

    def __init__(self, store: JobStore, jobs: JobRegistry, delivery: Delivery,
                 metrics: SchedulerMetrics, nodes: NodeSet, config: PipelineConfig) -> None:
        self.store = store
        self.jobs = jobs
        self.delivery = delivery
        self.metrics = metrics
        self.nodes = nodes
        """Where stage work runs (server/cluster/): the server process itself by default."""
        self.config = cfg = config
        self.node_losses = 0
        """Jobs sent back to INIT because the node holding them died."""
        self.finish_failures = 0
        """Terminal writes that failed and were retried (not announced)."""
        self.pools = {
            Stage.INIT: StagePool(Stage.INIT, cfg.init_workers, cfg.max_pending_jobs + 1,
                                  self._launch),
            Stage.RUN: StagePool(Stage.RUN, cfg.run_workers, cfg.stage_queue_size, self._launch),
            Stage.EVAL: StagePool(Stage.EVAL, cfg.eval_workers, cfg.stage_queue_size,
                                  self._launch),
        }
        for up, down in ((Stage.INIT, Stage.RUN), (Stage.RUN, Stage.EVAL)):
            self.pools[up].downstream = self.pools[down]
            self.pools[down].upstream = self.pools[up]
        self._stats = {s: StageStats(window_s=cfg.status_window_s) for s in STAGES}
        self.tasks: set[asyncio.Task[Any]] = set()
        """Background work it spawned (clean-ups, finish retries, group closures)."""
        self._closing = False
        """Set by :meth:`drain`: failed terminal writes stop being retried (the job stays live
        in the store and runs again on the next start)."""
        self.precommit_bytes = 0
        """Trajectories built and not yet committed (queued for the store's writer, or waiting
        for a retry), as :func:`held_bytes` sizes them, the delivery budget's unit."""
        self.precommit_peak = 0
        self._committed = asyncio.Event()

    def queue(self, job: LiveJob) -> None:
        """Start a live job from INIT (new, recovered, or adopted)."""
        self.pools[Stage.INIT].push(job)

    def stage_status(self) -> tuple[StageStatus, ...]:
        out = []
        for stage in STAGES:
            pool, st = self.pools[stage], self._stats[stage]
            out.append(StageStatus(
                stage=stage, workers=pool.workers, queue_depth=pool.depth, in_flight=pool.busy,
                completed=st.completed, failed=st.failed, latency_p50_s=st.percentile(0.5),
                latency_p95_s=st.percentile(0.95), throughput_per_s=st.throughput()))
        return tuple(out)

    async def drain(self, grace_s: float, also: Iterable[asyncio.Future[Any]] = ()) -> None:
        """Stop starting stages; let running ones finish within ``grace_s``, then cancel them;
        wait for their clean-ups (and ``also``), and release what idle jobs still hold.

        Interrupted jobs stay live: stopping is not a terminal event.
        """
        self._closing = True
        for pool in self.pools.values():
            pool.paused = True
        tasks = [j.task for j in self.jobs if j.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        for job in self.jobs:
            if job.task is not None and not job.finishing:
                job.task.cancel()
        pending: list[asyncio.Future[Any]] = [j.task for j in self.jobs if j.task is not None]
        pending += [*self.tasks, *also]
        if pending:
            await asyncio.wait(pending, timeout=self.config.cleanup_deadline_s * 3 + 1)
        holders = [j for j in self.jobs
                   if j.ctx is not None and j.task is None and not j.finishing]
        await asyncio.gather(*(self._release(j) for j in holders))

    # -- running stages ----------------------------------------------------------------------

    def _launch(self, job: LiveJob, pool: StagePool) -> None:
        started = False

        async def body() -> None:
            nonlocal started
            started = True
            await self._stage_task(job, pool)

        def done(task: asyncio.Task[None]) -> None:
            # A task cancelled before its first step never runs a line of its coroutine, so
            # none of _stage_task's own clean-up happens: give the worker back and, if a
            # cancel (not a shutdown) did it, finish the job as cancelled.
            if started:
                return
            if job.task is task:
                job.task = None
            pool.release()
            if job.cancel_reason is not None and not job.finishing:
                job.finishing = True
                self.spawn(self._release_then_cancel(job))

        task = asyncio.get_running_loop().create_task(body())
        task.add_done_callback(done)
        job.task = task

    def _enter_stage(self, job: LiveJob, stage: Stage) -> float:
        t0 = time.monotonic()
        waited = t0 - job.enqueued_at
        name = f"{stage.value}_queue_s"
        setattr(job.timings, name, getattr(job.timings, name) + waited)
        self.metrics.queue_wait(stage).observe(waited)
        job.state, job.stage, job.stage_started = JobState.RUNNING, stage, t0
        job.updated_at = now()
        if stage is Stage.INIT:
            job.attempts += 1
            assert job.node is not None
            job.ctx = job.node.open_context(job.spec,
                                            lambda ev, d: self._progress(job, ev, d))
        assert job.ctx is not None
        job.ctx.stage = stage
        self.store.record_stage(job.job_id, stage, job.attempts, job.updated_at)
        self.delivery.progress(job.client_id, job.job_id, stage, "started", {}, 0.0)
        return t0

    async def _stage_task(self, job: LiveJob, pool: StagePool) -> None:
        """Run the job's stage in ``pool``; while the next stage has an idle worker and an
        empty queue, go straight on in this same task (no queue round trip, no new task)."""
        handed_on = False
        try:
            while await self._one_stage(job, pool):
                nxt = pool.downstream
                assert nxt is not None
                if nxt.take_now(job):
                    pool.release()
                    pool = nxt
                    continue
                job.task = None
                # Waiting for the next stage: a process death from here on is not charged to
                # the job as a crash (see JobStore.recover).
                self.store.record_waiting([job.job_id], wait=False)
                pool.hand_on(job)
                handed_on = True
                return
        finally:
            if not handed_on:
                job.task = None
                pool.release()

    async def _one_stage(self, job: LiveJob, pool: StagePool) -> bool:
        """One stage of one job; True when the job goes on to the next stage."""
        stage = pool.stage
        if stage is Stage.INIT and job.node is None:
            if not await self._place(job):
                return False
        try:
            t0 = self._enter_stage(job, stage)
            assert job.ctx is not None and job.node is not None
            try:
                result = await job.node.run_stage(job.ctx, stage,
                                                  job.spec.limits.timeout(stage))
            except NodeLost as exc:
                self._observe(job, stage, t0, "error")
                self._node_lost(job, exc)
                return False
            except asyncio.CancelledError:
                if job.cancel_reason is None:  # the scheduler is stopping: run again later
                    await self._release(job)
                    job.ctx = None  # released; the next start runs it from INIT
                    raise
                current = asyncio.current_task()
                if current is not None:
                    current.uncancel()
                self._observe(job, stage, t0, "cancelled")
                job.finishing = True
                await self._release(job)
                self.finish(job, JobState.CANCELLED, self._cancel_error(job), None)
                return False
            ok = result.error is None
            elapsed = self._observe(job, stage, t0, "ok" if ok else "error")
            self.delivery.progress(job.client_id, job.job_id, stage, "finished", {"ok": ok},
                                   elapsed)
            if ok and stage is not Stage.EVAL and result.reward is None:
                return True
            job.finishing = True
            await self._release(job)
            if ok:
                self.finish(job, JobState.SUCCEEDED, None, result.reward)
            else:
                self.finish(job, JobState.FAILED, result.error, None)
            await self._room_to_commit()  # this worker takes no new job meanwhile
        except Exception as exc:  # a bug of ours must not strand the job forever
            log.exception("internal error running %s of job %s", stage.value, job.job_id)
            if not job.finishing:
                job.finishing = True
                await self._release(job)
                self.finish(job, JobState.FAILED, JobError(
                    "INTERNAL", "INTERNAL", f"{type(exc).__name__}: {exc}", stage), None)
        return False

    def _observe(self, job: LiveJob, stage: Stage, t0: float, outcome: str) -> float:
        elapsed = time.monotonic() - t0
        name = f"{stage.value}_s"
        setattr(job.timings, name, getattr(job.timings, name) + elapsed)
        self._stats[stage].observe(elapsed, outcome == "ok")
        self.metrics.stage_duration(stage, outcome).observe(elapsed)
        return elapsed

    def _progress(self, job: LiveJob, event: str, detail: Mapping[str, Any]) -> None:
        """``ctx.progress`` of every job: a handler's own events (e.g. ``turn``)."""
        if event == "turn":
            job.last_turn = detail  # what a page opened mid-run shows first (the dashboard)
        if job.stage is not None:
            self.delivery.progress(job.client_id, job.job_id, job.stage, event, dict(detail),
                                   time.monotonic() - job.stage_started)

    async def _release(self, job: LiveJob) -> None:
        node = job.node
        if job.ctx is None or node is None:
            return
        job.node = None  # released once, and its slot goes back once
        try:
            await node.release(job.ctx, self.config.cleanup_deadline_s)
        except NodeLost:
            pass  # what the job held went with the node
        finally:
            self.nodes.give_back(node)

    async def _place(self, job: LiveJob) -> bool:
        """Give a job starting INIT a node (waiting while all are full); False if the job was
        cancelled meanwhile (then it is finished here) or if the scheduler is stopping."""
        try:
            job.node = await self.nodes.acquire()
            return True
        except asyncio.CancelledError:
            if job.cancel_reason is None:
                raise
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            job.finishing = True
            self.finish(job, JobState.CANCELLED, self._cancel_error(job), None)
            return False

    def _node_lost(self, job: LiveJob, exc: NodeLost) -> None:
        """The node holding ``job`` died inside a stage: charge a crash and run it again from
        INIT on another node (nothing of it was announced, so nothing is delivered twice)."""
        node = job.node
        job.node = None
        if node is not None:
            self.nodes.remove(node.name, str(exc), node)
            self.nodes.give_back(node)
        self.node_losses += 1
        job.crashes += 1
        job.ctx = None
        log.warning("job %s: %s; crash %d of %d", job.job_id, exc, job.crashes,
                    self.config.max_attempts)
        if job.crashes >= self.config.max_attempts:
            self.finish(job, JobState.FAILED, JobError(
                "INTERNAL", "TOO_MANY_ATTEMPTS",
                f"the node running this job died {job.crashes} times while it was inside a "
                "stage; it is not run again", job.stage), None)
            return
        fut = self.store.recover([(job.job_id, job.crashes)], now())

        def recorded(f: asyncio.Future[Any]) -> None:
            # Not recorded: the job still runs again; a later restart just charges one less.
            if not f.cancelled() and f.exception() is not None:
                log.error("could not record the crash of job %s: %s", job.job_id, f.exception())

        fut.add_done_callback(recorded)
        job.state, job.stage = JobState.QUEUED, None
        # After this task's own clean-up (which clears job.task and frees its slot) has run.
        asyncio.get_running_loop().call_soon(self._requeue, job)

    def _requeue(self, job: LiveJob) -> None:
        if job.cancel_reason is not None and not job.finishing:
            job.finishing = True
            self.finish(job, JobState.CANCELLED, self._cancel_error(job), None)
        elif not job.finishing:
            self.pools[Stage.INIT].push(job)

    # -- ending ------------------------------------------------------------------------------

    def finish(self, job: LiveJob, state: JobState, error: JobError | None,
               reward: Any) -> None:
        """Decide the terminal state now; announce it once it is durable (until then the job
        stays live in the registry, and a failed write is retried)."""
        job.finishing = True
        job.state, job.error = state, error
        if state is JobState.SUCCEEDED:
            term = None
        elif state is JobState.CANCELLED or (error is not None and error.code == "CANCELLED"):
            term = TerminationReason.CANCELLED
        elif error is not None and error.code == "TIMEOUT" and error.stage is Stage.RUN:
            term = TerminationReason.DEADLINE
        else:
            term = TerminationReason.ERROR
        traj = build_trajectory(job.ctx, job.job_id, job.spec.group_id, job.timings, reward, term,
                                state=state, error=error, labels=job.spec.metadata)
        rec = FinishRecord(job.job_id, job.client_id, state, job.stage, error,
                           reward.value if reward is not None else None, job.timings, traj,
                           now())
        job.reward = rec.reward  # the job stays live (and listed from memory) until durable
        to_cancel = self.jobs.groups.job_ended(job, state is JobState.SUCCEEDED)
        if to_cancel is not None:
            self.spawn(self._close_group(job.spec.group_id))
            for other in to_cancel:
                self.cancel(other, GROUP_FINISHED)
        self._commit_finish(job, rec, traj, 0)

    async def _close_group(self, group_id: str) -> None:
        try:
            await self.store.close_group(group_id, GROUP_FINISHED, now())
        except Exception as exc:  # the closure is re-derived from succeeded counts at start
            log.warning("could not persist the closure of group %s: %s", group_id, exc)

    @property
    def precommit_limit(self) -> int:
        """Bytes of built, uncommitted trajectories past which stage workers wait: half of
        ``delivery_memory_bytes``, beside the budget itself (which sessions' undelivered
        trajectories use whole): trajectories in memory stay under one and a half budgets,
        plus one per stage worker."""
        budget = self.delivery.budget
        return budget.total_bytes // 2 if budget is not None else 1 << 62

    async def _room_to_commit(self) -> None:
        """Wait while the trajectories waiting for the store pass :attr:`precommit_limit`:
        environments that produce faster than the store commits then slow to its pace,
        instead of piling trajectories up in memory (the stage queues count jobs, not
        bytes). Each wait is short and re-checked; a cancelled job stops waiting."""
        while self.precommit_bytes > self.precommit_limit and not self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._committed.wait(), 1.0)

    def _precommit(self, size: int) -> None:
        self.precommit_bytes += size
        self.precommit_peak = max(self.precommit_peak, self.precommit_bytes)

    def _committed_one(self, size: int) -> None:
        self.precommit_bytes = max(0, self.precommit_bytes - size)
        self._committed.set()
        self._committed = asyncio.Event()

    def _commit_finish(self, job: LiveJob, rec: FinishRecord, traj: Any, failures: int) -> None:
        """Write the end of ``job``; announce it only once that write committed."""
        if failures == 0:
            self._precommit(_size(traj))
        # Filled by the writer thread before the future resolves (the delivery reuses the
        # bytes the store wrote instead of encoding the trajectory again).
        encoded: list[bytes] = []
        try:
            fut = self.store.finish(rec, encoded=encoded.append)
        except Exception as exc:  # the writer is dead or the store closed: same as a failure
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(exc)
        fut.add_done_callback(
            lambda f: self._finish_written(job, rec, traj, failures, f, encoded))

    def _finish_written(self, job: LiveJob, rec: FinishRecord, traj: Any, failures: int,
                        fut: asyncio.Future[Any], encoded: list[bytes]) -> None:
        exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
        if exc is None:
            self._committed_one(_size(traj))
            self._announce(job, rec, int(fut.result()), traj, encoded[-1] if encoded else b"")
            return
        # Nothing of it is durable (its savepoint or its batch rolled back), so nothing may be
        # announced and no delivery id was used. The job stays live and is written again.
        self.finish_failures += 1
        if self._closing:
            log.error("end of job %s not stored (%s); it runs again after the restart",
                      job.job_id, exc)
            self._committed_one(_size(traj))
            job.mark_done()
            return
        first, longest = self.config.finish_retry_s
        pause = min(longest, first * 2 ** failures)
        log.error("could not store the end of job %s (%s); retrying in %.2fs", job.job_id, exc,
                  pause)

        async def retry() -> None:
            await asyncio.sleep(pause)
            self._commit_finish(job, replace(rec, at=now()), traj, failures + 1)

        self.spawn(retry())

    def _announce(self, job: LiveJob, rec: FinishRecord, delivery_id: int, traj: Any,
                  encoded: bytes = b"") -> None:
        self.jobs.retire(job, rec.state)
        self.metrics.job_finished(rec.state, rec.error.code if rec.error else "",
                                  traj.termination)
        self.delivery.deliver(
            job.client_id, TrajectoryReady(delivery_id, job.job_id, traj, encoded=encoded),
            JobFinished(job.job_id, rec.state, rec.error, rec.reward, delivery_id))
        job.ctx = None
        job.mark_done()

    def cancel(self, job: LiveJob, reason: str) -> bool:
        """Start cancelling a live job wherever it is; False if it is already ending."""
        if job.finishing or job.cancel_reason is not None:
            return False
        job.cancel_reason = reason
        if job.task is not None:
            job.task.cancel()  # the stage task releases resources and finishes the job
        else:
            if job.pool is not None:
                job.pool.remove(job)
            job.finishing = True
            if job.ctx is None:
                self.finish(job, JobState.CANCELLED, self._cancel_error(job), None)
            else:
                self.spawn(self._release_then_cancel(job))
        return True

    async def _release_then_cancel(self, job: LiveJob) -> None:
        await self._release(job)
        self.finish(job, JobState.CANCELLED, self._cancel_error(job), None)

    @staticmethod
    def _cancel_error(job: LiveJob) -> JobError:
        reason = job.cancel_reason or "CANCELLED"
        msg = ("the job's group reached its finish_after count" if reason == GROUP_FINISHED
               else "the job was cancelled")
        return JobError("CANCELLED", reason, msg, job.stage)

    def spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


def _size(traj: Any) -> int:
    return held_bytes(traj) if isinstance(traj, Trajectory) else 0
