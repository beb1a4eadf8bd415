"""The Rollout Service as a verl agent loop: each sample runs as one job of the service.

Registered as ``rollout_service`` (``actor_rollout_ref.rollout.agent.default_agent_loop``, or a
dataset's ``agent_name`` column). The package declares this module under the ``verl.plugins``
entry-point group, which ``import verl`` loads in every process, so verl's agent-loop workers
find the registration without any import in the user's code.

verl builds one loop object per sample; all of them in a process share one gRPC session
(:func:`rollout.trainer_adapters.job_runner.shared_runner`). The service renders the prompt, runs
the multi-turn episode in its sandbox, scores it and returns exact token ids, loss mask and sampling
logprobs; :func:`rollout.trainer_adapters.verl.job_mapping.to_verl_sample` maps that onto verl's
fields. verl's ``server_manager`` (its own inference servers) is not used: the service's
backends generate, and the trainer pushes weights to them (see ``async_manager``).

Settings, first found wins: keyword arguments from an ``agent_loop_config_path`` entry, the
trainer config's top-level ``rollout_service`` block (``+rollout_service.address=...`` on the
command line), ``ROLLOUT_SERVICE_*`` environment variables, then the defaults of
:class:`ServiceSettings`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)

from rollout.trainer_adapters.group_fill import fill_for
from rollout.trainer_adapters.job_runner import JobOutcome, shared_runner
from rollout.trainer_adapters.verl.job_mapping import (
    PromptTooLong,
    VerlSample,
    job_for_sample,
    prompt_only,
    to_verl_samples,
)

AGENT_NAME = "rollout_service"


@dataclass(frozen=True)
class ServiceSettings:
    """How verl samples become jobs of the service."""

    address: str = "127.0.0.1:50051"
    """The service's gRPC address."""
    token: str = ""
    """Bearer token, when the service requires one."""
    environment: str = "math"
    """Environment of samples whose ``extra_info`` names none."""
    reward_components: tuple[str, ...] = ()
    """Component names reported in ``reward_extra_info`` for every sample (0.0 when missing),
    since verl needs the same keys in every sample."""
    overlong: str = "mask"
    """A response cut at ``response_length``: ``mask`` trains on none of it when a model token
    was cut (the cut part may hold what earned the reward); ``truncate`` keeps the prefix and
    the reward. See :mod:`rollout.trainer_adapters.verl.job_mapping`."""
    finish_after: int = 0
    """Group early termination: cancel a group's other samples once this many succeeded."""
    max_turns: int = 0
    """Most LLM turns per sample; 0 takes verl's ``multi_turn.max_assistant_turns`` or the
    environment's default."""
    max_tokens_per_turn: int = 0
    """Most tokens per turn; 0 means ``response_length``."""
    neutral_wait_s: float = 900.0
    """Legacy trainer: how long an untrainable sample (its job failed or was cancelled, or its
    row is wholly masked) waits for its group's other jobs to finish, to take a reward that
    keeps verl's group mean and std those of the valid rollouts (``group_fill``). 0 turns this
    off: the row keeps its reward (0 for a failed job) in the group statistics."""

    @classmethod
    def resolve(cls, kwargs: Mapping[str, Any], trainer_config: Any) -> ServiceSettings:
        block = _get(trainer_config, "rollout_service") or {}
        values: dict[str, Any] = {}
        for f in fields(cls):
            env = os.environ.get(f"ROLLOUT_SERVICE_{f.name.upper()}")
            for source in (kwargs.get(f.name), _get(block, f.name), env):
                if source is not None:
                    values[f.name] = source
                    break
        if isinstance(values.get("reward_components"), str):
            values["reward_components"] = tuple(
                s for s in values["reward_components"].split(",") if s)
        elif "reward_components" in values:
            values["reward_components"] = tuple(values["reward_components"])
        for name in ("finish_after", "max_turns", "max_tokens_per_turn"):
            if name in values:
                values[name] = int(values[name])
        if "neutral_wait_s" in values:
            values["neutral_wait_s"] = float(values["neutral_wait_s"])
        return cls(**values)


def _get(obj: Any, key: str) -> Any:
    if obj is None:
        return None
    getter = getattr(obj, "get", None)
    return getter(key, None) if getter is not None else getattr(obj, key, None)


