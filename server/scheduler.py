"""The three-stage scheduler: INIT -> RUN -> EVAL pools over a durable job store.

Public API (what the servicer calls)::

    store = JobStore(state_dir / "jobs.sqlite3"); await store.open()
    sched = Scheduler(store, registry, llm=pool, sandbox_factory=..., config=PipelineConfig())
    await sched.start()                      # recovers QUEUED/RUNNING jobs from a previous run
    results = await sched.submit(specs, client_id)   # list[SubmitResult]; raises Overloaded
    ids = await sched.cancel(job_id=..., group_id=..., reason="CANCELLED_BY_CLIENT")
                                             # raises JobNotFound / NotCancellable for a job id
    rec = await sched.get(job_id)            # JobRecord | None (history=True adds transitions)
    traj = await sched.get_trajectory(job_id)
    recs, token = await sched.list(page_size, page_token, state=, group_id=, client_id=,
                                   owner=)
    sub = await sched.attach(client_id, acked_through=0, max_unacked=0, progress=True)
    async for event in sub: ...              # JobAccepted | StageProgress | TrajectoryReady
                                             # | JobFinished (server/pipeline/subscription.py)
    await sched.ack(client_id, [delivery_id, ...], through=0); await sub.close()
    sched.client_stats(client_id)            # {"in_flight": n, "unacked": m}
    sched.status() -> SchedulerStatus        # server/metrics.py
    stats = await sched.prune()              # one retention pass now; it also runs every
                                             # prune_interval_s (server/pipeline/retention.py)
    sched.metrics_registry; sched.serve_metrics(host, port)
    await sched.stop(grace_s); await store.close()

Decisions:
- Every terminal job (SUCCEEDED, FAILED, CANCELLED) produces one durable delivery: a
  TrajectoryReady (failed/cancelled ones with reward 0, the turns RUN produced if it finished,
  termination ERROR/DEADLINE/CANCELLED) immediately followed by JobFinished with the state and
  typed error. One delivery per accepted job keeps a trainer's accounting trivial.
- submit() returns per-job results: one bad job does not reject its batch. The pending cap and the
  per-client cap reject the whole batch with Overloaded (RESOURCE_EXHAUSTED).
- cancel() waits (bounded by the cleanup deadline) until the cancelled jobs are terminal and their
  resources are freed, unless ``wait=False``. Cancelling a group also closes it: jobs of that
  group submitted while any of its jobs is live are cancelled at once, like jobs of a group that
  reached ``finish_after``. A group with no live job is not closed (its id is free again); one
  no job ever had is NOT_FOUND / GROUP_NOT_FOUND (server/pipeline/groups.py).
- ``attempts`` counts INIT starts. ``crashes`` counts process deaths while the job was inside a
  stage; at ``max_attempts`` crashes the job fails with INTERNAL / TOO_MANY_ATTEMPTS instead of
  crash-looping the server. Waiting in a queue during a crash and graceful stops are free.
- Submit is atomic with respect to its caller: the commit and the adoption by the pools run in
  a task shielded from the caller's cancellation, so a client that goes away mid-commit leaves
  jobs that run (and a re-submit answers duplicate for a job that really is live). A job found
  stored-but-not-live (a duplicate answer for an id nobody runs, or after a failed commit) is
  adopted by a sweep, as start() adopts every live row.
- Errors map through server/api/errors.py: Overloaded -> RESOURCE_EXHAUSTED, JobNotFound ->
  NOT_FOUND, NotCancellable -> FAILED_PRECONDITION, submit while stopping -> UNAVAILABLE,
  per-job InvalidArgument inside SubmitResult.error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from rollout.runtime.gateway import ModelGateway
from rollout.runtime.handler import HandlerRegistry
from rollout.runtime.llm import LLMClient
from rollout.runtime.types import InvalidArgument, JobError, JobSpec, JobState
from rollout.server.api.errors import (
    FailedPrecondition,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from rollout.server.cluster.node import LocalNode, NodeSet
from rollout.server.metrics import SchedulerMetrics, SchedulerStatus
from rollout.server.pipeline.delivery import Delivery
from rollout.server.pipeline.delivery_budget import DeliveryBudget
from rollout.server.pipeline.groups import GROUP_FINISHED
from rollout.server.pipeline.job_registry import JobRegistry
from rollout.server.pipeline.records import SubmitResult, record_from_live
from rollout.server.pipeline.retention import Retention
from rollout.server.pipeline.runner import PipelineConfig, StageRunner
from rollout.server.pipeline.stage_pool import LiveJob
from rollout.server.pipeline.subscription import (
    JobAccepted,
    JobFinished,
    Subscription,
    TrajectoryReady,
)
from rollout.server.store import GroupTaken, JobRecord, JobStore, PruneStats, now

# The session's event types live in server/pipeline/subscription.py (the servicer and
# server/api/stream_events.py import them there). JobFinished and TrajectoryReady stay listed
# because benchmarks/pipeline.py still imports them from here.
__all__ = [
    "GROUP_FINISHED", "JobFinished", "JobNotFound", "JobRecord", "NotCancellable",
    "Overloaded", "PipelineConfig", "Scheduler", "SubmitResult", "Subscription",
    "TrajectoryReady",
]

log = logging.getLogger(__name__)


class Overloaded(ResourceExhausted):
    """Too many unfinished jobs (server-wide or for this client). RESOURCE_EXHAUSTED."""

    default_reason = "SERVER_OVERLOADED"


def group_id_taken(group_id: str) -> PermissionDenied:
    return PermissionDenied(f"group_id {group_id[:40]!r} is used by another client; choose "
                            "another id", "GROUP_ID_TAKEN", "group.group_id")


class JobNotFound(NotFound):
    default_reason = "JOB_NOT_FOUND"


class NotCancellable(FailedPrecondition):
    """The job already reached (or is committing) a terminal state."""

    default_reason = "JOB_ALREADY_FINISHED"


class Scheduler:
    """The public API of the pipeline: a thin facade over three parts that each own their state.

    - :class:`~rollout.server.pipeline.job_registry.JobRegistry` (``jobs``): which jobs are
      live, the caps' counts, groups. Admission, cancellation, queries and status all read the
      same one.
    - :class:`~rollout.server.pipeline.runner.StageRunner` (``pipeline``): pools, nodes, stage
      tasks, terminal writes; it retires jobs in the registry and emits events into delivery.
    - :class:`~rollout.server.pipeline.delivery.Delivery` (``delivery``): sessions, acks,
      replay and re-delivery.

    The facade owns only what spans them: running/stopping, submits in flight, retention,
    metrics, and the resources stage work runs with (``registry``, ``llm``,
    ``sandbox_factory``: tests and the server may swap them after construction, and the local
    node reads them from here). Its public methods and attributes are what the servicers, the
    app, the cluster code and the benchmarks use; keep their names and signatures.
    """

    def __init__(self, store: JobStore, registry: HandlerRegistry, *,
                 llm: LLMClient | None = None,
                 sandbox_factory: Callable[..., Awaitable[Any]] | None = None,
                 config: PipelineConfig | None = None, nodes: NodeSet | None = None) -> None:
        self.store = store
        self.registry = registry
        self.llm = llm
        self.sandbox_factory = sandbox_factory
        self.gateway: ModelGateway | None = None
        """The model gateway harness environments reach their model through (set by the
        server; None in schedulers built without one)."""
        self.config = cfg = config or PipelineConfig()
        self._started_at = time.monotonic()
        self._running = False
        self._stopping = False
        self._tasks: set[asyncio.Task[Any]] = set()
        """Submit commits and sweeps in flight (a shutdown waits for them)."""
        self.metrics = SchedulerMetrics(self.status)
        self.jobs = JobRegistry(
            on_group_reopen=lambda gid: self._spawn(self.store.reopen_group(gid)))
        self.delivery = Delivery(store, replay_page=cfg.replay_page, budget=DeliveryBudget(
            cfg.delivery_memory_bytes, cfg.session_memory_bytes))
        self.pipeline = StageRunner(
            store, self.jobs, self.delivery, self.metrics,
            nodes if nodes is not None else NodeSet.single(LocalNode(self)), cfg)
        self.retention = Retention(store, retention_s=cfg.retention_s,
                                   job_retention_s=cfg.job_retention_s,
                                   interval_s=cfg.prune_interval_s)

    @property
    def nodes(self) -> NodeSet:
        """Where stage work runs (server/cluster/)."""
        return self.pipeline.nodes

    @property
    def node_losses(self) -> int:
        """Jobs sent back to INIT because the node holding them died."""
        return self.pipeline.node_losses

    @property
    def finish_failures(self) -> int:
        """Terminal writes that failed and were retried (not announced)."""
        return self.pipeline.finish_failures

    @property
    def _live(self) -> dict[str, LiveJob]:
        """The live jobs by id, read-only (``rollout bench scale`` and the cluster tests look
        for a job on a given node to kill it under)."""
        return self.jobs.live

    @property
    def metrics_registry(self) -> Any:
        return self.metrics.registry

    def serve_metrics(self, host: str, port: int) -> Any:
        """Serve ``/metrics`` on ``host:port``; returns prometheus' (server, thread) pair."""
        return self.metrics.serve(host, port)

    def client_stats(self, client_id: str) -> dict[str, int]:
        """Unfinished jobs of a client and its deliveries not yet acknowledged (sent or held).

        Lets a servicer tell when the server owes a half-closed session nothing more.
        """
        unacked, held_back = self.delivery.unacked(client_id)
        return {"in_flight": self.jobs.in_flight(client_id), "unacked": unacked,
                "held_back": held_back}

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Recover: jobs left QUEUED or RUNNING by a previous process run again from INIT."""
        self.jobs.groups.load_closed(await self.store.closed_groups())
        stored = await self.store.live_jobs()
        crashed = await self._adopt_stored(stored)
        self._running = True
        for gid in self.jobs.groups.drop_idle():  # closures whose jobs all ended: ids free
            await self.store.reopen_group(gid)
        if stored:
            log.info("recovered %d unfinished jobs (%d crashed inside a stage)", len(stored),
                     crashed)
        self.retention.start()

    async def _adopt_stored(self, stored: Sequence[JobRecord]) -> int:
        """Make stored QUEUED/RUNNING jobs live: charge a crash to those that were inside a
        stage, fail those at ``max_attempts`` crashes, queue the rest. Returns the crashes."""
        stored = [s for s in stored
                  if s.job_id not in self.jobs and not self.jobs.committing(s.job_id)]
        if not stored:
            return 0
        counts = await self.store.succeeded_counts(sorted({s.group_id for s in stored}))
        crashes = {s.job_id: s.crashes + s.in_stage for s in stored}
        interrupted = [(s.job_id, crashes[s.job_id]) for s in stored
                       if s.state is JobState.RUNNING or s.in_stage]
        if interrupted:
            await self.store.recover(interrupted, now())
        for s in stored:
            if s.job_id in self.jobs:  # adopted by someone else while we awaited
                continue
            job = LiveJob(spec=s.spec, client_id=s.client_id, seq=s.seq, created_at=s.created_at,
                          attempts=s.attempts, crashes=crashes[s.job_id],
                          updated_at=s.updated_at)
            self.jobs.adopt(job, counts.get(s.group_id, 0))
            if crashes[s.job_id] >= self.config.max_attempts:
                self.pipeline.finish(job, JobState.FAILED, JobError(
                    "INTERNAL", "TOO_MANY_ATTEMPTS",
                    f"the server died {crashes[s.job_id]} times while this job was inside a "
                    "stage; it is not run again", None), None)
            elif (reason := self.jobs.groups.closed_reason(s.group_id)) is not None:
                self.pipeline.cancel(job, reason)
            else:
                self.pipeline.queue(job)
        return sum(1 for s in stored if s.in_stage)

    async def sweep(self, job_ids: Sequence[str] | None = None) -> int:
        """Adopt jobs that are stored QUEUED/RUNNING but not live in this process (all, or
        those of ``job_ids``); returns how many. Runs after failed commits and for duplicate
        answers nobody runs, so a job the store holds is never left stranded."""
        if not self._running or self._stopping:
            return 0
        stored = await self.store.live_jobs(job_ids)
        before = len(self.jobs)
        await self._adopt_stored(stored)
        adopted = len(self.jobs) - before
        if adopted:
            log.warning("adopted %d stored jobs that were not running", adopted)
        return adopted

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop starting stages, let running ones finish within ``grace_s``, then cancel them.

        Interrupted jobs are not marked terminal: they stay QUEUED/RUNNING in the store and run
        again on the next start(), without being charged a crash. Their resources are released
        either way.
        """
        if self._stopping:
            return
        self._stopping = True
        await self.retention.stop()
        await self.pipeline.drain(grace_s, also=self._tasks)
        # A graceful stop is not a crash: the jobs it interrupted are not charged for it.
        unfinished = list(self.jobs.live)
        try:
            fut = self.store.record_waiting(unfinished) if unfinished else None
            if fut is not None:
                await fut
            await self.store.flush()
        except Exception as exc:
            log.error("could not record the graceful stop in the job store: %s", exc)
        self.delivery.close_all()
        self._running = False

    # -- submit ------------------------------------------------------------------------------

    async def submit(self, specs: Sequence[JobSpec], client_id: str, *,
                     own_groups: bool = False) -> list[SubmitResult]:
        """Validate, commit, then queue. Returns after the accepted jobs are durable.

        Validation comes before any look at existing jobs, so a request that could never be
        accepted (an unknown environment, a bad task) gets the same answer whether its ids
        exist or not. ``own_groups``: a job whose group already holds another owner's job is
        refused (GROUP_ID_TAKEN), decided in the store's insert transaction.
        """
        if not self._running or self._stopping:
            raise Unavailable("the scheduler is not running", "SHUTTING_DOWN")
        results: list[SubmitResult | None] = [None] * len(specs)
        fresh: list[int] = []
        for i, spec in enumerate(specs):
            try:
                self.validate(spec)
            except InvalidArgument as exc:
                results[i] = SubmitResult(spec.job_id, error=exc)
                continue
            if spec.job_id in self.jobs:
                results[i] = SubmitResult(spec.job_id, duplicate=True)
                self.delivery.emit(client_id, JobAccepted(spec.job_id, duplicate=True))
                continue
            fresh.append(i)
        n = len(fresh)
        cfg = self.config
        if n and self.jobs.pending + n > cfg.max_pending_jobs:
            raise Overloaded(f"{self.jobs.pending} unfinished jobs; the server takes at most "
                             f"{cfg.max_pending_jobs}. Retry after some finish.")
        mine = self.jobs.in_flight(client_id)
        if n and cfg.max_in_flight_per_client and mine + n > cfg.max_in_flight_per_client:
            raise Overloaded(f"client {client_id!r} has {mine} unfinished jobs; at most "
                             f"{cfg.max_in_flight_per_client} allowed", "CLIENT_OVERLOADED")
        # Reserve before awaiting the commit so concurrent submits cannot overshoot the caps.
        self.jobs.reserve(client_id, n)
        # The commit and the adoption run in their own task: a caller cancelled mid-commit (its
        # stream went away) must not leave jobs stored but never scheduled.
        commit = asyncio.ensure_future(self._commit_and_adopt(specs, fresh, results, client_id,
                                                              own_groups))
        self._tasks.add(commit)
        commit.add_done_callback(self._commit_done)
        await asyncio.shield(commit)
        return [r for r in results if r is not None]

    async def _commit_and_adopt(self, specs: Sequence[JobSpec], fresh: list[int],
                                results: list[SubmitResult | None], client_id: str,
                                own_groups: bool = False) -> None:
        ids = [specs[i].job_id for i in fresh]
        self.jobs.begin_commit(ids)
        try:
            await self._commit_jobs(specs, fresh, results, client_id, own_groups)
        finally:
            self.jobs.end_commit(ids)
        orphans = [r.job_id for i in fresh if (r := results[i]) is not None and r.duplicate
                   and r.job_id not in self.jobs and not self.jobs.committing(r.job_id)]
        if orphans:  # stored earlier, live nowhere (e.g. a commit whose adoption was lost)
            await self.sweep(orphans)

    async def _commit_jobs(self, specs: Sequence[JobSpec], fresh: list[int],
                           results: list[SubmitResult | None], client_id: str,
                           own_groups: bool = False) -> None:
        try:
            seqs = await self.store.insert_jobs([(specs[i], client_id) for i in fresh], now(),
                                                own_groups=own_groups)
        except BaseException:
            self.jobs.unreserve(client_id, len(fresh))
            # Whether or not any of it reached the disk, a sweep adopts what did.
            self._spawn(self._sweep_quietly())
            raise
        created = now()
        for i, seq in zip(fresh, seqs, strict=True):
            spec = specs[i]
            if isinstance(seq, GroupTaken):  # another tenant committed this group id first
                self.jobs.unreserve(client_id, 1)
                results[i] = SubmitResult(spec.job_id, error=group_id_taken(seq.group_id))
                continue
            if seq is None:  # lost the race to an earlier submit of the same id
                self.jobs.unreserve(client_id, 1)
                results[i] = SubmitResult(spec.job_id, duplicate=True)
                self.delivery.emit(client_id, JobAccepted(spec.job_id, duplicate=True))
                continue
            results[i] = SubmitResult(spec.job_id)
            job = LiveJob(spec=spec, client_id=client_id, seq=seq, created_at=created,
                          updated_at=created)
            self.jobs.adopt(job, 0, counted=True)
            self.metrics.jobs_submitted.inc()
            self.delivery.emit(client_id, JobAccepted(spec.job_id))
            reason = self.jobs.groups.closed_reason(spec.group_id) if spec.group_id else None
            if reason is not None:
                self.pipeline.cancel(job, reason)
            else:
                self.pipeline.queue(job)

    def _commit_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Also seen by the caller if it is still there; logged for the one that went away.
            log.warning("submit commit failed: %s", task.exception())

    async def _sweep_quietly(self) -> None:
        try:
            await self.sweep()
        except Exception as exc:  # the store is still failing; the next failure sweeps again
            log.warning("sweep for stranded jobs failed: %s", exc)

    def validate(self, spec: JobSpec) -> None:
        """Raise InvalidArgument (UNKNOWN_ENVIRONMENT is NOT_FOUND) unless ``spec`` could run
        here; looks at no existing job."""
        handler = self.registry.get(spec.environment)  # raises UNKNOWN_ENVIRONMENT
        spec.sampling.validate()
        spec.limits.validate()
        if spec.group is not None:
            g = spec.group
            if not g.group_id:
                raise InvalidArgument("group.group_id must not be empty", "INVALID_GROUP",
                                      "group.group_id")
            if g.finish_after < 0 or g.size < 0:
                raise InvalidArgument("group.size and group.finish_after must be >= 0",
                                      "INVALID_GROUP", "group.finish_after")
        handler.validate_task(spec.task)

    # -- cancel ------------------------------------------------------------------------------

    async def cancel(self, job_id: str | None = None, group_id: str | None = None,
                     reason: str = "CANCELLED_BY_CLIENT", *, wait: bool = True) -> list[str]:
        """Cancel one job and/or a whole group; returns the ids actually cancelled."""
        jobs: list[LiveJob] = []
        if job_id:
            job = self.jobs.get(job_id)
            if job is None or job.finishing:
                if job is None and await self.store.get(job_id) is None:
                    raise JobNotFound(f"no job with id {job_id!r}")
                raise NotCancellable(f"job {job_id!r} already finished")
            jobs.append(job)
        if group_id:
            if not self.jobs.groups.has_live(group_id):
                # Nothing to stop and nothing to close: the id is free for a new group.
                if not await self.store.group_exists(group_id):
                    raise NotFound(f"no job ever had group_id {group_id!r}",
                                   "GROUP_NOT_FOUND", "group_id")
            else:
                jobs += [j for j in self.jobs.groups.close(group_id, reason) if j not in jobs]
                await self.store.close_group(group_id, reason, now())
        waits = [j.wait_done() for j in jobs if not j.finishing] if wait else []
        ids = [j.job_id for j in jobs if self.pipeline.cancel(j, reason)]
        if waits:
            await asyncio.gather(*waits)
        return ids

    # -- queries -----------------------------------------------------------------------------

    async def get(self, job_id: str, *, history: bool = False) -> JobRecord | None:
        job = self.jobs.get(job_id)
        hist = tuple(await self.store.history(job_id)) if history else ()
        if job is not None:
            return replace(record_from_live(job), history=hist)
        stored = await self.store.get(job_id)
        return replace(stored, history=hist) if stored else None

    async def get_trajectory(self, job_id: str) -> Any:
        if job_id in self.jobs:
            return None
        return await self.store.get_trajectory(job_id)

    async def list(self, page_size: int = 100, page_token: str = "", *,
                   state: JobState | None = None, group_id: str | None = None,
                   client_id: str | None = None,
                   owner: str | None = None) -> tuple[list[JobRecord], str]:
        """Jobs in submission order; ``next_page_token`` is "" on the last page. ``owner``
        keeps a client's jobs, its SubmitRollout ones included (``JobStore.list_jobs``)."""
        # Tokens are seqs (SQLite rowids): ASCII digits below 2**63. A longer number would
        # overflow SQLite's integer in the query and come back as INTERNAL.
        if page_token and not (page_token.isascii() and page_token.isdigit()
                               and int(page_token) < 1 << 63):
            raise InvalidArgument("page_token is not one this server issued",
                                  "INVALID_PAGE_TOKEN", "page_token")
        after = int(page_token) if page_token else 0
        size = max(1, min(page_size or 100, 1000))
        rows = await self.store.list_jobs(after_seq=after, limit=size + 1, state=state,
                                          group_id=group_id, client_id=client_id,
                                          owner=owner)
        more = len(rows) > size
        rows = rows[:size]
        out = []
        for r in rows:
            live = self.jobs.get(r.job_id)
            rec = record_from_live(live) if live is not None else r
            if state is None or rec.state is state:  # the row may lag the live state
                out.append(rec)
        return out, (str(rows[-1].seq) if more else "")

    # -- sessions ----------------------------------------------------------------------------

    async def attach(self, client_id: str, acked_through: int = 0, *,
                     max_unacked: int = 0, progress: bool = True) -> Subscription:
        """Subscribe a client: replay its unacknowledged deliveries, then live events.

        ``progress=False`` leaves StageProgress events out (a trainer that only wants results
        saves the server most of its per-job event work).
        """
        return await self.delivery.attach(client_id, acked_through, max_unacked=max_unacked,
                                          progress=progress)

    async def ack(self, client_id: str, delivery_ids: Sequence[int] = (),
                  through: int = 0) -> None:
        await self.delivery.ack(client_id, delivery_ids, through)

    async def redeliver(self, job_id: str,
                        client_id: str) -> tuple[int, Callable[[], None] | None] | None:
        """Prepare a finished job's stored trajectory for ``client_id`` again (a re-submit with
        the REPLAY policy). Returns the delivery id and a function that announces it to the
        client's session (call it once the caller has answered the submit, so the answer
        comes first); None when retention already deleted the trajectory. A delivery of the
        job to this client that is still unacknowledged is the answer already (it is sent or
        replayed as usual), so none is added beside it: its id comes back with no function."""
        return await self.delivery.redeliver(job_id, client_id)

    async def prune(self) -> PruneStats:
        """Run one retention pass now (acked trajectories past ``retention_s``, then job rows
        past ``job_retention_s``); a no-op when ``retention_s`` is 0."""
        return await self.retention.run_once()

    # -- status ------------------------------------------------------------------------------

    def status(self) -> SchedulerStatus:
        return SchedulerStatus(
            stages=self.pipeline.stage_status(), jobs_by_state=self.jobs.by_state(),
            pending=self.jobs.pending, max_pending=self.config.max_pending_jobs,
            sessions=self.delivery.sessions, uptime_s=time.monotonic() - self._started_at,
            window_s=self.config.status_window_s,
            jobs_by_termination=dict(self.metrics.terminations),
            delivery_memory=(self.delivery.budget.stats()
                             if self.delivery.budget is not None else None),
            starved_sessions=self.delivery.starved_sessions)
