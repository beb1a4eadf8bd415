"""Trainer-side batching over one session: DAPO dynamic sampling, staleness bound, early stop.

A GRPO/DAPO trainer wants, per step, ``groups_per_batch`` prompt groups of ``group_size``
samples whose rewards differ (a group whose rewards are all equal has zero advantage everywhere:
it costs compute and teaches nothing). :class:`GroupBatcher` keeps ``max_in_flight_groups``
groups running on the server, refills from the dataset as groups finish, and hands out a batch
as soon as enough *kept* groups are complete. What it guarantees:

- **Dynamic sampling.** A complete group is kept only if its rewards are not all equal and at
  least ``min_group_size`` of its samples are usable; others are dropped and counted. Sampling
  goes on until the batch is full or ``max_rounds`` generation rounds (``groups_per_batch``
  prompt groups each, as in DAPO's ``max_num_gen_batches``) have been spent; then the batch is
  returned short and says so (``stats.partial``).
- **Early termination.** Once a batch is full, open groups beyond ``prefetch_groups`` are
  cancelled on the server (group cancellation frees their sandboxes and in-flight LLM turns);
  their samples are counted as ``cancelled_samples`` and their prompts go back to the front of
  the queue (they were never trained on). With ``max_staleness == 0`` nothing
  generated now could be used by the next step, so the default prefetch is 0 then.
- **Staleness bound.** Every sample records the policy version of each turn. A sample whose
  oldest turn is more than ``max_staleness`` versions behind the trainer's current version
  (:meth:`GroupBatcher.set_policy_version`) is dropped and counted, both when its group
  completes and again when a waiting group is put into a batch, so no batch ever holds a sample
  older than the bound. New jobs are submitted with ``min_policy_version`` = current - bound,
  so the server never starts them on weights that are already too old.
- **Acknowledgement.** A trajectory is acknowledged only when it is put into a returned batch
  or deliberately dropped (filtered, stale, failed, cancelled). Anything not yet acknowledged is
  replayed by the server after a reconnect or a restart with the same client id.

A failed or cancelled job is never scored as reward 0: it is left out of its group (a grader
crash must not read as a wrong answer).

Everything a trainer needs to build tensors is in :class:`Sample` (token ids, loss mask,
rollout logprobs, per-token and per-turn policy versions, prompt length); the batcher imports
no tensor library, so any trainer can use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout.client.session import Session
from rollout.client.specs import SpecLike, group_specs, job_spec
from rollout.client.trajectory import Flat, flatten_segments
from rollout.v1 import job_pb2, trajectory_pb2
from rollout.v1 import rollout_service_pb2 as pb


@dataclass(frozen=True)
class BatcherConfig:
    """How many groups to keep running and how to filter them."""

    groups_per_batch: int = 8
    """Kept groups a batch should hold."""
    group_size: int = 8
    """Samples per prompt."""
    max_in_flight_groups: int = 0
    """Groups running on the server at once; 0 means ``groups_per_batch``."""
    max_rounds: int = 3
    """Most generation rounds (``groups_per_batch`` prompt groups each) spent on one batch."""
    max_staleness: int = 0
    """Most policy versions a sample's oldest turn may lag behind the trainer's version."""
    prefetch_groups: int | None = None
    """Open groups left running when a batch fills (for the next batch); None means
    ``max_in_flight_groups`` when ``max_staleness > 0``, else 0 (they would be stale)."""
    min_group_size: int = 2
    """A group with fewer usable samples (after failures and staleness) is dropped."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal (DAPO). Off: keep every usable group."""
    batch_timeout_s: float | None = None
    """Raise TimeoutError when no progress towards a batch happens for this long."""
    run_id: str = ""
    """Prefix of group ids (unique per training run); empty picks a random one."""

    def __post_init__(self) -> None:
        for name in ("groups_per_batch", "group_size", "max_rounds", "min_group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"BatcherConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0 or self.max_in_flight_groups < 0:
            raise ValueError("BatcherConfig.max_staleness and max_in_flight_groups must be >= 0")
        if self.min_group_size > self.group_size:
            raise ValueError(f"min_group_size ({self.min_group_size}) exceeds group_size "
                             f"({self.group_size})")

    @property
    def in_flight(self) -> int:
        return self.max_in_flight_groups or self.groups_per_batch

    @property
    def prefetch(self) -> int:
        if self.prefetch_groups is not None:
            return self.prefetch_groups
        return self.in_flight if self.max_staleness > 0 else 0


@dataclass(frozen=True)
class Sample:
    """One trajectory, ready for tensors."""

    job_id: str
    delivery_id: int
    flat: Flat
    """Aligned per-token lists: ``token_ids``, ``loss_mask``, ``logprobs``, ``policy_versions``.
    For a trajectory of several token sequences (a harness that rewrote its history), the
    last one: the sequence that ends the episode."""
    turn_versions: tuple[int, ...]
    """Policy version of each turn, in order."""
    finish_reasons: tuple[str, ...]
    """Per turn: ``stop``, ``length``, ..."""
    segments: tuple[Flat, ...] = ()
    """Every token sequence of the trajectory, in order (``flat`` is the last); empty means
    ``flat`` is the whole trajectory. Each is one training sequence with the sample's reward."""
    tool_calls: tuple[int, ...] = ()
    """Per turn: how many tool calls the model made in it."""

    @property
    def flats(self) -> tuple[Flat, ...]:
        """The training sequences of this sample: ``segments``, or ``(flat,)``."""
        return self.segments or (self.flat,)

    @property
    def reward(self) -> float:
        return self.flat.reward

    @property
    def min_version(self) -> int:
        return min(self.turn_versions, default=0)

    @property
    def response_length(self) -> int:
        """Tokens after the shared prompt (what the overlong shaping measures)."""
        return len(self.flat.token_ids) - self.flat.prompt_length

    @property
    def generated_tokens(self) -> int:
        return sum(sum(f.loss_mask) for f in self.flats)


@dataclass(frozen=True)
class Group:
    """The kept samples of one prompt."""

    group_id: str
    prompt: Mapping[str, Any]
    """The dataset item the group was made from."""
    samples: tuple[Sample, ...]

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


@dataclass
class BatchStats:
    """What it took to fill one batch (all counts are samples unless named groups)."""

    groups_submitted: int = 0
    groups_completed: int = 0
    groups_kept: int = 0
    groups_dropped_equal: int = 0
    """Complete groups whose rewards were all equal (dynamic sampling)."""
    groups_dropped_small: int = 0
    """Groups left with fewer than ``min_group_size`` usable samples."""
    groups_dropped_stale: int = 0
    """Groups that waited for a batch until too few of their samples were fresh enough."""
    groups_cancelled: int = 0
    """Open groups stopped on the server because the batch was full (early termination)."""
    cancelled_samples: int = 0
    stale_samples: int = 0
    failed_samples: int = 0
    generation_rounds: int = 0
    partial: bool = False
    """True when the batch holds fewer than ``groups_per_batch`` groups (rounds exhausted or
    dataset finished)."""
    rewards_all: list[float] = field(default_factory=list)
    """Reward of every usable completed sample, kept or not (the unfiltered accuracy)."""
    generated_tokens: int = 0
    """Model tokens of every completed sample, kept or not."""
    turns_all: list[int] = field(default_factory=list)
    """LLM turns of every usable completed sample, kept or not."""
    tool_calls_all: list[int] = field(default_factory=list)
    """Tool calls of every usable completed sample, kept or not."""
    wait_s: float = 0.0
    """Time :meth:`GroupBatcher.next_batch` spent waiting for rollouts."""

    @property
    def kept_group_ratio(self) -> float:
        return self.groups_kept / self.groups_completed if self.groups_completed else 0.0


@dataclass(frozen=True)
class Batch:
    groups: tuple[Group, ...]
    stats: BatchStats
    policy_version: int
    """The trainer's version when the batch was formed."""

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]


