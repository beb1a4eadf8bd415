"""Property: NeMo RL's GRPO advantage (restated in nemo_rl_advantage.py) over a batch where each
masked sample answers as the Gym agent does (the placeholder item, reward 0) gives every valid
row what it gets over its group's valid rows alone, in every estimator setting and group shape,
because the placeholder's prompt tokens (NeMo RL's grouping key) are no real prompt's. The live
agent is checked in test_gym_agent.py; this covers the shapes a live test cannot enumerate."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.trainer_adapters.nemo_rl.message_log import gym_output_items
from rollout.v1 import trajectory_pb2
from tests.trainer_adapters.nemo_rl.nemo_rl_advantage import nemo_rl_advantages

PLACEHOLDER = tuple(gym_output_items(trajectory_pb2.Trajectory(job_id="j"))[0][
    "prompt_token_ids"])


@st.composite
def batches(draw: st.DrawFn) -> list[list[float | None]]:
    """1-4 prompt groups of 1-10 rows; None: a masked (failed or cancelled) sample."""
    reward = st.integers(-20, 20).map(lambda x: x / 10)
    return draw(st.lists(st.lists(st.none() | reward, min_size=1, max_size=10),
                         min_size=1, max_size=4))


@settings(max_examples=300, deadline=None)
@given(groups=batches(), loo=st.booleans(), norm=st.booleans())
def test_property_masked_answers_leave_every_groups_statistics(
        groups: list[list[float | None]], loo: bool, norm: bool) -> None:
    keys: list[tuple[int, ...]] = []
    rewards: list[float] = []
    for g, group in enumerate(groups):
        for r in group:
            # A real prompt: the group's own tokens (never the placeholder's lone 0).
            keys.append(PLACEHOLDER if r is None else (1000 + g, 7, 8))
            rewards.append(0.0 if r is None else r)
    got = nemo_rl_advantages(keys, rewards, leave_one_out=loo, normalize=norm)
    at = 0
    for group in groups:
        valid = [r for r in group if r is not None]
        alone = iter(nemo_rl_advantages([0] * len(valid), valid, leave_one_out=loo,
                                        normalize=norm))
        for r in group:
            if r is None:
                assert got[at] == 0.0  # masked rows: all 0 in a group of their own
            else:
                assert got[at] == pytest.approx(next(alone), abs=1e-6)
            at += 1
