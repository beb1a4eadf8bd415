"""Rewards to advantages: DAPO's soft overlong punishment and group normalisation.

Both work on plain Python floats (per sample), before any tensor exists, so they are easy to
check by hand and cost nothing next to the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def overlong_penalty(length: int, max_length: int, cache: int) -> float:
    """DAPO's soft overlong punishment for a response of ``length`` tokens.

    0 up to ``max_length - cache``; then linear down to -1 at ``max_length``; -1 beyond. A hard
    cut-off would punish a good answer that ran one token long exactly like garbage; the ramp
    tells the policy "shorter" before the truncation point.
    """
    if cache <= 0:
        return -1.0 if length > max_length else 0.0
    start = max_length - cache
    if length <= start:
        return 0.0
    if length >= max_length:
        return -1.0
    return (start - length) / cache


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """``(r - mean) / (std + eps)`` within one group, with the sample standard deviation
    (Bessel's n - 1, as ``torch.std`` in verl's GRPO estimator).

    A group whose rewards are all equal gets all-zero advantages (never NaN): dynamic sampling
    keeps such groups out, but one that slips in must contribute nothing. So does a group of one.
    """
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    if n == 1:
        return [0.0]
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + eps) for r in rewards]