@dataclass
class _OpenGroup:
    group_id: str
    prompt: Mapping[str, Any]
    job_ids: set[str]
    trajectories: dict[str, tuple[int, trajectory_pb2.Trajectory]] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    """job id -> Job.State (or 0 for a rejected submission)."""
    cancelled: bool = False

    @property
    def done(self) -> bool:
        return len(self.outcomes) == len(self.job_ids)


class GroupBatcher:
    """See the module docstring. Use as ``async with GroupBatcher(session, prompts, cfg)``.

    ``prompts`` yields dataset items: a mapping in the JobSpec JSON form (``environment``,
    ``task``, optional ``sampling`` / ``limits`` / ``metadata``) merged over ``template``; the
    batcher sets job ids, the group and ``min_policy_version``. The session must be started,
    must not auto-acknowledge, and must not be read by anyone else.
    """

    def __init__(self, session: Session, prompts: Iterable[Mapping[str, Any]]
                 | AsyncIterable[Mapping[str, Any]], config: BatcherConfig | None = None, *,
                 template: SpecLike | None = None, policy_version: int = 0) -> None:
        if session.auto_ack:
            raise ValueError("the batcher acknowledges trajectories itself; open the session "
                             "with auto_ack=False")
        self.session = session
        self.config = config or BatcherConfig()
        self.template = dict(template or {}) if not isinstance(template, job_pb2.JobSpec) \
            else template
        self.policy_version = policy_version
        self._prompts = _aiter(prompts)
        self._requeued: deque[Mapping[str, Any]] = deque()
        self._exhausted = False
        self._run_id = self.config.run_id or uuid.uuid4().hex[:8]
        self._counter = itertools.count()
        self._open: dict[str, _OpenGroup] = {}
        self._group_of: dict[str, str] = {}
        self._ready: deque[Group] = deque()
        self._stats = BatchStats()
        self._submitted_for_batch = 0
        self._waiting = False
        self._submit_lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self.totals = BatchStats()
        """Counts over the batcher's whole life (same meaning as the per-batch stats)."""

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> GroupBatcher:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def start(self) -> None:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read(), name="batcher-reader")

    async def aclose(self) -> None:
        """Cancel every open group on the server and stop reading. Trajectories not yet
        acknowledged stay stored on the server."""
        if self._open:
            with contextlib.suppress(Exception):
                await self.session.cancel(group_ids=list(self._open))
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
            self._reader = None

    def set_policy_version(self, version: int) -> None:
        """The trainer now serves ``version``; staleness is measured against it."""
        if version < self.policy_version:
            raise ValueError(f"policy version went backwards: {self.policy_version} -> "
                             f"{version}")
        self.policy_version = version
        self._changed.set()

    @property
    def open_groups(self) -> list[str]:
        """Groups submitted and not yet complete, cancelled ones included."""
        return list(self._open)

    def _live(self) -> int:
        return sum(1 for g in self._open.values() if not g.cancelled)

    # ------------------------------------------------------------------ batches

    async def batches(self) -> AsyncIterator[Batch]:
        """Batches until the dataset is exhausted and nothing is left to batch."""
        while True:
            batch = await self.next_batch()
            if (not batch.groups and self._exhausted and not self._requeued and not self._live()
                    and not self._ready):
                return
            yield batch

    async def next_batch(self) -> Batch:
        """Wait until ``groups_per_batch`` kept groups are complete (or the rounds or the
        dataset run out), acknowledge them, stop redundant groups, and return the batch."""
        self.start()
        cfg = self.config
        started = time.monotonic()
        self._waiting = True
        try:
            while True:
                if self._error is not None:
                    raise self._error
                await self._drop_stale_ready()
                if len(self._ready) >= cfg.groups_per_batch:
                    break
                await self._top_up()
                if not self._live() and ((self._exhausted and not self._requeued)
                                         or self._submitted_for_batch >= self._budget):
                    self._stats.partial = True
                    break
                self._changed.clear()
                try:
                    # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel
                    # that arrives as the event fires (gh-86296), and next_batch would go on.
                    async with asyncio.timeout(cfg.batch_timeout_s):
                        await self._changed.wait()
                except TimeoutError:
                    raise TimeoutError(
                        f"no rollout finished for {cfg.batch_timeout_s} s with "
                        f"{self._live()} groups running; is the server running its jobs?"
                    ) from None
        finally:
            self._waiting = False
        groups = tuple(self._ready.popleft() for _ in range(min(cfg.groups_per_batch,
                                                                len(self._ready))))
        stats = self._stats
        stats.wait_s = time.monotonic() - started
        stats.generation_rounds = max(1, math.ceil(self._submitted_for_batch
                                                   / cfg.groups_per_batch))
        try:
            # Groups still open now were submitted for this batch but will serve the next one.
            await self._cancel_redundant(stats)
            await self.session.ack([s.delivery_id for g in groups for s in g.samples])
        except BaseException:
            # The caller never receives this batch (cancelled, or the stream broke while
            # acknowledging): its groups go back in front, so the next call returns them. An
            # ack that did reach the server is harmless: acknowledging twice changes nothing.
            self._ready.extendleft(reversed(groups))
            raise
        self._stats = BatchStats()
        self._submitted_for_batch = self._live()
        self.totals.groups_submitted += stats.groups_submitted
        self.totals.generation_rounds += stats.generation_rounds
        return Batch(groups=groups, stats=stats, policy_version=self.policy_version)

    # ------------------------------------------------------------------ internals

    @property
    def _budget(self) -> int:
        return self.config.max_rounds * self.config.groups_per_batch

    async def _top_up(self) -> None:
        """Submit groups up to the in-flight target while a batch is wanted, or up to the
        prefetch count between batches (the trainer is busy; what runs now serves the next
        step). Called by ``next_batch`` and by the reader whenever a group completes."""
        async with self._submit_lock:  # one reader of the dataset iterator at a time
            while self._submitted_for_batch < self._budget:
                wanted = self._waiting and len(self._ready) < self.config.groups_per_batch
                target = self.config.in_flight if wanted else self.config.prefetch
                if self._live() >= min(target, self.config.in_flight):
                    return
                if self._requeued:
                    item = self._requeued.popleft()
                elif self._exhausted:
                    return
                else:
                    try:
                        item = await anext(self._prompts)
                    except StopAsyncIteration:
                        self._exhausted = True
                        return
                await self._submit(item)

    async def _submit(self, item: Mapping[str, Any]) -> None:
        cfg = self.config
        group_id = f"{self._run_id}-g{next(self._counter):06d}"
        base = job_spec(self.template) if self.template else job_pb2.JobSpec()
        spec = job_spec(base, **{k: v for k, v in item.items() if k != "job_id"})
        spec.min_policy_version = max(0, self.policy_version - cfg.max_staleness)
        specs = group_specs(spec, cfg.group_size, group_id)
        group = _OpenGroup(group_id, item, {s.job_id for s in specs})
        self._open[group_id] = group
        for s in specs:
            self._group_of[s.job_id] = group_id
        self._submitted_for_batch += 1
        self._stats.groups_submitted += 1
        await self.session.submit(specs)

    async def _cancel_redundant(self, stats: BatchStats) -> None:
        extra = [g for g in self._open.values() if not g.cancelled][self.config.prefetch:]
        if not extra:
            return
        for group in extra:
            group.cancelled = True
        self._requeued.extendleft(reversed([g.prompt for g in extra]))
        stats.groups_cancelled += len(extra)
        self.totals.groups_cancelled += len(extra)
        await self.session.cancel(group_ids=[g.group_id for g in extra])

    async def _read(self) -> None:
        try:
            async for frame in self.session.events():
                await self._on_frame(frame)
            self._error = ConnectionError("the session ended while the batcher was reading")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surfaced by next_batch(), not lost in a task
            self._error = exc
        self._changed.set()

    async def _on_frame(self, frame: pb.StreamRolloutsResponse) -> None:
        kind = frame.WhichOneof("kind")
        job_id = frame.job_id
        group = self._open.get(self._group_of.get(job_id, ""))
        if kind == "trajectory":
            if group is None:  # not ours (an earlier run with this client id): let it go
                await self.session.ack([frame.trajectory.delivery_id])
                return
            group.trajectories[job_id] = (frame.trajectory.delivery_id,
                                          frame.trajectory.trajectory)
        elif kind in ("finished", "rejected") and group is not None:
            group.outcomes[job_id] = frame.finished.state if kind == "finished" else 0
            if group.done:
                await self._complete(group)
                await self._top_up()
                self._changed.set()

    async def _complete(self, group: _OpenGroup) -> None:
        del self._open[group.group_id]
        for job_id in group.job_ids:
            self._group_of.pop(job_id, None)
        drop = [did for did, _ in group.trajectories.values()]
        stats, totals = self._stats, self.totals
        if group.cancelled:
            n = sum(1 for s in group.outcomes.values() if s == job_pb2.Job.STATE_CANCELLED)
            stats.cancelled_samples += n
            totals.cancelled_samples += n
            await self.session.ack(drop)
            return
        samples: list[Sample] = []
        for job_id in sorted(group.job_ids, key=_job_index):
            state = group.outcomes[job_id]
            if state != job_pb2.Job.STATE_SUCCEEDED or job_id not in group.trajectories:
                stats.failed_samples += 1
                totals.failed_samples += 1
                continue
            delivery_id, traj = group.trajectories[job_id]
            sample = _sample(job_id, delivery_id, traj)
            stats.rewards_all.append(sample.reward)
            stats.turns_all.append(len(sample.turn_versions))
            stats.tool_calls_all.append(sum(sample.tool_calls))
            stats.generated_tokens += sample.generated_tokens
            totals.generated_tokens += sample.generated_tokens
            if self._too_stale(sample):
                stats.stale_samples += 1
                totals.stale_samples += 1
                continue
            samples.append(sample)
        stats.groups_completed += 1
        totals.groups_completed += 1
        kept = [s.delivery_id for s in samples]
        if len(samples) < self.config.min_group_size:
            stats.groups_dropped_small += 1
            totals.groups_dropped_small += 1
        elif self.config.dynamic_sampling and len({s.reward for s in samples}) == 1:
            stats.groups_dropped_equal += 1
            totals.groups_dropped_equal += 1
        else:
            stats.groups_kept += 1
            totals.groups_kept += 1
            self._ready.append(Group(group.group_id, group.prompt, tuple(samples)))
            drop = [d for d in drop if d not in kept]
        await self.session.ack(drop)

    def _too_stale(self, sample: Sample) -> bool:
        return self.policy_version - sample.min_version > self.config.max_staleness

    async def _drop_stale_ready(self) -> None:
        """Re-check waiting groups: the trainer's version may have moved since they finished."""
        fresh: deque[Group] = deque()
        drop: list[int] = []
        for group in self._ready:
            samples = tuple(s for s in group.samples if not self._too_stale(s))
            stale = len(group.samples) - len(samples)
            if stale:
                self._stats.stale_samples += stale
                self.totals.stale_samples += stale
                drop += [s.delivery_id for s in group.samples if s not in samples]
            rewards = {s.reward for s in samples}
            if len(samples) < self.config.min_group_size or (
                    self.config.dynamic_sampling and len(rewards) == 1):
                drop += [s.delivery_id for s in samples]
                self._stats.groups_dropped_stale += 1
                self.totals.groups_dropped_stale += 1
                continue
            fresh.append(group if not stale else Group(group.group_id, group.prompt, samples))
        self._ready = fresh
        if drop:
            await self.session.ack(drop)


