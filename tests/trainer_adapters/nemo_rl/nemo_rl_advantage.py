"""NeMo RL's GRPO advantage, restated in plain Python (NeMo RL is not installable here; read from
NVIDIA-NeMo/RL at 7ea279ab). Stdlib only, so the Gym driver (in .venv-nemo-gym) and the tests
(in the main environment) share it.

- Rows are grouped by the token ids of their initial prompt messages, taken from each row's own
  message log (``extract_initial_prompt_messages`` in grpo.py; on the Gym path the first
  message, whose tokens are the first output item's ``prompt_token_ids``), padded and compared
  whole (``torch.unique(..., dim=0)``).
- ``calculate_baseline_and_std_per_prompt`` (nemo_rl/algorithms/utils.py), called with an
  all-ones valid mask: a group of one takes its own reward as baseline; otherwise the baseline is
  the mean of the group's rewards, or with leave-one-out the mean of the others'; the std is
  the (leave-one-out) sample's mean of squares minus the square of its mean, times
  ``m/(m-1)`` for the ``m`` rewards it averages (NaN made 0).
- ``GRPOAdvantageEstimator.compute_advantage`` (advantage_estimator.py): reward - baseline,
  divided by ``std + 1e-6`` where the std is above 0 when rewards are normalised.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def nemo_rl_advantages(keys: Sequence[object], rewards: Sequence[float], *,
                       leave_one_out: bool = True, normalize: bool = True) -> list[float]:
    out = []
    for i, key in enumerate(keys):
        group = [j for j, k in enumerate(keys) if k == key]
        if len(group) <= 1:
            out.append(0.0)
            continue
        others = [rewards[j] for j in group if not (leave_one_out and j == i)]
        m = len(others)
        base = sum(others) / m
        if m > 1:
            var = (sum(r * r for r in others) / m - base * base) * (m / (m - 1))
            std = math.sqrt(var) if var > 0 else 0.0
        else:
            std = 0.0  # NeMo RL: 0 * inf is NaN, made 0
        adv = rewards[i] - base
        out.append(adv / (std + 1e-6) if normalize and std > 0 else adv)
    return out
