"""Rewards for a group's untrainable rows that leave its valid rows' GRPO advantages as if those
rows were alone.

verl's legacy agent-loop worker must return one row per sample and groups rows by the ``uid`` it
assigned, so a failed (or wholly masked) rollout cannot leave its group: its row stays, masked,
and its reward enters the group's statistics. GRPO's advantage of a row is
``(r - mean) / (std + eps)`` over the group (unbiased std), and over one row it is
``r / (1 + eps)`` (verl takes mean 0 and std 1 for a group of one). The valid rows' advantages
are those of the valid rows alone exactly when the N rows' mean and std equal the valid rows'
own (mean, std). With ``k`` untrainable rows the fills ``f`` must therefore have, about the
target mean ``M``, the sum ``D = -sum(r - M)`` and the sum of squares
``Q = (N-1) std^2 - sum((r - M)^2)``: an offset ``D/k`` shared by all and a spread
``E = Q - D^2/k`` split between them, half above and half below (one at the offset when ``k``
is odd).

Why some groups cannot be exact: the N rows' z-scores always sum to 0 and their squares to
``N - 1``, and the valid rows' must sum to 0 and ``v - 1``, so the fills' z-scores must sum to
0 with squares summing to ``k``. One fill (``k = 1``) cannot do both unless the group's std is 0;
it then keeps the mean, and the valid advantages keep their signs and ratios at
``sqrt((N-1)/(N-2))`` times the scale. A lone valid row (``v = 1``) gets verl's own
``r / (1 + eps)`` when ``|r| <= (N-1)/sqrt(N)`` (the largest z-score N values allow), else that
bound with r's sign (in a group of two, any nonzero r gets +-1/sqrt(2): the mean is kept, so
that Dr.GRPO stays exact). A group with no valid row gets equal fills (every advantage 0). Dr.GRPO
(no std) depends on the mean only, which every case keeps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence


def grpo_target(valid: Sequence[float]) -> tuple[float, float]:
    """verl's GRPO (mean, std) of a group made of ``valid`` alone (unbiased std; a group of one
    has mean 0 and std 1)."""
    v = len(valid)
    if v == 1:
        return 0.0, 1.0
    mean = math.fsum(valid) / v
    return mean, math.sqrt(math.fsum((r - mean) ** 2 for r in valid) / (v - 1))


def grpo_fills(valid: Sequence[float], size: int) -> list[float]:
    """The rewards of a group's ``size - len(valid)`` untrainable rows, in rank order, such that
    verl's GRPO over all ``size`` rows gives each valid row the advantage it gets over
    ``valid`` alone (see the module docstring for the groups where that is impossible and what
    they get instead). Each untrainable row takes the fill at its rank among them, so rows
    computing this apart agree."""
    k = size - len(valid)
    if k <= 0:
        return []
    if not valid:
        return [0.0] * k
    mean, std = grpo_target(valid)
    dev = math.fsum(r - mean for r in valid)
    squares = (size - 1) * std ** 2 - math.fsum((r - mean) ** 2 for r in valid)
    offset = mean - dev / k
    spread = squares - dev ** 2 / k
    if k == 1 or spread <= 0.0:
        return [offset] * k
    paired = k - k % 2  # an odd k keeps one fill at the offset
    step = math.sqrt(spread / paired)
    fills = [offset] * (k % 2)
    for i in range(paired):
        fills.append(offset + step if i % 2 == 0 else offset - step)
    return fills


def fill_for(job_id: str, valid: Mapping[str, float], roster: Iterable[str],
             size: int) -> float | None:
    """The fill of untrainable job ``job_id`` in a group of ``size`` whose frozen view has the
    valid rewards ``valid`` (by job id) and lists ``roster`` (every job id of the group,
    settled or not): the :func:`grpo_fills` of ``valid`` at ``job_id``'s rank among the group's
    jobs that are not valid. Every job that is not valid holds one rank, including one still
    running at the freeze, so the untrainable rows that compute this from the same view take
    distinct fills that complement each other; a job that later turned out valid trains with
    its own reward in its slot. None: the view lists more than ``size`` jobs outside
    ``valid`` (a view gone wrong; the caller keeps its own reward)."""
    others = sorted((set(roster) | {job_id}) - set(valid))
    fills = grpo_fills(sorted(valid.values()), size)
    rank = others.index(job_id)
    return fills[rank] if rank < len(fills) else None


__all__ = ["fill_for", "grpo_fills", "grpo_target"]
