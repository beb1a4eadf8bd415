"""A finished job as the fields of one verl ``AgentLoopOutput``, and a verl sample as a job.

Plain Python (no verl, no torch), so the mapping is tested in any environment; the agent loop in
:mod:`rollout.trainer_adapters.verl.agent_loop` wraps the result in verl's own types.

What verl does with these fields, and why each rule below exists:

- verl left-pads ``prompt_ids`` to ``rollout.prompt_length`` and right-pads ``response_ids`` to
  ``rollout.response_length``, but never truncates: one sample longer than either length fails
  the whole batch (``Sizes of tensors must match``). So every sample is cut here, explicitly,
  and flagged (``truncated``), never left to crash the step.
- ``rm_scores`` exists only when *every* sample has a ``reward_score``, and the per-sample
  ``reward_extra_info`` dicts are read with the first sample's keys. So every sample gets a score
  and the same keys (``REWARD_INFO_KEYS`` plus the configured component names), whether it
  succeeded or not.
- A response longer than ``response_length`` is cut. The service stops an episode at
  ``prompt_length + response_length`` tokens in all, so when the rendered prompt is shorter
  than ``prompt_length`` the response can run past ``response_length``. The reward was earned
  by the whole episode, perhaps by an answer in the cut part: by default (``overlong="mask"``)
  a row that lost any model token is trained on nothing (``rollout_valid`` 0); a cut that
  removed only tool output after the last generation loses nothing the model wrote, and the
  row stays trainable. ``overlong="truncate"`` keeps the prefix with its mask and the reward,
  as verl's own tool agent loop does (whose generation stops at the budget, so there the kept
  part did earn it).
- A prompt longer than ``prompt_length`` is a configuration error, not a sample to mask: the
  service renders one prompt per task, so every sample would be masked. It raises, naming the
  length to configure. So does a job whose prompt alone filled the job's token budget (it ends
  with no turn at all and would train on nothing). A *later* segment of a harness trajectory is
  different: its prompt is the harness's rewritten history, which can outgrow
  ``prompt_length`` in one episode and not in the next. That segment alone is dropped (its row
  trains nothing; ``rollout_segments_dropped`` counts it and a warning names the job); the
  step and the rollout's other segments go on.
- One vote per rollout. A harness trajectory may hold several segments (or chains), each its own
  row. Rows of one rollout share the rollout's reward and carry ``rollout_key``
  (``{uid}_{rollout}_{row}``, the key format of verl's V1 TransferQueue) so that verl's
  ``compute_advantage_for_multi_trajectories`` takes the group statistics over rollouts (the
  final row of each rollout) and gives every row its rollout's advantage.
- A failed or cancelled job has no genuine reward (the service reports 0). Scoring it 0 would
  teach the policy that whatever it did was wrong, when a sandbox crashed or a group was cut
  short; so its response mask is all zero (no token of it is trained on) and ``rollout_valid``
  is 0, which a trainer can filter on. Its score stays 0.0 only because verl needs a number.
  The legacy agent loop returns such a row (any row it does not train) with its prompt alone
  (:func:`prompt_only`), which verl's score metrics leave out as aborted.
- ``extra_fields["min_global_steps"]`` / ``["max_global_steps"]`` are the policy versions verl
  reads for staleness; they come from the turns that produced tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout.client.specs import job_spec
from rollout.client.trajectory import Flat, flatten, segment_views
from rollout.v1 import job_pb2, trajectory_pb2

REWARD_INFO_KEYS = ("reward", "rollout_valid", "truncated")
"""Keys every sample's ``reward_extra_info`` carries, before the configured components."""

OVERLONG_POLICIES = ("mask", "truncate")
"""What a response cut at ``response_length`` trains on: nothing when a model token was cut
(``mask``, the default), or its first ``response_length`` tokens with their mask and the
episode's reward (``truncate``). See the module docstring."""


