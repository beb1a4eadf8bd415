"""The Rollout Service as a NeMo Gym agent server: ``/run``, ``/v1/responses``,
``/aggregate_metrics``.

NeMo RL has no hook for an outside engine that owns the agent loop; its sanctioned route is NeMo
Gym, which posts each dataset row to an agent server's ``/run`` and trains on the token ids the
output items carry. This agent runs the row as one job of the service (sandbox, tools, reward
included) and answers with nemo-gym's own response models, so NeMo RL's Gym integration consumes
it unchanged: one token-carrying item per model call (``prompt_token_ids`` contiguous,
``generation_token_ids``, ``generation_log_probs``), ``reward``, ``reward_components``, and
``mask_sample`` for a job that failed or was cancelled (its reward is no measurement of the
policy), set both at the top level (nemo-gym's field) and in ``instance_config`` (the only
place NeMo RL's GRPO reads it: ``_extract_mask_sample_flags`` in ``nemo_rl/experience/
rollouts.py`` takes ``full_result["instance_config"]["mask_sample"]`` and
``_apply_mask_sample_filter`` zeroes those samples' ``loss_multiplier``).

NeMo RL computes its baseline and std (leave-one-out or not) over every row it groups together,
masked ones included (``calculate_baseline_and_std_per_prompt`` is called with an all-ones valid
mask), and it groups rows by the token ids of the first message of each row's own message log,
which is this agent's first item's ``prompt_token_ids``. A masked sample therefore answers with
the placeholder item alone (below), never its partial turns, and reward 0: its prompt is not
its group's, so NeMo RL's statistics for the group are those of its valid rows alone, exactly
what NeMo RL computes when the failed rows are not there (whatever its estimator settings),
and the masked rows share a group of their own whose rewards are all 0 (advantage 0, and no
gradient: their loss multiplier is 0). No value for a masked row in the group could do this:
a leave-one-out advantage weighs a row's own reward by N/(N-1) for a group of N rows.

Three rules keep NeMo RL's post-processing and metrics whole:

- NeMo RL turns every result into a message log *before* it reads ``mask_sample``, and a result
  without any token-carrying item fails the run. A masked sample (failed or cancelled, with or
  without turns) therefore answers with one placeholder item (token 0 as prompt and
  generation, logprob 0.0) beside ``mask_sample: true``: it is never trained on. The job id
  in ``rollout_job_id`` finds its partial turns in the service.
- ``reward_components`` has the same keys in every answer, whatever the outcome: always
  ``{"reward": reward}`` (Gym readers take components as parts that add up to the reward; the
  service's components are named measurements that need not). The service's components travel
  in ``rollout_reward_components``: the configured ``reward_components`` names when set (0.0
  when missing, as for a failed job), else what the environment reported.
- The agent needs no Ray cluster (the service runs the work), so it declares
  ``ray_enabled = False`` and Gym starts none for it.

A row names its task in ``rollout_task`` (the environment's JSON task) and optionally
``rollout_environment``; without them the last user message and ``expected_answer`` (or
``answer``) become a ``math`` task. ``/v1/responses`` reads the same keys from the request's
``metadata`` (``rollout_task`` as a JSON string). Runs inside nemo-gym's environment; uses only
the client side of this package.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar

from fastapi import Body, HTTPException
from nemo_gym.base_resources_server import BaseMultiRewardVerifyResponse, BaseRunRequest
from nemo_gym.base_responses_api_agent import (
    BaseResponsesAPIAgentConfig,
    SimpleResponsesAPIAgent,
)
from nemo_gym.openai_utils import NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming
from pydantic import ConfigDict

from rollout.client.specs import job_spec
from rollout.trainer_adapters.job_runner import JobOutcome, shared_runner
from rollout.trainer_adapters.nemo_rl.message_log import gym_output_items
from rollout.v1 import job_pb2, trajectory_pb2

_FAILURE_KINDS: dict[int, str] = {  # JobError.Code -> nemo_gym.failure_kinds vocabulary
    job_pb2.JobError.Code.CODE_TIMEOUT: "agent_timeout",
    job_pb2.JobError.Code.CODE_BACKEND_UNAVAILABLE: "provider_unavailable",
    job_pb2.JobError.Code.CODE_CANCELLED: "cancelled",
}


class RolloutServiceAgentConfig(BaseResponsesAPIAgentConfig):
    address: str = "127.0.0.1:50051"
    """The service's gRPC address."""
    token: str = ""
    """Bearer token, when the service requires one."""
    environment: str = "math"
    """Environment of rows that name none."""
    max_turns: int = 0
    """Most LLM turns per job; 0 keeps the environment's default."""
    total_token_budget: int = 0
    """Most tokens per trajectory; 0 takes ``max_total_sequence_length`` when set, else the
    service's default."""
    max_total_sequence_length: int = 0
    """NeMo RL's ``policy.max_total_sequence_length``: the job's token budget, so the service
    stops an episode where NeMo RL would cut it. 0 leaves the budget to
    ``total_token_budget``."""
    max_response_tokens: int = 0
    """Most tokens the model generates per episode (the sum over its turns; the job's
    ``sampling.max_response_tokens``): set it to the response length the trainer budgets, e.g.
    NeMo RL's ``policy.max_total_sequence_length`` minus the longest prompt, so the service
    ends the episode with a token-budget termination instead of NeMo RL truncating it. 0: no
    separate bound."""
    reward_components: list[str] = []
    """Component names reported in ``rollout_reward_components`` of every answer (0.0 when
    missing), so per-component columns line up; empty reports what each job measured."""


