"""Trainer-facing trajectory helpers: flat alignment and the JSONL round trip."""

from __future__ import annotations

import json

import pytest

from rollout.client.trajectory import flatten, from_json, to_json, total_tokens
from rollout.v1 import trajectory_pb2 as tpb


def two_turns() -> tpb.Trajectory:
    return tpb.Trajectory(
        job_id="j", group_id="g", reward=1.0, reward_components={"exact": 1.0},
        termination_reason=tpb.TERMINATION_REASON_SUBMITTED,
        turns=[
            tpb.Turn(prompt_ids=[10, 11, 12], output_ids=[20, 21], output_logprobs=[-0.1, -0.2],
                     observation_ids=[30], loss_mask=[0, 0, 0, 1, 1, 0], policy_version=3),
            tpb.Turn(prompt_ids=[13], output_ids=[22], output_logprobs=[-0.3],
                     loss_mask=[0, 1], policy_version=4),
        ])


def test_flatten_aligns_tokens_masks_and_logprobs() -> None:
    flat = flatten(two_turns())
    assert flat.token_ids == [10, 11, 12, 20, 21, 30, 13, 22]
    assert flat.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert flat.logprobs == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, -0.3])
    assert flat.policy_versions == [0, 0, 0, 3, 3, 0, 0, 4]
    assert flat.prompt_length == 3 and flat.response_ids == [20, 21, 30, 13, 22]
    assert flat.num_turns == 2 and flat.termination == "SUBMITTED"
    assert total_tokens(two_turns()) == 8


def test_flatten_derives_a_missing_mask_and_rejects_inconsistent_turns() -> None:
    t = tpb.Trajectory(turns=[tpb.Turn(prompt_ids=[1], output_ids=[2], output_logprobs=[-1])])
    assert flatten(t).loss_mask == [0, 1]
    bad = tpb.Trajectory(turns=[tpb.Turn(prompt_ids=[1], output_ids=[2, 3],
                                         output_logprobs=[-1])])
    with pytest.raises(ValueError, match="logprobs"):
        flatten(bad)
    bad = tpb.Trajectory(turns=[tpb.Turn(prompt_ids=[1], output_ids=[2], output_logprobs=[-1],
                                         loss_mask=[1])])
    with pytest.raises(ValueError, match="loss_mask"):
        flatten(bad)


def test_json_round_trip() -> None:
    t = two_turns()
    line = json.dumps(to_json(t))
    data = json.loads(line)
    assert data["turns"][0]["output_ids"] == [20, 21]  # snake_case, ints stay ints
    assert from_json(data) == t
    assert from_json({**data, "added_later": 1}) == t  # newer files still load