class PromptTooLong(ValueError):
    """The service's rendered prompt does not fit ``prompt_length`` (or the job's budget)."""


log = logging.getLogger(__name__)

_JOB_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._:/-]")


@dataclass(frozen=True)
class VerlSample:
    """The fields of one ``AgentLoopOutput``, already cut to the configured lengths."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    """verl's response mask: the service's loss mask (1 = a token the model sampled)."""
    response_logprobs: list[float]
    reward_score: float
    num_turns: int
    """verl counts chat messages: the prompt, each assistant turn, each tool observation."""
    metrics: dict[str, float]
    extra_fields: dict[str, Any] = field(default_factory=dict)
    routed_experts: list[list[list[int]]] | None = None
    """verl's ``AgentLoopOutput.routed_experts`` for routing replay: ``[position][layer][k]``
    over ``prompt_ids + response_ids`` (what verl's router replay indexes by absolute
    position); None for a dense model."""

    @property
    def trained(self) -> bool:
        """Whether verl trains this row: some token of it is in the loss. A failed job's row,
        an answer cut under ``overlong="mask"`` and a dropped segment are wholly masked; every
        adapter path asks this one question to leave a row out of training and statistics."""
        return any(self.response_mask)


def to_verl_sample(job: Any, *, prompt_length: int, response_length: int,
                   reward_components: Sequence[str] = (), overlong: str = "mask",
                   fallback_prompt_ids: Sequence[int] = ()) -> VerlSample:
    """Map a finished job (a :class:`rollout.trainer_adapters.job_runner.JobOutcome`:
    ``trajectory``, ``state``, ``error``) to verl's fields: one row, the trajectory's last
    segment (the one that ends the episode; see :func:`to_verl_samples` for every segment).

    ``fallback_prompt_ids`` is the prompt verl itself would have built; it stands in when the job
    produced no turn (it failed in INIT, or was cancelled while queued), so the padded batch
    still has a real prompt row.
    """
    return to_verl_samples(job, prompt_length=prompt_length, response_length=response_length,
                           reward_components=reward_components, overlong=overlong,
                           fallback_prompt_ids=fallback_prompt_ids)[-1]


def to_verl_samples(job: Any, *, prompt_length: int, response_length: int,
                    reward_components: Sequence[str] = (), overlong: str = "mask",
                    fallback_prompt_ids: Sequence[int] = ()) -> list[VerlSample]:
    """One row per segment of the job's trajectory, in order, each with the rollout's reward.
    A row that cannot be trained (failed job, cut answer, later segment over ``prompt_length``)
    has an all-zero response mask and ``rollout_valid`` False."""
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
    if prompt_length <= 0 or response_length <= 0:
        raise ValueError("prompt_length and response_length must be positive")
    traj: trajectory_pb2.Trajectory = job.trajectory
    succeeded = job.state == job_pb2.Job.State.STATE_SUCCEEDED
    if succeeded and not traj.turns and traj.termination_reason in (
            trajectory_pb2.TERMINATION_REASON_TOKEN_BUDGET,
            trajectory_pb2.TERMINATION_REASON_CONTEXT_LENGTH):
        raise PromptTooLong(
            f"job {traj.job_id}: its {traj.metadata.get('prompt_tokens', '?')}-token prompt "
            f"alone filled the job's token budget of prompt_length + response_length = "
            f"{prompt_length + response_length}, so the episode produced no turn and "
            f"would train on nothing. Raise actor_rollout_ref.rollout.prompt_length (and "
            f"data.max_prompt_length) above the prompt's length.")
    # keep_failed: a failed job still yields its rows (masked out below), never a missing one.
    views = segment_views(traj)
    error = getattr(job, "error", None)
    llm_s = sum(t.latency.ToTimedelta().total_seconds() for t in traj.turns)
    run_s = traj.timings.run.ToTimedelta().total_seconds()
    metrics = {
        "generate_sequences": llm_s,
        # The rest of RUN is tool execution and the loop itself.
        "tool_calls": max(run_s - llm_s, 0.0),
        "compute_score": traj.timings.eval.ToTimedelta().total_seconds(),
        "num_preempted": float(sum(getattr(t, "preempted_retries", 0) for t in traj.turns)),
    }
    versions = [t.policy_version for t in traj.turns if len(t.output_ids)]
    samples = []
    for n, view in enumerate(views):
        flat = dataclasses.replace(flatten(view, keep_failed=True), segment=n,
                                   num_segments=len(views))
        samples.append(from_flat(
            flat, succeeded=succeeded, turn_versions=versions,
            prompt_length=prompt_length, response_length=response_length,
            reward_components=reward_components, overlong=overlong,
            fallback_prompt_ids=fallback_prompt_ids, metrics=metrics,
            observations=sum(1 for t in view.turns if len(t.observation_ids))))
    dropped = sum(1 for s in samples if s.extra_fields.get("rollout_segment_dropped"))
    for sample in samples:
        sample.extra_fields.update({
            "rollout_job_id": traj.job_id,
            "rollout_state": job_pb2.Job.State.Name(job.state).removeprefix("STATE_"),  # type: ignore[arg-type]
            "rollout_termination": trajectory_pb2.TerminationReason.Name(
                traj.termination_reason).removeprefix("TERMINATION_REASON_"),
            "rollout_segments": len(views),
            "rollout_segments_dropped": dropped,
        })
        if error is not None:
            sample.extra_fields["rollout_error"] = f"{error.reason}: {error.message}"
    return samples


def from_flat(flat: Flat, *, succeeded: bool, turn_versions: Sequence[int], prompt_length: int,
              response_length: int, reward_components: Sequence[str] = (),
              overlong: str = "mask", fallback_prompt_ids: Sequence[int] = (),
              metrics: dict[str, float] | None = None, observations: int | None = None
              ) -> VerlSample:
    """The same mapping from a flattened trajectory (what the batcher's samples hold).
    ``observations`` counts tool observations; by default every turn but the last had one."""
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
    if flat.token_ids:
        p = flat.prompt_length
        prompt = flat.token_ids[:p]
        response, mask, logprobs = flat.token_ids[p:], flat.loss_mask[p:], flat.logprobs[p:]
    else:
        prompt, response, mask, logprobs = list(fallback_prompt_ids), [], [], []

    valid = succeeded and bool(response)
    truncated = False
    segment_dropped = False
    if len(prompt) > prompt_length and flat.token_ids and flat.segment > 0:
        # The harness's rewritten history outgrew prompt_length: this segment alone cannot be
        # trained; the step and the rollout's other segments go on.
        log.warning("job %s: segment %d of %d has a %d-token prompt (the harness's rewritten "
                    "history), longer than rollout.prompt_length=%d; dropped from training",
                    flat.job_id, flat.segment + 1, flat.num_segments, len(prompt), prompt_length)
        segment_dropped, valid = True, False
        prompt = prompt[-prompt_length:]
    elif len(prompt) > prompt_length:
        if flat.token_ids:
            raise PromptTooLong(
                f"job {flat.job_id}: the service rendered a {len(prompt)}-token prompt, longer "
                f"than rollout.prompt_length={prompt_length}; every sample of this task would "
                f"train on nothing. Set actor_rollout_ref.rollout.prompt_length (and "
                f"data.max_prompt_length) to at least {len(prompt)}.")
        prompt = prompt[-prompt_length:]  # verl's own rendering, cut as verl cuts prompts
    if len(response) > response_length:
        cut_model_tokens = any(mask[response_length:])
        response, mask = response[:response_length], mask[:response_length]
        logprobs = logprobs[:response_length]
        truncated = True
        if overlong == "mask" and cut_model_tokens:
            valid = False
    if not valid:
        mask = [0] * len(mask)
    routed = None
    if flat.routed_experts and flat.token_ids:
        per = flat.routed_expert_layers * flat.routed_expert_top_k
        start = flat.prompt_length - len(prompt)  # a cut prompt keeps its tail
        rows = [flat.routed_experts[(start + p) * per:(start + p + 1) * per]
                for p in range(len(prompt) + len(response))]
        k = flat.routed_expert_top_k
        routed = [[row[j:j + k] for j in range(0, per, k)] for row in rows]

    reward = float(flat.reward) if succeeded else 0.0
    info: dict[str, float] = {"reward": reward, "rollout_valid": float(valid),
                              "truncated": float(truncated)}
    for name in reward_components:
        if name in info:
            raise ValueError(f"reward component name {name!r} clashes with a fixed key")
        info[name] = float(flat.reward_components.get(name, 0.0)) if succeeded else 0.0
    versions = list(turn_versions)
    extra: dict[str, Any] = {
        "reward_extra_info": info,
        "min_global_steps": min(versions) if versions else None,
        "max_global_steps": max(versions) if versions else None,
        "turn_scores": [],
        "tool_rewards": [],
        "truncated": truncated,
        "rollout_valid": valid,
        "rollout_job_id": flat.job_id,
        "rollout_segment": flat.segment,
        "rollout_segment_dropped": segment_dropped,
    }
    if observations is None:
        observations = max(flat.num_turns - 1, 0)
    return VerlSample(
        prompt_ids=prompt, response_ids=response, response_mask=mask, response_logprobs=logprobs,
        reward_score=reward, num_turns=1 + flat.num_turns + observations,
        metrics=dict(metrics or {}), extra_fields=extra, routed_experts=routed)


def prompt_only(sample: VerlSample) -> VerlSample:
    """An untrainable row as the legacy verl worker should return it: its prompt and reward
    with an empty response. verl's data metrics (``critic/score/*``, ``critic/rewards/*``,
    ``response_length_non_aborted/*``) leave out rows with no response token, as aborted, so
    the scores trainers read are those of valid rollouts, never a failed job's 0 or a fill
    from outside the reward range; verl's GRPO still reads the reward (from the row's last
    column), so the group statistics are unchanged. The response's tokens stay in the
    service's trajectory (``rollout_job_id``)."""
    routed = (None if sample.routed_experts is None
              else sample.routed_experts[:len(sample.prompt_ids)])
    return dataclasses.replace(sample, response_ids=[], response_mask=[], response_logprobs=[],
                               routed_experts=routed)


def pad_batch(samples: Sequence[VerlSample], *, prompt_length: int, response_length: int,
              pad_token_id: int) -> dict[str, list[list[Any]]]:
    """verl's padded layout (``AgentLoopWorker._postprocess``), as lists: prompts left-padded,
    responses right-padded, the reward on each row's last response token."""
    out: dict[str, list[list[Any]]] = {k: [] for k in (
        "prompts", "responses", "response_mask", "input_ids", "attention_mask",
        "rollout_log_probs", "rm_scores")}
    for s in samples:
        lp, lr = len(s.prompt_ids), len(s.response_ids)
        if lp > prompt_length or lr > response_length:
            raise ValueError("sample longer than the configured lengths; cut it first")
        prompts = [pad_token_id] * (prompt_length - lp) + list(s.prompt_ids)
        responses = list(s.response_ids) + [pad_token_id] * (response_length - lr)
        out["prompts"].append(prompts)
        out["responses"].append(responses)
        out["input_ids"].append(prompts + responses)
        out["response_mask"].append(list(s.response_mask) + [0] * (response_length - lr))
        out["attention_mask"].append([0] * (prompt_length - lp) + [1] * (lp + lr)
                                     + [0] * (response_length - lr))
        out["rollout_log_probs"].append(list(s.response_logprobs)
                                        + [0.0] * (response_length - lr))
        scores = [0.0] * response_length
        scores[max(lr, 1) - 1] = s.reward_score
        out["rm_scores"].append(scores)
    return out


def _scalar(value: Any) -> Any:
    """numpy scalars and 0-d arrays (verl's non_tensor_batch) as plain Python values."""
    item = getattr(value, "item", None)
    if item is not None and getattr(value, "ndim", 1) == 0:
        return item()
    return value


def job_for_sample(sample: Mapping[str, Any], sampling_params: Mapping[str, Any], *,
                   environment: str, prompt_length: int, response_length: int, group_size: int,
                   max_turns: int | None = None, finish_after: int = 0,
                   max_tokens_per_turn: int | None = None, min_policy_version: int = 0,
                   limits: Mapping[str, Any] | None = None) -> job_pb2.JobSpec:
    """The job for one verl sample (its ``non_tensor_batch`` row plus verl's sampling params).

    The task payload is ``extra_info["rollout_task"]`` (the environment's own JSON task), in
    ``extra_info["rollout_environment"]`` or else ``environment``. Without a ``rollout_task``,
    the sample's last user message and ``reward_model.ground_truth`` become
    ``{"question", "answer"}``, the ``math`` environment's format. The sample's ``uid`` (verl's
    group of ``rollout.n`` samples of one prompt) becomes the job's group, so the service's
    group policies (early termination, per-group dynamic sampling) see verl's groups.
    """
    extra = _scalar(sample.get("extra_info")) or {}
    task = extra.get("rollout_task")
    env = extra.get("rollout_environment") or environment
    if task is None:
        raw = _scalar(sample.get("raw_prompt"))  # a list, or a numpy array of dicts
        messages = list(raw) if raw is not None else []
        question = next((m.get("content") for m in reversed(messages)
                         if isinstance(m, Mapping) and m.get("role") == "user"), None)
        answer = (_scalar(sample.get("reward_model")) or {}).get("ground_truth")
        if question is None or answer is None:
            raise ValueError("the sample has no extra_info.rollout_task, and no user message "
                             "with a reward_model.ground_truth to build a math task from")
        task = {"question": str(question), "answer": str(answer)}
    uid = str(_scalar(sample.get("uid")) or uuid.uuid4().hex)
    # The job id must be unique per sample (verl repeats a uid rollout.n times) and within
    # the service's charset and length.
    job_id = _JOB_ID_UNSAFE.sub("_", f"verl/{uid}")[:110] + f"/{uuid.uuid4().hex[:12]}"

    top_k = int(sampling_params.get("top_k", -1) or -1)
    sampling: dict[str, Any] = {
        "temperature": float(sampling_params.get("temperature", 1.0)),
        "top_p": float(sampling_params.get("top_p", 1.0)),
        "top_k": max(top_k, 0),  # verl says -1 for "off", the service says 0
        "max_tokens_per_turn": min(max_tokens_per_turn or response_length, response_length),
        # The service stops the episode at these budgets, so truncation here is the
        # exception: verl's row holds at most response_length generated tokens (plus the
        # observations between turns, which the total budget bounds).
        "total_token_budget": prompt_length + response_length,
        "max_response_tokens": response_length,
    }
    spec: dict[str, Any] = {
        "job_id": job_id, "environment": env, "task": dict(task), "sampling": sampling,
        "group": {"group_id": _JOB_ID_UNSAFE.sub("_", f"verl/{uid}")[:128],
                  "size": max(group_size, 1), "finish_after": finish_after},
        "min_policy_version": int(min_policy_version),
        "metadata": {"uid": uid, "index": str(_scalar(sample.get("index", ""))),
                     "data_source": str(_scalar(sample.get("data_source", "")))},
    }
    lim = dict(limits or {})
    if max_turns:
        lim["max_turns"] = int(max_turns)
    if lim:
        spec["limits"] = lim
    return job_spec(spec)
