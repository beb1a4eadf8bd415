"""The legacy fill against verl's own GRPO: a group's untrainable rows take ``grpo_fills`` of the
valid rewards, and verl's ``compute_grpo_outcome_advantage`` over the whole filled group gives
each valid row the advantage it gets over the valid rows alone (to 1e-6), with and without the
std; untrainable rows get 0 (verl multiplies their all-zero mask in). Groups where that cannot
hold (one fill and a nonzero std; a lone valid row past the largest z-score) get what
``group_fill``'s docstring promises. verl runs in .venv-verl (``drive_grpo.py``), one batch per
line over a pipe, so a property test can ask it hundreds of times.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rollout.trainer_adapters.group_fill import fill_for, grpo_fills
from tests.trainer_adapters.venvs import ROOT, VERL_PY, require


class Verl:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def advantages(self, scores: list[float], uids: list[str], trained: list[bool],
                   norm: bool) -> list[float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"scores": scores, "uids": uids, "trained": trained,
                                          "norm": norm}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["advantages"]


@pytest.fixture(scope="module")
def verl() -> Iterator[Verl]:
    require(VERL_PY)
    proc = subprocess.Popen([str(VERL_PY), str(ROOT / "tests/trainer_adapters/verl/drive_grpo.py")],
                            cwd=str(ROOT), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline()) == {"ready": True}
        yield Verl(proc)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def filled(rewards: list[float | None]) -> tuple[list[float], list[bool]]:
    """The group's scores with each untrainable row (None) given the fill at its rank."""
    valid = [r for r in rewards if r is not None]
    fills = iter(grpo_fills(valid, len(rewards)))
    return ([r if r is not None else next(fills) for r in rewards],
            [r is not None for r in rewards])


def compare(verl: Verl, rewards: list[float | None], norm: bool) -> tuple[list[float],
                                                                          list[float]]:
    """verl's advantages of the valid rows over the filled group, and over the valid rows
    alone; the filled group's untrainable rows are checked to get 0."""
    scores, trained = filled(rewards)
    whole = verl.advantages(scores, ["g"] * len(scores), trained, norm)
    assert [a for a, t in zip(whole, trained, strict=True) if not t] == [0.0] * trained.count(
        False)
    valid = [r for r in rewards if r is not None]
    alone = verl.advantages(valid, ["g"] * len(valid), [True] * len(valid), norm)
    return [a for a, t in zip(whole, trained, strict=True) if t], alone


F = None
SHAPES = [  # (rewards, None = failed or masked)
    [1.0, F, F, 0.0],
    [1.0, F, 0.0, F, 1.0, 0.0, F, F],
    [0.3, F, 1.0, F, 0.0, F, 0.5],  # three fills: one on the mean
    [2.0, -1.0, F, F, F, 0.5, F, F, F, 1.5],
    [1.0, 1.0, F, F, 1.0],  # zero std
    [1.0, 1.0, 1.0, F],  # zero std, one fill
    [0.5, F, F],  # one valid row, within the largest z-score (verl: r / (1 + eps))
    [-0.8, F, F, F, F],
]


@pytest.mark.parametrize("rewards", SHAPES, ids=lambda r: "".join(
    "x" if v is None else "v" for v in r))
@pytest.mark.parametrize("norm", [True, False], ids=["grpo", "dr_grpo"])
def test_valid_rows_get_their_advantages_over_the_valid_rows_alone(
        verl: Verl, rewards: list[float | None], norm: bool) -> None:
    got, alone = compare(verl, rewards, norm)
    assert got == pytest.approx(alone, abs=1e-6)


def test_one_fill_keeps_the_mean_and_the_valid_advantages_ratios(verl: Verl) -> None:
    """[1, failed, 0, 1]: one fill cannot keep both the mean and the std (see group_fill),
    so it keeps the mean: Dr.GRPO is exact, GRPO's advantages are sqrt((N-1)/(N-2)) times
    the valid-only ones."""
    rewards: list[float | None] = [1.0, None, 0.0, 1.0]
    assert filled(rewards)[0][1] == pytest.approx(2 / 3)
    got, alone = compare(verl, rewards, norm=False)
    assert got == pytest.approx(alone, abs=1e-6)
    got, alone = compare(verl, rewards, norm=True)
    s = statistics.stdev([1.0, 0.0, 1.0])
    assert got == pytest.approx([a * (s + 1e-6) / (s * math.sqrt(2 / 3) + 1e-6) for a in alone],
                                abs=1e-6)


