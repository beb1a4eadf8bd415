"""Trainer-facing trajectory helpers: flat alignment and the JSONL round trip."""

from __future__ import annotations

import json

import pytest

from rollout.client.trajectory import flatten, flatten_all, from_json, to_json, total_tokens
from rollout.v1 import job_pb2
from rollout.v1 import trajectory_pb2 as tpb

SUCCEEDED = job_pb2.Job.STATE_SUCCEEDED


def two_turns() -> tpb.Trajectory:
    return tpb.Trajectory(
        job_id="j", group_id="g", reward=1.0, reward_components={"exact": 1.0},
        termination_reason=tpb.TERMINATION_REASON_SUBMITTED, state=SUCCEEDED,
        labels={"step": "17"}, seed=1234, logprobs_kind=job_pb2.LOGPROBS_KIND_PROCESSED,
        turns=[
            tpb.Turn(prompt_ids=[10, 11, 12], output_ids=[20, 21], output_logprobs=[-0.1, -0.2],
                     observation_ids=[30], loss_mask=[0, 0, 0, 1, 1, 0], policy_version=3),
            tpb.Turn(prompt_ids=[13], output_ids=[22], output_logprobs=[-0.3],
                     loss_mask=[0, 1], policy_version=4),
        ])


def test_flatten_aligns_tokens_masks_and_logprobs() -> None:
    flat = flatten(two_turns())
    assert flat is not None
    assert flat.token_ids == [10, 11, 12, 20, 21, 30, 13, 22]
    assert flat.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert flat.logprobs == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, -0.3])
    assert flat.policy_versions == [0, 0, 0, 3, 3, 0, 0, 4]
    assert flat.prompt_length == 3 and flat.response_ids == [20, 21, 30, 13, 22]
    assert flat.num_turns == 2 and flat.termination == "SUBMITTED"
    assert total_tokens(two_turns()) == 8
    assert (flat.state, flat.labels, flat.seed, flat.logprobs_kind) == (
        "SUCCEEDED", {"step": "17"}, 1234, "PROCESSED")


def test_flatten_skips_jobs_that_did_not_succeed_unless_asked() -> None:
    failed = two_turns()
    failed.state = job_pb2.Job.STATE_FAILED
    failed.error.CopyFrom(job_pb2.JobError(code=job_pb2.JobError.CODE_TIMEOUT,
                                           reason="RUN_TIMEOUT", stage=job_pb2.STAGE_RUN))
    cancelled = two_turns()
    cancelled.state = job_pb2.Job.STATE_CANCELLED
    stateless = two_turns()
    stateless.ClearField("state")  # written by a server before Trajectory.state existed
    for traj in (failed, cancelled, stateless):
        assert flatten(traj) is None
    kept = flatten(failed, keep_failed=True)
    assert kept.state == "FAILED" and kept.error_reason == "RUN_TIMEOUT"
    assert kept.token_ids == flatten(two_turns(), keep_failed=True).token_ids
    batch = flatten_all([failed, two_turns(), cancelled])
    assert [f.state for f in batch] == ["SUCCEEDED"]
    assert len(flatten_all([failed, two_turns(), cancelled], keep_failed=True)) == 3


def test_flatten_derives_a_missing_mask_and_rejects_inconsistent_turns() -> None:
    t = tpb.Trajectory(state=SUCCEEDED,
                       turns=[tpb.Turn(prompt_ids=[1], output_ids=[2], output_logprobs=[-1])])
    assert flatten(t, keep_failed=True).loss_mask == [0, 1]
    bad = tpb.Trajectory(turns=[tpb.Turn(prompt_ids=[1], output_ids=[2, 3],
                                         output_logprobs=[-1])])
    with pytest.raises(ValueError, match="logprobs"):
        flatten(bad, keep_failed=True)
    bad = tpb.Trajectory(turns=[tpb.Turn(prompt_ids=[1], output_ids=[2], output_logprobs=[-1],
                                         loss_mask=[1])])
    with pytest.raises(ValueError, match="loss_mask"):
        flatten(bad, keep_failed=True)


def test_json_round_trip() -> None:
    t = two_turns()
    line = json.dumps(to_json(t))
    data = json.loads(line)
    assert data["turns"][0]["output_ids"] == [20, 21]  # snake_case, ints stay ints
    assert from_json(data) == t
    assert from_json({**data, "added_later": 1}) == t  # newer files still load