def _sample(job_id: str, delivery_id: int, traj: trajectory_pb2.Trajectory) -> Sample:
    # The job state comes from its JobFinished frame (SUCCEEDED checked by the caller), so
    # keep_failed: a server older than Trajectory.state leaves it unset in the trajectory.
    flats = flatten_segments(traj, keep_failed=True)
    return Sample(job_id=job_id, delivery_id=delivery_id, flat=flats[-1],
                  turn_versions=tuple(t.policy_version for t in traj.turns),
                  finish_reasons=tuple(_finish_reason(t) for t in traj.turns),
                  segments=tuple(flats) if len(flats) > 1 else (),
                  tool_calls=tuple(len(t.tool_calls) for t in traj.turns))


def _finish_reason(turn: trajectory_pb2.Turn) -> str:
    """The turn's finish reason as a lower-case word, whether the proto carries a string or
    an enum (``FINISH_REASON_STOP`` -> ``stop``)."""
    value: Any = turn.finish_reason
    if isinstance(value, int):
        enum = turn.DESCRIPTOR.fields_by_name["finish_reason"].enum_type
        name = enum.values_by_number[value].name if value in enum.values_by_number else ""
        return name.removeprefix(f"{_upper_snake(enum.name)}_").lower()
    return str(value)


def _upper_snake(name: str) -> str:
    return "".join(f"_{c}" if c.isupper() and i else c for i, c in enumerate(name)).upper()


def _job_index(job_id: str) -> int:
    tail = job_id.rsplit("/", 1)[-1]
    return int(tail) if tail.isdigit() else 0


async def _aiter(items: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item
