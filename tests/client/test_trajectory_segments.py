"""Trajectories of several token sequences (a harness that rewrote its history): each segment
is its own training sequence with exact ids and the trajectory's reward, in flatten and in the
three trainer adapters; one segment behaves exactly as no segments."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollout.client.batcher import Batch, BatchStats, Group, _sample
from rollout.client.trajectory import flatten, flatten_all, flatten_segments, segment_views
from rollout.v1 import job_pb2
from rollout.v1 import trajectory_pb2 as tpb

SUCCEEDED = job_pb2.Job.STATE_SUCCEEDED
FIRST, REWRITTEN = tpb.Segment.REASON_FIRST, tpb.Segment.REASON_HISTORY_REWRITTEN


def harness_trajectory(segments: list[tuple[int, int]] | None = None,
                       reward: float = 1.0, job_id: str = "h") -> tpb.Trajectory:
    """Segment 0: turns 0-1 merged; segment 1: turn 2, a fresh prompt (it re-renders part of
    segment 0 differently: why it could not extend it)."""
    traj = tpb.Trajectory(
        job_id=job_id, group_id="g", reward=reward, state=SUCCEEDED,
        termination_reason=tpb.TERMINATION_REASON_NO_TOOL_CALL,
        turns=[tpb.Turn(prompt_ids=[1, 2, 3], output_ids=[40, 41], output_logprobs=[-.1, -.2],
                        observation_ids=[5, 6], policy_version=2),
               tpb.Turn(prompt_ids=[7], output_ids=[42], output_logprobs=[-.3],
                        policy_version=2),
               tpb.Turn(prompt_ids=[1, 2, 9, 9, 7], output_ids=[43, 44, 45],
                        output_logprobs=[-.4, -.5, -.6], policy_version=3)])
    for first, reason in segments if segments is not None else [(0, FIRST), (2, REWRITTEN)]:
        traj.segments.add(first_turn=first, reason=reason)  # type: ignore[arg-type]
    return traj


def test_each_segment_is_one_exact_sequence_with_the_trajectorys_reward() -> None:
    traj = harness_trajectory()
    with pytest.raises(ValueError, match="flatten_segments"):
        flatten(traj)  # concatenating would score segment 1 under a context never seen
    a, b = flatten_segments(traj)
    assert a.token_ids == [1, 2, 3, 40, 41, 5, 6, 7, 42]
    assert a.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert a.logprobs == pytest.approx([0, 0, 0, -.1, -.2, 0, 0, 0, -.3])
    assert a.prompt_length == 3 and a.num_turns == 2
    assert b.token_ids == [1, 2, 9, 9, 7, 43, 44, 45]
    assert b.loss_mask == [0, 0, 0, 0, 0, 1, 1, 1]
    assert b.logprobs == pytest.approx([0, 0, 0, 0, 0, -.4, -.5, -.6])
    assert b.prompt_length == 5 and b.policy_versions[-1] == 3
    assert (a.reward, b.reward) == (1.0, 1.0)
    assert [(f.segment, f.num_segments) for f in (a, b)] == [(0, 2), (1, 2)]
    assert len(flatten_all([traj, harness_trajectory(job_id="x")])) == 4


def test_one_segment_behaves_exactly_as_none() -> None:
    merged = harness_trajectory(segments=[])
    one = harness_trajectory(segments=[(0, FIRST)])
    assert flatten(one) == flatten(merged)
    assert flatten_segments(one) == [flatten(merged)]
    assert segment_views(merged) == [merged]


@pytest.mark.parametrize("bad", [[(1, FIRST)], [(0, FIRST), (0, REWRITTEN)],
                                 [(0, FIRST), (3, REWRITTEN)]])
def test_segments_that_do_not_cut_the_turns_are_refused(bad: list[tuple[int, int]]) -> None:
    with pytest.raises(ValueError, match="segments must start at turn 0"):
        flatten_segments(harness_trajectory(segments=bad))


def test_the_batcher_keeps_every_segment_and_dapo_trains_each_with_the_advantage() -> None:
    from rollout.trainer_adapters.dapo.run_config import load_config
    from rollout.trainer_adapters.dapo.trainer import shape_and_normalise

    good, bad = _sample("h", 1, harness_trajectory()), _sample("m", 2, harness_trajectory(
        segments=[], reward=0.0, job_id="m"))
    assert [f.token_ids for f in good.flats] == [f.token_ids for f in
                                                 flatten_segments(harness_trajectory())]
    assert good.flat.token_ids == [1, 2, 9, 9, 7, 43, 44, 45]  # the episode's last sequence
    assert good.generated_tokens == 6 and bad.generated_tokens == 6
    cfg = load_config(None, {"algo.overlong_cache": 0})
    batch = Batch(groups=(Group("g", {}, (good, bad)),), stats=BatchStats(), policy_version=0)
    items, _ = shape_and_normalise(batch, cfg)
    assert [i.sample.flat.token_ids for i in items] == [
        *(f.token_ids for f in good.flats), bad.flat.token_ids]
    advantages = [i.advantage for i in items]
    assert advantages[0] == advantages[1] > 0 > advantages[2]


def test_verl_rows_per_segment_in_the_stream_and_the_last_segment_per_sample() -> None:
    from rollout.trainer_adapters.verl.job_mapping import from_flat, to_verl_sample

    traj = harness_trajectory()
    job = SimpleNamespace(trajectory=traj, state=SUCCEEDED, error=None)
    sample = to_verl_sample(job, prompt_length=16, response_length=16)
    assert sample.prompt_ids == [1, 2, 9, 9, 7] and sample.response_ids == [43, 44, 45]
    assert sample.response_mask == [1, 1, 1]
    assert sample.extra_fields["rollout_segments"] == 2
    rows = [from_flat(f, succeeded=True, turn_versions=[2, 2, 3], prompt_length=16,
                      response_length=16) for f in _sample("h", 1, traj).flats]
    assert [(r.prompt_ids, r.response_ids, r.response_mask) for r in rows] == [
        ([1, 2, 3], [40, 41, 5, 6, 7, 42], [1, 1, 0, 0, 0, 1]),
        ([1, 2, 9, 9, 7], [43, 44, 45], [1, 1, 1])]
    assert [r.reward_score for r in rows] == [1.0, 1.0]


def test_nemo_rl_gets_one_contiguous_sequence_the_last_segment() -> None:
    from rollout.trainer_adapters.nemo_rl.message_log import gym_output_items, to_message_log

    items = gym_output_items(harness_trajectory())
    assert [i["prompt_token_ids"] for i in items if "prompt_token_ids" in i] == [[1, 2, 9, 9, 7]]
    log = to_message_log(harness_trajectory())
    assert [m["token_ids"] for m in log] == [[1, 2, 9, 9, 7], [43, 44, 45]]
    merged = gym_output_items(harness_trajectory(segments=[]))
    assert [i["prompt_token_ids"] for i in merged if "prompt_token_ids" in i] == [
        [1, 2, 3], [1, 2, 3, 40, 41, 5, 6, 7], [1, 2, 3, 40, 41, 5, 6, 7, 42, 1, 2, 9, 9, 7]]


def test_a_refused_flatten_says_why_the_sequences_exist() -> None:
    # mini-swe-agent drops a reply it cannot parse from its own history, so each such reply's
    # next request does not carry it: one segment per reply. The refusal must say so, per cause.
    traj = harness_trajectory(segments=[(0, FIRST), (1, tpb.Segment.REASON_NEW_CONVERSATION),
                                        (2, REWRITTEN)])
    with pytest.raises(ValueError) as refused:
        flatten(traj)
    text = str(refused.value)
    assert "holds 3 token sequences" in text
    assert "1 began with a request that did not carry the answers before it" in text
    assert "1 began with a request of a conversation of its own" in text
    assert "flatten_segments()" in text
