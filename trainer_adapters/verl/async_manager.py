"""A verl rollout manager that streams groups across training steps through the batcher.

The per-sample agent loop (:mod:`.agent_loop`) runs exactly the samples verl hands it and returns
them row by row. This manager instead keeps one :class:`rollout.client.batcher.GroupBatcher`
alive for the whole run: each ``generate_sequences`` call adds the step's prompt groups (one per
``uid``) to the batcher's queue and returns the next batch the batcher forms, with DAPO dynamic
sampling (groups whose rewards are all equal are dropped), the staleness bound (a sample whose
oldest turn lags the trainer by more than ``max_staleness`` versions is dropped; new jobs ask the
service for ``min_policy_version``), early termination of redundant groups, and groups left
running between steps (``prefetch_groups``) that serve the next step. One generation round per
step (prompts arrive a step at a time): a dropped group shortens the batch (``partial``).

Policy versions follow verl's labels: verl syncs weights to its rollout with the label
``global_steps`` at the time of the sync, 0 before step 1 and ``k`` after step ``k``'s update,
so step ``k`` (``meta_info["global_steps"] == k``) generates on weights labelled ``k - 1``. The
manager therefore takes ``global_steps - 1`` as the current version (and new jobs ask the
service for at least ``global_steps - 1 - max_staleness``); a trainer that pushes weights to the
service's backends labels them the same way. :meth:`set_policy_version` sets it explicitly.

A step never silently returns nothing. When every group of a step tied (dynamic sampling would
drop them all), the tied groups are returned anyway and ``meta_info["rollout_stats"]
["all_tied"]`` is True: their group-normalised advantages are zero, so the policy-gradient
term does nothing, and the run goes on (a hard start often has such steps). When no group is
usable at all (every sample failed, was stale or was cancelled), ``generate_sequences`` raises
:class:`NoUsableGroups` with the counts.

Because groups are dropped and carried across steps, a batch is *not* row-aligned with the
prompts of the call: it is self-contained (tensors in verl's padded layout plus each row's
source fields: ``uid``, ``raw_prompt``, ``extra_info``, ``index``, ...). Use it where the
rollout output is the training batch (``batch = manager.generate_sequences(gen_batch)``), not in
a loop that does ``batch.repeat(n).union(output)`` by position; the stock ``RayPPOTrainer.fit``
does the latter and takes the per-sample ``rollout_service`` agent loop instead.

The manager runs its session on a private event loop thread (a grpc.aio channel belongs to the
loop that created it, while verl calls its managers both synchronously and with ``await``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from verl.protocol import DataProto
from verl.utils.model import compute_position_id_with_mask

from rollout.client.aio import RolloutClient
from rollout.client.batcher import Batch, BatcherConfig, Group, GroupBatcher
from rollout.trainer_adapters.verl.agent_loop import ServiceSettings
from rollout.trainer_adapters.verl.job_mapping import (
    VerlSample,
    _scalar,
    from_flat,
    job_for_sample,
    pad_batch,
)

_SOURCE_KEYS = ("uid", "raw_prompt", "extra_info", "index", "data_source", "reward_model",
                "agent_name")
"""Per-row fields of verl's prompt batch that travel with a group into the batch it lands in."""


class NoUsableGroups(RuntimeError):
    """A step produced no group to train on (failed, stale or cancelled samples only)."""


def version_of_step(global_steps: int) -> int:
    """The label of the weights verl's step ``global_steps`` generates on (see the module
    docstring): one less than the step, never below 0."""
    return max(int(global_steps) - 1, 0)