class RolloutServiceRunRequest(BaseRunRequest):
    model_config = ConfigDict(extra="allow")


class RolloutServiceVerifyResponse(BaseMultiRewardVerifyResponse):
    model_config = ConfigDict(extra="allow")


class RolloutServiceAgent(SimpleResponsesAPIAgent):
    """Each ``/run`` is one job of the Rollout Service."""

    config: RolloutServiceAgentConfig
    ray_enabled: ClassVar[bool] = False

    async def responses(self, body: NeMoGymResponseCreateParamsNonStreaming = Body()
                        ) -> NeMoGymResponse:
        meta = dict(body.metadata or {})
        task = json.loads(meta["rollout_task"]) if "rollout_task" in meta else None
        outcome = await self._run_job(body, task, meta.get("rollout_environment"),
                                      meta.get("answer"))
        return self._response(body, outcome)

    async def run(self, body: RolloutServiceRunRequest = Body()) -> RolloutServiceVerifyResponse:
        extra = body.model_extra or {}
        answer = extra.get("expected_answer", extra.get("answer"))
        outcome = await self._run_job(body.responses_create_params,
                                      extra.get("rollout_task"),
                                      extra.get("rollout_environment"), answer)
        traj = outcome.trajectory
        reward = float(traj.reward) if outcome.succeeded else 0.0
        measured = {k: float(v) for k, v in traj.reward_components.items()} \
            if outcome.succeeded else {}
        names = self.config.reward_components
        extra_components = {n: measured.get(n, 0.0) for n in names} if names else measured
        error = outcome.error
        failure_kind = None if outcome.succeeded else _FAILURE_KINDS.get(
            int(error.code) if error is not None else 0, "agent_run_error")
        # The row's own keys (task and rollout indices, agent_ref, verifier metadata) come
        # back with the answer, as nemo-gym's agents do; Gym's aggregation keys rows by them.
        return RolloutServiceVerifyResponse(
            **extra,
            responses_create_params=body.responses_create_params,
            response=self._response(body.responses_create_params, outcome),
            reward=reward, reward_components={"reward": reward},
            mask_sample=not outcome.succeeded,
            **({} if outcome.succeeded else {"instance_config": {
                **dict(extra.get("instance_config") or {}), "mask_sample": True}}),
            failure_kind=failure_kind,
            failure_reason=(f"{error.reason}: {error.message}" if error is not None else None),
            rollout_job_id=traj.job_id, rollout_state=outcome.state_name,
            rollout_reward_components=extra_components,
            num_turns=len(traj.turns))

    async def _run_job(self, params: NeMoGymResponseCreateParamsNonStreaming, task: Any,
                       environment: str | None, answer: Any) -> JobOutcome:
        if task is None:
            question = _last_user_text(params.input)
            if question is None or answer is None:
                raise HTTPException(422, "the row has no rollout_task, and no user message with "
                                         "an expected_answer to build a math task from")
            task = {"question": question, "answer": str(answer)}
        if not isinstance(task, Mapping):
            raise HTTPException(422, "rollout_task must be a JSON object (the environment's "
                                     "task)")
        sampling: dict[str, Any] = {}
        if params.temperature is not None:
            sampling["temperature"] = float(params.temperature)
        if params.top_p is not None:
            sampling["top_p"] = float(params.top_p)
        if params.max_output_tokens:
            sampling["max_tokens_per_turn"] = int(params.max_output_tokens)
        budget = self.config.total_token_budget or self.config.max_total_sequence_length
        if budget:
            sampling["total_token_budget"] = budget
        if self.config.max_response_tokens:
            sampling["max_response_tokens"] = self.config.max_response_tokens
        spec: dict[str, Any] = {"job_id": f"gym/{uuid.uuid4().hex}",
                                "environment": environment or self.config.environment,
                                "task": dict(task), "sampling": sampling}
        if self.config.max_turns:
            spec["limits"] = {"max_turns": self.config.max_turns}
        try:
            proto = job_spec(spec)
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from None
        runner = shared_runner(self.config.address, self.config.token or None)
        try:
            outcome = await runner.run(proto)
        except ValueError as exc:  # JobRejectedError: the service named what to fix
            raise HTTPException(422, str(exc)) from None
        traj = outcome.trajectory
        if outcome.succeeded and not traj.turns and traj.termination_reason in (
                trajectory_pb2.TERMINATION_REASON_TOKEN_BUDGET,
                trajectory_pb2.TERMINATION_REASON_CONTEXT_LENGTH):
            # The prompt alone filled the budget: the episode trained on nothing, silently.
            raise HTTPException(422, (
                f"job {traj.job_id}: its prompt alone filled the job's token budget of "
                f"{proto.sampling.total_token_budget} tokens (its prompt has "
                f"{traj.metadata.get('prompt_tokens', 'more than that many')} tokens), so the "
                f"episode produced no turn; raise "
                f"policy.max_total_sequence_length (the agent's max_total_sequence_length) "
                f"above the prompt's length"))
        return outcome

    def _response(self, params: NeMoGymResponseCreateParamsNonStreaming,
                  outcome: JobOutcome) -> NeMoGymResponse:
        traj = outcome.trajectory
        # A masked sample's turns stay out: its first prompt must not be its group's (see the
        # module docstring), and nothing of it is trained.
        items = gym_output_items(traj if outcome.succeeded else
                                 trajectory_pb2.Trajectory(job_id=traj.job_id))
        return NeMoGymResponse.model_validate({
            "id": f"resp_{traj.job_id or uuid.uuid4().hex}".replace("/", "_"),
            "created_at": 0, "model": params.model or "rollout-service", "object": "response",
            "output": items, "parallel_tool_calls": False,
            "tool_choice": "auto", "tools": [],
            "status": "completed" if outcome.succeeded else "incomplete",
        })


def _last_user_text(items: Any) -> str | None:
    if isinstance(items, str):
        return items
    for item in reversed(list(items or [])):
        role = getattr(item, "role", None) if not isinstance(item, Mapping) else item.get("role")
        if role != "user":
            continue
        content = item.get("content") if isinstance(item, Mapping) else item.content
        if isinstance(content, str):
            return content
        texts = [c.get("text", "") if isinstance(c, Mapping) else getattr(c, "text", "")
                 for c in content or []]
        return "".join(texts)
    return None


if __name__ == "__main__":
    # `entrypoint: app.py` in a Gym config runs a module like this one.
    RolloutServiceAgent.run_webserver()
