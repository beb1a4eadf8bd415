"""The verl field mapping and the job builder, without verl (plain Python), on hand-built
trajectories whose expected fields are written out by hand."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from rollout.trainer_adapters.verl.job_mapping import (
    PromptTooLong,
    job_for_sample,
    to_verl_sample,
    to_verl_samples,
)
from rollout.v1 import job_pb2, trajectory_pb2

SUCCEEDED, FAILED = job_pb2.Job.State.STATE_SUCCEEDED, job_pb2.Job.State.STATE_FAILED


def outcome(turns: list[dict[str, Any]], *, state: int = SUCCEEDED, reward: float = 1.0,
            components: dict[str, float] | None = None) -> Any:
    traj = trajectory_pb2.Trajectory(job_id="j", reward=reward, state=state,
                                     reward_components=components or {})
    for t in turns:
        traj.turns.add(prompt_ids=t["p"], output_ids=t["o"],
                       output_logprobs=[-1.0 - i for i in range(len(t["o"]))],
                       observation_ids=t.get("obs", []), policy_version=t.get("v", 0))
    return SimpleNamespace(trajectory=traj, state=state, error=None)


def test_prompt_longer_than_prompt_length_raises_naming_the_length() -> None:
    # Masking every row (the old behaviour) would train on nothing, silently.
    with pytest.raises(PromptTooLong, match=r"5-token prompt.*prompt_length=3.*at least 5"):
        to_verl_sample(outcome([{"p": [1, 2, 3, 4, 5], "o": [6, 7]}]),
                       prompt_length=3, response_length=8)
    # verl's own rendering of a job that produced no turn is cut as verl cuts prompts.
    s = to_verl_sample(outcome([], state=FAILED), prompt_length=3, response_length=8,
                       fallback_prompt_ids=[1, 2, 3, 4, 5])
    assert s.prompt_ids == [3, 4, 5] and s.response_ids == []


def test_overlong_default_trains_no_reward_on_a_cut_answer() -> None:
    # Response: model [2, 3, 4], tool output [5, 6], model [8, 9] (after prompt delta [7]).
    job = outcome([{"p": [1], "o": [2, 3, 4], "obs": [5, 6]}, {"p": [7], "o": [8, 9]}])
    # Cut at 5: the second turn's answer (8, 9) is gone. By default nothing is trained.
    masked = to_verl_sample(job, prompt_length=4, response_length=5)
    assert masked.response_ids == [2, 3, 4, 5, 6] and masked.response_mask == [0] * 5
    assert masked.reward_score == 1.0  # still reported, not trained
    assert masked.extra_fields["reward_extra_info"]["rollout_valid"] == 0.0
    assert masked.extra_fields["truncated"] is True
    # truncate: verl's tool-agent-loop behaviour, the prefix with its mask and the reward.
    kept = to_verl_sample(job, prompt_length=4, response_length=5, overlong="truncate")
    assert kept.response_mask == [1, 1, 1, 0, 0]
    assert kept.response_logprobs == [-1.0, -2.0, -3.0, 0.0, 0.0]
    assert kept.extra_fields["rollout_valid"] is True
    with pytest.raises(ValueError, match="overlong"):
        to_verl_sample(job, prompt_length=4, response_length=5, overlong="drop")


def test_cut_of_tool_output_only_keeps_the_row_trainable() -> None:
    # Model [2, 3] then tool output [4, 5, 6] after the last generation; cutting at 3 loses
    # only tool output, so every model token is kept and the reward was earned by them.
    job = outcome([{"p": [1], "o": [2, 3], "obs": [4, 5, 6]}])
    s = to_verl_sample(job, prompt_length=4, response_length=3)
    assert s.response_ids == [2, 3, 4] and s.response_mask == [1, 1, 0]
    assert s.extra_fields["rollout_valid"] is True and s.extra_fields["truncated"] is True


def test_failed_job_scores_zero_whatever_it_reported_and_keeps_fixed_keys() -> None:
    s = to_verl_sample(outcome([{"p": [1], "o": [2], "v": 4}], state=FAILED, reward=1.0,
                               components={"exact": 1.0}),
                       prompt_length=4, response_length=4, reward_components=["exact", "x"])
    assert s.reward_score == 0.0 and s.response_mask == [0]
    assert s.extra_fields["reward_extra_info"] == {
        "reward": 0.0, "rollout_valid": 0.0, "truncated": 0.0, "exact": 0.0, "x": 0.0}
    assert (s.extra_fields["min_global_steps"], s.extra_fields["max_global_steps"]) == (4, 4)
    with pytest.raises(ValueError, match="clashes"):
        to_verl_sample(outcome([{"p": [1], "o": [2]}]), prompt_length=4, response_length=4,
                       reward_components=["reward"])


def test_job_for_sample_maps_verl_fields() -> None:
    sample = {"raw_prompt": np.array([{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "2+2?"}], dtype=object),
              "reward_model": {"ground_truth": "4"}, "uid": np.str_("u-1"),
              "index": np.int64(7), "extra_info": {}}
    spec = job_for_sample(sample, {"temperature": 0.6, "top_p": 0.9, "top_k": -1},
                          environment="math", prompt_length=100, response_length=50,
                          group_size=4, max_turns=3, finish_after=2)
    assert spec.environment == "math"
    assert dict(spec.task) == {"question": "2+2?", "answer": "4"}
    assert spec.sampling.top_k == 0 and spec.sampling.temperature == pytest.approx(0.6)
    assert spec.sampling.total_token_budget == 150 and spec.sampling.max_tokens_per_turn == 50
    assert spec.sampling.max_response_tokens == 50  # verl's response_length
    assert (spec.group.group_id, spec.group.size, spec.group.finish_after) == ("verl/u-1", 4, 2)
    assert spec.job_id.startswith("verl/u-1/") and spec.limits.max_turns == 3
    assert dict(spec.metadata)["uid"] == "u-1" and dict(spec.metadata)["index"] == "7"
    with pytest.raises(ValueError, match="rollout_task"):
        job_for_sample({"raw_prompt": [], "extra_info": {}}, {}, environment="math",
                       prompt_length=1, response_length=1, group_size=1)


def test_a_too_long_later_segment_masks_itself_not_the_step(
        caplog: pytest.LogCaptureFixture) -> None:
    # Segment 1 starts at turn 1 with a 5-token prompt (the harness's rewritten history), over
    # prompt_length 4: that row trains nothing, says why, and nothing raises.
    job = outcome([{"p": [1, 2], "o": [3, 4]}, {"p": [1, 2, 9, 9, 9], "o": [5]}])
    job.trajectory.segments.add(first_turn=0)
    job.trajectory.segments.add(first_turn=1)
    with caplog.at_level("WARNING"):
        rows = to_verl_samples(job, prompt_length=4, response_length=4)
    assert [r.response_mask for r in rows] == [[1, 1], [0]]
    assert rows[1].extra_fields["rollout_segment_dropped"] is True
    assert rows[0].extra_fields["rollout_segments_dropped"] == 1
    assert "job j: segment 2 of 2 has a 5-token prompt" in caplog.text
    last = to_verl_sample(job, prompt_length=4, response_length=4)
    assert last.response_mask == [0] and last.extra_fields["rollout_valid"] is False


def test_a_prompt_that_fills_the_whole_budget_is_an_error_naming_job_and_length() -> None:
    job = outcome([])
    job.trajectory.termination_reason = trajectory_pb2.TERMINATION_REASON_TOKEN_BUDGET
    job.trajectory.metadata["prompt_tokens"] = "900"
    with pytest.raises(PromptTooLong, match=r"job j: its 900-token prompt .* budget of "
                                            r"prompt_length \+ response_length = 12"):
        to_verl_sample(job, prompt_length=4, response_length=8, fallback_prompt_ids=[1] * 4)