class _Feed:
    """The batcher's prompt source: items added by ``generate_sequences`` calls, in order. It
    never ends; the batcher only asks for more than it was given between batches (prefetch),
    and then waits for the next step's prompts, which is what prefetching means here."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Mapping[str, Any]] = asyncio.Queue()

    def put(self, item: Mapping[str, Any]) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[Mapping[str, Any]]:
        while True:
            yield await self._queue.get()


class StreamingRolloutManager:
    """verl's rollout-manager interface (``create``, ``generate_sequences``) over the service.

    ``settings`` say where the service is and how samples become jobs (see
    :class:`ServiceSettings`); ``batcher`` sets dynamic sampling, staleness and prefetch
    (``group_size`` must be verl's ``rollout.n``; ``groups_per_batch`` defaults to the number of
    groups in the first call)."""

    def __init__(self, *, settings: ServiceSettings, prompt_length: int, response_length: int,
                 pad_token_id: int, group_size: int, batcher: BatcherConfig | None = None,
                 client_id: str = "verl-streaming") -> None:
        self.settings = settings
        self.prompt_length, self.response_length = prompt_length, response_length
        self.pad_token_id = pad_token_id
        self.group_size = group_size
        self._batcher_config = batcher
        self.dynamic_sampling = batcher.dynamic_sampling if batcher is not None else True
        self.client_id = client_id
        self.policy_version = 0
        self._sources: dict[str, dict[str, Any]] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="rollout-streaming-manager")
        self._thread.start()
        self._client: RolloutClient | None = None
        self._batcher: GroupBatcher | None = None
        self._feed: _Feed | None = None

    @classmethod
    def create(cls, config: Any, llm_client: Any = None, teacher_client: Any = None,
               reward_loop_worker_handles: Any = None, **kwargs: Any) -> StreamingRolloutManager:
        """Build from a verl trainer config (the ``agent_loop_manager_class`` hook's call).

        Only for verl's legacy trainer path (``trainer.use_v1=false``), whose managers return
        the batch as a DataProto. verl 0.9.1's V1 trainer (``trainer.use_v1``, its default)
        wants a manager that writes its outputs into TransferQueue and returns nothing, which
        this one does not do: it refuses that configuration instead of failing mid-run."""
        trainer = config.get("trainer") or {}
        if trainer.get("use_v1", False):
            raise ValueError(
                "StreamingRolloutManager returns DataProto batches (verl's legacy trainer path); "
                "verl's V1 trainer (trainer.use_v1=true, the default in verl 0.9.1) expects an "
                "agent loop manager that writes into TransferQueue. Set trainer.use_v1=false "
                "for this manager, or keep V1 and use the per-sample agent loop "
                "(actor_rollout_ref.rollout.agent.default_agent_loop=rollout_service).")
        rollout = config.actor_rollout_ref.rollout
        settings = ServiceSettings.resolve({}, config)
        block = config.get("rollout_service") or {}
        batcher = BatcherConfig(
            groups_per_batch=int(block.get("groups_per_batch", 0) or config.data.train_batch_size),
            group_size=int(rollout.n), max_staleness=int(block.get("max_staleness", 0)),
            max_rounds=1,
            dynamic_sampling=bool(block.get("dynamic_sampling", True)),
            min_group_size=min(2, int(rollout.n)))
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
        return cls(settings=settings, prompt_length=int(rollout.prompt_length),
                   response_length=int(rollout.response_length),
                   pad_token_id=int(tok.pad_token_id or 0), group_size=int(rollout.n),
                   batcher=batcher, **kwargs)

    # ------------------------------------------------------------------ verl's interface

    def set_policy_version(self, version: int) -> None:
        """The trainer pushed weights of ``version`` to the service's backends."""
        self._call(self._set_version(int(version)))

    def generate_sequences(self, prompts: DataProto) -> Any:
        """The next batch (see the module docstring). Returns the DataProto when called
        synchronously and an awaitable when an event loop is running (verl does both)."""
        fut = asyncio.run_coroutine_threadsafe(self._generate(prompts), self._loop)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return fut.result()
        return asyncio.wrap_future(fut)

    def close(self) -> None:
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    # ------------------------------------------------------------------ internals

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _set_version(self, version: int) -> None:
        if version < self.policy_version:
            raise ValueError(f"policy version went backwards: {self.policy_version} -> "
                             f"{version}")
        self.policy_version = version
        if self._batcher is not None:
            self._batcher.set_policy_version(version)

    async def _start(self, groups_per_batch: int) -> GroupBatcher:
        if self._batcher is not None:
            return self._batcher
        cfg = self._batcher_config or BatcherConfig(
            groups_per_batch=groups_per_batch, group_size=self.group_size, max_rounds=1,
            min_group_size=min(2, self.group_size))
        # Dynamic sampling happens here, per step, so a step whose groups all tied can still
        # return them (see the module docstring); the batcher keeps every usable group.
        self.dynamic_sampling = cfg.dynamic_sampling
        cfg = dataclasses.replace(cfg, dynamic_sampling=False)
        if cfg.max_rounds != 1:
            # Prompts arrive one step at a time: a second generation round would wait for
            # prompts only the next call brings. Dropped groups are replaced from the next
            # step's prompts instead, and a batch may come back short (stats.partial).
            raise ValueError("the streaming manager needs BatcherConfig.max_rounds == 1")
        if cfg.group_size != self.group_size:
            raise ValueError(f"batcher group_size {cfg.group_size} differs from rollout.n "
                             f"{self.group_size}")
        self._client = RolloutClient(self.settings.address, token=self.settings.token or None)
        self._client.connect()
        session = self._client.session(self.client_id)
        await session.start()
        self._feed = _Feed()
        self._batcher = GroupBatcher(session, self._feed, cfg,
                                     policy_version=self.policy_version)
        self._batcher.start()
        return self._batcher

    async def _generate(self, prompts: DataProto) -> DataProto:
        step = prompts.meta_info.get("global_steps")
        if step is not None and version_of_step(step) > self.policy_version:
            await self._set_version(version_of_step(step))
        rows = _rows(prompts)
        firsts: dict[str, dict[str, Any]] = {}
        for row in rows:
            firsts.setdefault(str(row.get("uid")), row)
        batcher = await self._start(len(firsts))
        assert self._feed is not None
        for uid, row in firsts.items():
            if uid in self._sources:
                continue  # verl repeats a prompt n times; the group covers all of them
            self._sources[uid] = {k: row[k] for k in _SOURCE_KEYS if k in row}
            self._feed.put(self._item(row))
        batch = await batcher.next_batch()
        groups, stats = self._filter(batch)
        return self._to_dataproto(groups, stats, batch.policy_version)

    def _filter(self, batch: Batch) -> tuple[list[Group], dict[str, Any]]:
        st = batch.stats
        groups = list(batch.groups)
        stats: dict[str, Any] = {
            "groups_kept": st.groups_kept, "groups_dropped_equal": st.groups_dropped_equal,
            "groups_dropped_stale": st.groups_dropped_stale,
            "groups_cancelled": st.groups_cancelled, "stale_samples": st.stale_samples,
            "failed_samples": st.failed_samples, "partial": st.partial,
            "generation_rounds": st.generation_rounds, "wait_s": st.wait_s, "all_tied": False}
        if self.dynamic_sampling and groups:
            mixed = [g for g in groups if len(set(g.rewards)) > 1]
            if mixed:
                stats["groups_dropped_equal"] += len(groups) - len(mixed)
                stats["partial"] = stats["partial"] or len(mixed) < len(groups)
                groups = mixed
            else:
                stats["all_tied"] = True
            stats["groups_kept"] = len(groups)
        if not groups:
            raise NoUsableGroups(
                f"no usable group in this step: {st.failed_samples} samples failed, "
                f"{st.stale_samples} were too stale (max_staleness), {st.groups_cancelled} "
                f"groups were cancelled, {st.groups_dropped_small} groups had fewer than "
                f"min_group_size usable samples. Failed jobs say why (`rollout jobs` / "
                f"GetJob); BACKEND_UNAVAILABLE usually means no backend serves the version "
                f"jobs ask for ({self.policy_version} - max_staleness): weights for step k "
                f"are labelled k - 1.")
        return groups, stats

    def _item(self, row: Mapping[str, Any]) -> dict[str, Any]:
        spec = job_for_sample(row, {}, environment=self.settings.environment,
                              prompt_length=self.prompt_length,
                              response_length=self.response_length, group_size=self.group_size,
                              max_turns=self.settings.max_turns or None,
                              max_tokens_per_turn=self.settings.max_tokens_per_turn or None)
        from google.protobuf import json_format

        item = json_format.MessageToDict(spec, preserving_proto_field_name=True)
        for key in ("job_id", "group", "min_policy_version"):  # the batcher's to set
            item.pop(key, None)
        return item

    def _to_dataproto(self, groups: list[Group], stats: dict[str, Any],
                      policy_version: int) -> DataProto:
        rows = rollout_rows(groups, self._sources, prompt_length=self.prompt_length,
                            response_length=self.response_length,
                            reward_components=self.settings.reward_components,
                            overlong=self.settings.overlong)
        stats = {**stats, "segments_dropped": rows.segments_dropped,
                 "rollouts_untrainable": rows.rollouts_untrainable}
        if not rows.samples:
            raise NoUsableGroups(
                f"no trainable row in this step: {rows.rollouts_untrainable} rollouts had no "
                f"row left to train (answers cut at rollout.response_length with overlong=mask, "
                f"or every segment's prompt over rollout.prompt_length)")
        samples, sources = rows.samples, rows.sources
        padded = pad_batch(samples, prompt_length=self.prompt_length,
                           response_length=self.response_length,
                           pad_token_id=self.pad_token_id)
        tensors = {k: torch.tensor(v, dtype=torch.float32 if k in (
            "rollout_log_probs", "rm_scores") else torch.int64) for k, v in padded.items()}
        tensors["position_ids"] = compute_position_id_with_mask(tensors["attention_mask"])
        non_tensors: dict[str, Any] = {}
        for key in _SOURCE_KEYS:
            if any(key in src for src in sources):
                arr = np.empty(len(sources), dtype=object)
                arr[:] = [src.get(key) for src in sources]
                non_tensors[key] = arr
        for key in ("min_global_steps", "max_global_steps", "rollout_valid", "truncated",
                    "rollout_job_id"):
            arr = np.empty(len(samples), dtype=object)
            arr[:] = [s.extra_fields.get(key) for s in samples]
            non_tensors[key] = arr
        non_tensors["rollout_key"] = np.array(rows.keys, dtype=object)
        non_tensors["rollout_index"] = np.array(rows.rollout_index, dtype=np.int64)
        info_keys = list(samples[0].extra_fields["reward_extra_info"]) if samples else []
        for key in info_keys:
            non_tensors[key] = np.array([s.extra_fields["reward_extra_info"][key]
                                         for s in samples])
        non_tensors["__num_turns__"] = np.array([s.num_turns for s in samples], dtype=np.int32)
        meta = {"reward_extra_keys": info_keys, "policy_version": policy_version,
                "rollout_stats": stats,
                "timing": {"agent_loop/streaming/wait_s": stats["wait_s"]}}
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)

    async def _close(self) -> None:
        if self._batcher is not None:
            await self._batcher.aclose()
            await self._batcher.session.aclose()
        if self._client is not None:
            await self._client.close()


