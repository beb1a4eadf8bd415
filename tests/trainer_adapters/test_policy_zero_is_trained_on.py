"""A job the policy ended with reward 0 (a workspace over quota, a hung grader) SUCCEEDED: the
adapters train on it like any other 0, and mask only what failed (the service's fault)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from rollout.client.trajectory import flatten
from rollout.trainer_adapters.verl.job_mapping import to_verl_sample
from rollout.v1 import job_pb2, trajectory_pb2

SUCCEEDED, FAILED = job_pb2.Job.State.STATE_SUCCEEDED, job_pb2.Job.State.STATE_FAILED
OVER_QUOTA = trajectory_pb2.TERMINATION_REASON_WORKSPACE_TOO_LARGE


def job(state: int, termination: int, reward: float = 0.0) -> Any:
    traj = trajectory_pb2.Trajectory(job_id="j", reward=reward, state=state,
                                     termination_reason=termination)
    traj.turns.add(prompt_ids=[1, 2], output_ids=[3, 4], output_logprobs=[-0.5, -0.25])
    return SimpleNamespace(trajectory=traj, state=state, error=None)


def test_a_policy_fault_is_a_sample_with_reward_0() -> None:
    zero = job(SUCCEEDED, OVER_QUOTA)
    flat = flatten(zero.trajectory)
    assert flat is not None and flat.reward == 0.0
    sample = to_verl_sample(zero, prompt_length=4, response_length=4)
    assert sample.response_mask == [1, 1] and sample.reward_score == 0.0
    assert sample.extra_fields["rollout_valid"] is True
    assert sample.extra_fields["rollout_termination"] == "WORKSPACE_TOO_LARGE"


def test_only_a_failed_job_is_masked() -> None:
    failed = job(FAILED, trajectory_pb2.TERMINATION_REASON_ERROR, reward=1.0)
    assert flatten(failed.trajectory) is None
    sample = to_verl_sample(failed, prompt_length=4, response_length=4)
    assert sample.response_mask == [0, 0] and sample.extra_fields["rollout_valid"] is False
