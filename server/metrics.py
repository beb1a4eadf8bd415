"""Pipeline observability: an in-memory status snapshot and Prometheus metrics.

Why both: the status snapshot answers ``GetServerStatus`` without a metrics stack (p50/p95 and
recent throughput per stage, computed from small ring buffers), and Prometheus gets the same
numbers as histograms and counters for dashboards. Each server instance owns its own
``CollectorRegistry`` so several servers (tests, benchmarks) can live in one process. Gauges that
describe current state (queue depth, in-flight) are read from the scheduler at scrape time by a
custom collector, so the hot path never updates them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rollout.runtime.types import JobState, Stage, TerminationReason
from rollout.server.pipeline.delivery_budget import BudgetStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
                    120, 300, 600, 1800)


@dataclass(frozen=True)
class StageStatus:
    """One stage pool at one instant."""

    stage: Stage
    workers: int
    queue_depth: int
    """Jobs waiting for a worker of this stage."""
    in_flight: int
    """Jobs this stage's workers hold (running, or finished and waiting for room downstream)."""
    completed: int
    """Stage executions that succeeded since the server started."""
    failed: int
    """Stage executions that failed, timed out or were cancelled since the server started."""
    latency_p50_s: float
    latency_p95_s: float
    throughput_per_s: float
    """Completed executions per second over the last ``window_s`` seconds."""


@dataclass(frozen=True)
class SchedulerStatus:
    """What ``GetServerStatus`` reports about the pipeline."""

    stages: tuple[StageStatus, ...]
    jobs_by_state: dict[JobState, int]
    """Live jobs (QUEUED, RUNNING) now, terminal jobs finished since this process started."""
    pending: int
    """Accepted jobs not yet terminal (counts against ``max_pending_jobs``)."""
    max_pending: int
    sessions: int
    """Attached client subscriptions."""
    uptime_s: float
    window_s: float
    jobs_by_termination: dict[TerminationReason, int] = field(default_factory=dict)
    """Jobs finished since this process started, by their trajectory's termination reason
    (``GetServerStatusResponse.jobs_by_termination``)."""
    delivery_memory: BudgetStats | None = None
    """Memory held by trajectories not yet written to their clients, and its limits."""
    starved_sessions: int = 0
    """Sessions whose deliveries wait in the store because their memory share is full."""


@dataclass
class StageStats:
    """Counters and ring buffers for one stage; cheap enough to update per job."""

    window_s: float = 30.0
    completed: int = 0
    failed: int = 0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    _buckets: deque[list[int]] = field(default_factory=deque)
    """[second, count] pairs for the throughput window."""

    def observe(self, seconds: float, ok: bool, now: float | None = None) -> None:
        if ok:
            self.completed += 1
            sec = int(now if now is not None else time.monotonic())
            if self._buckets and self._buckets[-1][0] == sec:
                self._buckets[-1][1] += 1
            else:
                self._buckets.append([sec, 1])
                self._trim(sec)
        else:
            self.failed += 1
        self.latencies.append(seconds)

    def _trim(self, sec: int) -> None:
        while self._buckets and self._buckets[0][0] <= sec - self.window_s:
            self._buckets.popleft()

    def throughput(self, now: float | None = None) -> float:
        sec = int(now if now is not None else time.monotonic())
        self._trim(sec)
        return sum(n for s, n in self._buckets if s < sec + 1) / self.window_s

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return 0.0
        data = sorted(self.latencies)
        return data[min(len(data) - 1, int(q * len(data)))]