@dataclasses.dataclass(frozen=True)
class RolloutRows:
    """The training rows of a step's groups: only rows with a model token to train, each with
    its rollout's key (``{uid}_{rollout}_{row}``, verl V1's TransferQueue key format, which
    ``compute_advantage_for_multi_trajectories`` parses)."""

    samples: list[VerlSample]
    sources: list[dict[str, Any]]
    keys: list[str]
    rollout_index: list[int]
    """Per row, which rollout of its group (``uid``) it belongs to."""
    segments_dropped: int
    """Rows left out because they had nothing to train (a later segment over
    ``prompt_length``, an answer cut with ``overlong: mask``)."""
    rollouts_untrainable: int
    """Rollouts with no row left: absent from the batch, so absent from the group
    statistics."""


def rollout_rows(groups: Sequence[Group], sources: Mapping[str, Mapping[str, Any]], *,
                 prompt_length: int, response_length: int,
                 reward_components: Sequence[str] = (), overlong: str = "mask") -> RolloutRows:
    """One vote per rollout: every rollout (sample) of a group becomes its trainable rows (one
    per segment or chain), all with the rollout's reward and one rollout key, so group
    statistics taken per rollout (``compute_advantage_for_multi_trajectories``) count it once
    whatever its number of rows. A row with nothing to train is left out: it would not change
    the loss, and as a rollout's final row its all-zero mask would erase the advantage verl
    reads from that row. A rollout with no trainable row is left out entirely, so a masked
    rollout never counts in its group's mean or std."""
    samples: list[VerlSample] = []
    out_sources: list[dict[str, Any]] = []
    keys: list[str] = []
    index: list[int] = []
    dropped = untrainable = 0
    for group in groups:
        uid = str(dict(group.prompt.get("metadata", {})).get("uid", group.group_id))
        source = dict(sources.get(uid, {"uid": uid}))
        for r, s in enumerate(group.samples):
            rows = [from_flat(flat, succeeded=True, turn_versions=s.turn_versions,
                              prompt_length=prompt_length, response_length=response_length,
                              reward_components=reward_components, overlong=overlong)
                    for flat in s.flats]
            kept = [row for row in rows if row.trained]
            dropped += len(rows) - len(kept)
            if not kept:
                untrainable += 1
                continue
            for k, row in enumerate(kept):
                samples.append(row)
                out_sources.append(source)
                keys.append(f"{uid}_{r}_{k}")
                index.append(r)
    return RolloutRows(samples=samples, sources=out_sources, keys=keys, rollout_index=index,
                       segments_dropped=dropped, rollouts_untrainable=untrainable)


def _rows(prompts: DataProto) -> list[dict[str, Any]]:
    n = len(prompts.non_tensor_batch.get("uid", []))
    return [{k: _scalar(v[i]) for k, v in prompts.non_tensor_batch.items()} for i in range(n)]