@register(AGENT_NAME)
class RolloutServiceAgentLoop(AgentLoopBase):
    """Runs one verl sample as one job of the Rollout Service."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        own = {f.name: kwargs.pop(f.name) for f in fields(ServiceSettings) if f.name in kwargs}
        kwargs.pop("name", None)  # an agent_loop_config_path entry's own name
        super().__init__(*args, **kwargs)
        self.settings = ServiceSettings.resolve(own, self.config)
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)
        multi_turn = _get(self.rollout_config, "multi_turn")
        self.max_turns = self.settings.max_turns or int(
            _get(multi_turn, "max_assistant_turns") or 0)
        self.group_size = int(_get(self.rollout_config, "n") or 1)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any
                  ) -> AgentLoopOutput | list[AgentLoopOutput]:
        """The sample's row (legacy trainer: the trajectory's last segment), or under verl's V1
        trainer every trainable segment as one output each, in order: one rollout, one vote,
        whatever its number of segments. A failed or wholly masked rollout then returns no
        output at all, which V1 leaves out of the group's statistics.

        The legacy worker must return exactly one row per sample, and verl groups rows by the
        ``uid`` it assigned (``DataProto.union`` refuses a changed one), so an untrainable row
        cannot leave its group. Instead it takes a reward that keeps the group's GRPO mean and
        std those of the valid rollouts (:meth:`_neutral_reward`); the row itself is masked, so
        it carries no gradient whatever its advantage. It comes back with its prompt alone
        (:func:`~rollout.trainer_adapters.verl.job_mapping.prompt_only`): verl's score and
        reward metrics then leave it out as aborted, so they average valid rollouts only while
        its reward still enters the advantages. Its fill is computed from the group's view that
        :meth:`~rollout.trainer_adapters.job_runner.JobRunner.frozen_group` derives alike for
        every loop of the group, in this worker process or another."""
        s = self.settings
        spec = job_for_sample(
            kwargs, sampling_params, environment=s.environment,
            prompt_length=self.prompt_length, response_length=self.response_length,
            group_size=self.group_size, max_turns=self.max_turns or None,
            finish_after=s.finish_after, max_tokens_per_turn=s.max_tokens_per_turn or None)
        runner = shared_runner(s.address, s.token or None)
        outcome = await runner.run(spec)
        fallback: list[int] = []
        if not outcome.trajectory.turns:
            fallback = await self._render_prompt(kwargs.get("raw_prompt"))
        samples = self._rows(outcome, fallback)
        if "session_id" in kwargs:
            # verl's V1 worker (AgentLoopWorkerTQ) calls every loop with the sample's session
            # (rollout) id, keys each output {uid}_{session}_{index} and computes GRPO
            # advantages per session from its final output; the legacy worker passes no
            # session id and takes exactly one output per sample.
            return [_output(x) for x in samples if x.trained]
        row = samples[-1]
        if not row.trained:
            if self.group_size > 1 and s.neutral_wait_s > 0:
                row = await self._neutral_reward(runner, spec, row)
            row = prompt_only(row)
        return _output(row)

    def _rows(self, outcome: JobOutcome, fallback: Sequence[int] = ()) -> list[VerlSample]:
        s = self.settings
        return to_verl_samples(
            outcome, prompt_length=self.prompt_length, response_length=self.response_length,
            reward_components=s.reward_components, overlong=s.overlong,
            fallback_prompt_ids=fallback)

    def _legacy_row_trains(self, outcome: JobOutcome) -> bool:
        """Whether this loop, given ``outcome``, would return a trained row to the legacy
        worker: the very test :meth:`run` applies to its own row, so a group's valid set is
        exactly the rows verl trains (a SUCCEEDED job whose row is masked, e.g. overlong, is
        not valid)."""
        try:
            return self._rows(outcome)[-1].trained
        except PromptTooLong:
            return False  # that sample's own loop raises: it is trained on nothing

    async def _neutral_reward(self, runner: Any, spec: Any, row: VerlSample) -> VerlSample:
        """``row`` with the reward that leaves its group's valid rows (rows this loop trains)
        their GRPO advantages as if the untrainable rows were not there: the group's
        untrainable rows take :func:`~rollout.trainer_adapters.group_fill.grpo_fills` of the
        valid rewards, each the fill at its job id's rank among them, so that verl's mean and
        std over every row of the ``uid`` are the valid rows' own. ``reward`` in the row's
        reward info keeps the job's own."""
        group = await runner.frozen_group(
            spec.group.group_id, size=self.group_size, timeout_s=self.settings.neutral_wait_s,
            trains=self._legacy_row_trains)
        fill = fill_for(spec.job_id, group.valid, group.roster, self.group_size)
        if fill is None:
            return row  # more untrainable rows than the group's size: a view gone wrong
        return dataclasses.replace(row, reward_score=fill)

    async def _render_prompt(self, raw_prompt: Any) -> list[int]:
        """verl's own rendering of the prompt: the row of a job that never produced a turn."""
        messages = list(raw_prompt) if raw_prompt is not None else []
        if not messages:
            return []
        ids = await self.loop.run_in_executor(None, lambda: self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids][-self.prompt_length:]


def _output(sample: VerlSample) -> AgentLoopOutput:
    """verl's own output type for one row."""
    metrics = AgentLoopMetrics(**{k: v for k, v in sample.metrics.items()
                                  if k in AgentLoopMetrics.model_fields})
    metrics.num_preempted = int(sample.metrics.get("num_preempted", -1))
    return AgentLoopOutput(
        prompt_ids=sample.prompt_ids, response_ids=sample.response_ids,
        response_mask=sample.response_mask, response_logprobs=sample.response_logprobs,
        reward_score=sample.reward_score, num_turns=sample.num_turns, metrics=metrics,
        extra_fields=sample.extra_fields,
        routed_experts=None if sample.routed_experts is None
        else np.asarray(sample.routed_experts, dtype=np.int16))


__all__ = ["AGENT_NAME", "RolloutServiceAgentLoop", "ServiceSettings"]