class SchedulerMetrics:
    """Prometheus instruments of one scheduler, in a registry of its own."""

    def __init__(self, status: Callable[[], SchedulerStatus]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.stage_seconds = Histogram(
            "rollout_stage_duration_seconds", "Time spent inside a stage, per execution.",
            ["stage", "outcome"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.queue_seconds = Histogram(
            "rollout_stage_queue_seconds", "Time a job waited for a stage worker.",
            ["stage"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.jobs_finished = Counter(
            "rollout_jobs_finished", "Jobs that reached a terminal state.", ["state", "code"],
            registry=self.registry)
        self.jobs_submitted = Counter(
            "rollout_jobs_submitted", "Jobs accepted (duplicates excluded).",
            registry=self.registry)
        # By state alone a job whose agent loop ran out of time looks like a clean success
        # (the loop stops before the stage deadline and EVAL scores what it left): counting
        # by termination reason as well keeps those apart on a dashboard.
        self.jobs_terminated = Counter(
            "rollout_jobs_terminated",
            "Jobs that reached a terminal state, by how their trajectory ended (reason: "
            "submitted, no_tool_call, max_turns, token_budget, context_length, deadline, "
            "cancelled, error) and by terminal state.", ["reason", "state"],
            registry=self.registry)
        self.terminations: dict[TerminationReason, int] = {}
        """Jobs finished since this process started, by termination reason (the status
        snapshot's ``jobs_by_termination``)."""
        self.registry.register(_StatusCollector(status))
        self._children: dict[tuple[str, ...], Any] = {}

    def job_finished(self, state: JobState, error_code: str,
                     termination: TerminationReason) -> None:
        """Count one terminal job by state (and error code) and by termination reason."""
        key = ("f", state.value, error_code)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.jobs_finished.labels(state.value, error_code)
        child.inc()
        key = ("t", termination.value, state.value)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.jobs_terminated.labels(termination.value,
                                                                      state.value)
        child.inc()
        self.terminations[termination] = self.terminations.get(termination, 0) + 1

    # Label lookups take a lock and build a tuple; cache the children for the hot path.
    def stage_duration(self, stage: Stage, outcome: str) -> Any:
        key = ("d", stage.value, outcome)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.stage_seconds.labels(stage.value, outcome)
        return child

    def queue_wait(self, stage: Stage) -> Any:
        key = ("q", stage.value)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.queue_seconds.labels(stage.value)
        return child

    def serve(self, host: str, port: int) -> Any:
        """Expose ``/metrics`` over HTTP from a daemon thread; returns (server, thread)."""
        return start_http_server(port, addr=host, registry=self.registry)


class _StatusCollector(Collector):
    """Scrape-time gauges from the status snapshot, so the hot path never sets gauges.

    ``describe`` names the families without taking a snapshot: the registry asks for the names
    when the collector is registered, which happens while the scheduler is still being built.
    """

    def __init__(self, status: Callable[[], SchedulerStatus]) -> None:
        self._status = status

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily]:
        by_stage = ["stage"]
        return {
            "depth": GaugeMetricFamily("rollout_stage_queue_depth",
                                       "Jobs waiting for a stage worker.", labels=by_stage),
            "flight": GaugeMetricFamily("rollout_stage_in_flight",
                                        "Jobs held by a stage's workers.", labels=by_stage),
            "workers": GaugeMetricFamily("rollout_stage_workers", "Configured workers per stage.",
                                         labels=by_stage),
            "tput": GaugeMetricFamily("rollout_stage_throughput_per_second",
                                      "Completed stage executions per second, recent window.",
                                      labels=by_stage),
            "jobs": GaugeMetricFamily("rollout_jobs", "Live jobs by state.", labels=["state"]),
            "pending": GaugeMetricFamily("rollout_pending_jobs",
                                         "Accepted jobs not yet terminal.", labels=[]),
            "sessions": GaugeMetricFamily("rollout_sessions", "Attached client sessions.",
                                          labels=[]),
            "held": GaugeMetricFamily(
                "rollout_delivery_memory_bytes",
                "Estimated memory of trajectories not yet written to their clients, all "
                "sessions together.", labels=[]),
            "held_peak": GaugeMetricFamily(
                "rollout_delivery_memory_peak_bytes",
                "Highest rollout_delivery_memory_bytes since the server started.", labels=[]),
            "limit": GaugeMetricFamily(
                "rollout_delivery_memory_limit_bytes",
                "pipeline.delivery_memory_bytes (scope=total) and session_memory_bytes "
                "(scope=session).", labels=["scope"]),
            "starved": GaugeMetricFamily(
                "rollout_sessions_over_memory_share",
                "Sessions whose deliveries wait in the store because their memory share (or "
                "the total) is full.", labels=[]),
        }

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families().values()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        st = self._status()
        f = self._families()
        for s in st.stages:
            f["depth"].add_metric([s.stage.value], s.queue_depth)
            f["flight"].add_metric([s.stage.value], s.in_flight)
            f["workers"].add_metric([s.stage.value], s.workers)
            f["tput"].add_metric([s.stage.value], s.throughput_per_s)
        for state in (JobState.QUEUED, JobState.RUNNING):
            f["jobs"].add_metric([state.value], st.jobs_by_state.get(state, 0))
        f["pending"].add_metric([], st.pending)
        f["sessions"].add_metric([], st.sessions)
        if (mem := st.delivery_memory) is not None:
            f["held"].add_metric([], mem.held)
            f["held_peak"].add_metric([], mem.peak)
            f["limit"].add_metric(["total"], mem.total_bytes)
            f["limit"].add_metric(["session"], mem.session_bytes)
        f["starved"].add_metric([], st.starved_sessions)
        yield from f.values()