def test_a_lone_valid_row_past_the_largest_z_score_gets_that_bound(verl: Verl) -> None:
    """One valid row in a group of N: verl alone gives it r / (1 + eps); N values cannot give a
    z-score past (N-1)/sqrt(N), so a larger r gets that, with r's sign."""
    cases: list[tuple[list[float | None], float]] = [
        ([1.0, None], 1 / math.sqrt(2)), ([None, 0.3], 1 / math.sqrt(2)),  # two rows
        ([None, -3.0, None], -2 / math.sqrt(3))]
    for rewards, bound in cases:
        got, alone = compare(verl, rewards, norm=True)
        assert alone == pytest.approx([r for r in rewards if r is not None], abs=1e-5)
        assert got == pytest.approx([bound], abs=1e-5)  # verl's eps beside a std under 1


def test_a_group_without_a_valid_row_gets_no_advantage(verl: Verl) -> None:
    scores, _ = filled([None, None, None])
    assert verl.advantages(scores, ["g"] * 3, [True] * 3, norm=True) == [0.0, 0.0, 0.0]


rewards_st = st.integers(-20, 20).map(lambda x: x / 10)


@st.composite
def groups(draw: st.DrawFn) -> list[float | None]:
    """A group of 2-12 rows, at least one failed; rewards on a 0.1 grid, as scores are."""
    size = draw(st.integers(2, 12))
    failed = draw(st.sets(st.integers(0, size - 1), min_size=1, max_size=size))
    return [None if i in failed else draw(rewards_st) for i in range(size)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(rewards=groups(), norm=st.booleans())
@example(rewards=[None, 0.1], norm=True).via("discovered failure")
@example(rewards=[None, 0.0, 0.1], norm=True).via("discovered failure")
def test_property_the_fill_is_exact_wherever_the_algebra_allows(
        verl: Verl, rewards: list[float | None], norm: bool) -> None:
    """Exact (to 1e-6) for Dr.GRPO always, and for GRPO with two fills or more and two valid
    rows or more, or a zero std, or a lone valid row within the bound; otherwise the promised
    scale (one fill) or bound (a lone valid row)."""
    valid = [r for r in rewards if r is not None]
    n, v = len(rewards), len(valid)
    k = n - v
    if v == 0:
        return  # every row masked: test_a_group_without_a_valid_row_gets_no_advantage
    got, alone = compare(verl, rewards, norm)
    if not norm:
        assert got == pytest.approx(alone, abs=1e-6)
    elif v == 1:
        bound = (n - 1) / math.sqrt(n)
        # Two rows keep the mean: any nonzero r gets the bound.
        want = math.copysign(bound, valid[0]) if n == 2 and valid[0] else alone[0]
        clipped = abs(want) >= bound
        assert got[0] == pytest.approx(max(-bound, min(bound, want)),
                                       abs=1e-5 if clipped else 1e-6)
    elif k == 1 and len(set(valid)) > 1:
        # The mean kept; verl's std over N rows is the valid rows' sqrt((N-2)/(N-1)).
        s = statistics.stdev(valid)
        scale = (s + 1e-6) / (s * math.sqrt((n - 2) / (n - 1)) + 1e-6)
        assert got == pytest.approx([a * scale for a in alone], abs=1e-6)
    else:
        assert got == pytest.approx(alone, abs=1e-6)


def test_fills_from_one_frozen_view_take_distinct_slots() -> None:
    """Each job outside the frozen view's valid set holds one slot of the fills, by job id,
    whether it had settled at the freeze or not; the untrainable ones' fills together with
    the valid rewards keep the valid rows' mean and std when every slot is a fill."""
    valid = {"a": 1.0, "c": 0.0}
    roster = {"a", "b", "c", "d", "e"}
    slots = grpo_fills([0.0, 1.0], 5)
    got = [fill_for(j, valid, roster, 5) for j in ("b", "d", "e")]
    assert got == slots
    rows = [1.0, 0.0, *got]
    assert statistics.mean(rows) == pytest.approx(0.5)
    assert statistics.stdev(rows) == pytest.approx(statistics.stdev([1.0, 0.0]))
    # A job the view does not list (submitted after the freeze) still takes a slot; one more
    # than the group holds gets none.
    assert fill_for("f", valid, {"a", "c"}, 5) == slots[0]
    assert fill_for("z", valid, roster, 5) is None
