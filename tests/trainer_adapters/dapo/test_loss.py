"""The DAPO loss and advantages against hand-worked numbers (and verl's own loss, when its
venv exists). Every expected value below is computed on paper from the definitions, not by the
code under test."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from rollout.trainer_adapters.dapo.advantages import group_advantages, overlong_penalty
from rollout.trainer_adapters.dapo.loss import (
    ClipConfig,
    chunked_token_logprobs,
    policy_loss,
    token_logprobs,
)
from tests.trainer_adapters.dapo.large_tensors import LargeTensors

ROOT = Path(__file__).resolve().parents[3]
NO_TIS = ClipConfig(tis_cap=None)


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def logs(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, old_logp) whose exp-difference is ``ratios``."""
    old = t([[-1.0] * len(r) for r in ratios])
    return old + torch.log(t(ratios)), old


def test_token_mean_weighs_every_token_of_the_batch_equally() -> None:
    # Sequence 0: one token, A = +1; sequence 1: three tokens, A = -0.5; ratio 1 everywhere.
    # Per-token loss is -A: -1 and 0.5, 0.5, 0.5 -> sum 0.5 over 4 tokens = 0.125. (A mean of
    # per-sequence means would give (-1 + 0.5) / 2 = -0.25.)
    logp, old = logs([[1, 1, 1], [1, 1, 1]])
    mask = t([[1, 0, 0], [1, 1, 1]])
    adv = t([[1.0], [-0.5]])
    loss, stats = policy_loss(logp, old, adv, mask, NO_TIS)
    assert abs(loss.item() - 0.125) < 1e-6
    assert stats.tokens == 4 and stats.clip_low == stats.clip_high == stats.dual_clip == 0


def test_decoupled_clip() -> None:
    # eps_low 0.2, eps_high 0.28. Each token alone (A, r) -> loss:
    #  (+1, 1.5) -> max(-1.5, -1.28) = -1.28      clipped high
    #  (+1, 0.5) -> max(-0.5, -0.8)  = -0.5       not clipped (the clip never helps a drop)
    #  (-1, 0.7) -> max(0.7, 0.8)    =  0.8       clipped low
    #  (-1, 1.25)-> max(1.25, 1.25)  =  1.25
    #  (+1, 1.25)-> max(-1.25,-1.25) = -1.25      inside the high clip (a symmetric 0.2 would cut)
    cases = [(1, 1.5, -1.28), (1, 0.5, -0.5), (-1, 0.7, 0.8), (-1, 1.25, 1.25), (1, 1.25, -1.25)]
    for adv, ratio, expected in cases:
        logp, old = logs([[ratio]])
        loss, _ = policy_loss(logp, old, t([[adv]]), t([[1]]), NO_TIS)
        assert abs(loss.item() - expected) < 1e-6, (adv, ratio)
    logp, old = logs([[r for _, r, _ in cases]])
    adv = t([[a for a, _, _ in cases]])
    loss, stats = policy_loss(logp, old, adv, torch.ones_like(adv), NO_TIS)
    assert abs(loss.item() - sum(e for *_, e in cases) / 5) < 1e-6
    assert (stats.clip_high, stats.clip_low) == (pytest.approx(1 / 5), pytest.approx(1 / 5))


def test_dual_clip_caps_negative_advantage_tokens() -> None:
    #  (-1, 4) -> max(4, 1.28) = 4 -> min(4, 3 * 1) = 3
    #  (-2, 5) -> max(10, 2.56) = 10 -> min(10, 3 * 2) = 6
    #  (+1, 4) -> max(-4, -1.28) = -1.28 (positive advantages are never dual-clipped)
    #  (-1, 2) -> max(2, 1.28) = 2 (below c: untouched)
    cases = [(-1, 4.0, 3.0), (-2, 5.0, 6.0), (1, 4.0, -1.28), (-1, 2.0, 2.0)]
    logp, old = logs([[r for _, r, _ in cases]])
    adv = t([[a for a, _, _ in cases]])
    mask = torch.ones_like(adv)
    loss, stats = policy_loss(logp, old, adv, mask, NO_TIS)
    assert abs(loss.item() - (3 + 6 - 1.28 + 2) / 4) < 1e-6
    assert stats.dual_clip == pytest.approx(2 / 4)
    off, _ = policy_loss(logp, old, adv, mask, ClipConfig(dual_clip_c=None, tis_cap=None))
    assert abs(off.item() - (4 + 10 - 1.28 + 2) / 4) < 1e-6
    with pytest.raises(ValueError, match="dual_clip_c"):
        ClipConfig(dual_clip_c=1.0)


def test_gradients_vanish_on_clipped_tokens_and_match_by_hand_elsewhere() -> None:
    # d/d logp of -A r is -A r. Tokens: (+1, 0.5) unclipped -> -0.5 / 3; (+1, 1.5) clipped -> 0;
    # (-1, 4) dual-clipped (constant 3) -> 0.
    logp, old = logs([[0.5, 1.5, 4.0]])
    logp.requires_grad_(True)
    loss, _ = policy_loss(logp, old, t([[1, 1, -1]]), t([[1, 1, 1]]), NO_TIS)
    loss.backward()
    assert logp.grad is not None
    assert torch.allclose(logp.grad, t([[-0.5 / 3, 0.0, 0.0]]), atol=1e-9)


def test_truncated_importance_weights() -> None:
    # old - rollout = ln 3 -> weight min(3, 2) = 2; ln 0.5 -> 0.5. Ratio 1, A = +1: loss per
    # token -w -> (-2 - 0.5) / 2.
    logp, old = logs([[1.0, 1.0]])
    rollout = old - torch.log(t([[3.0, 0.5]]))
    loss, stats = policy_loss(logp, old, t([[1.0]]), t([[1, 1]]), ClipConfig(tis_cap=2.0),
                              rollout_logp=rollout)
    assert abs(loss.item() - (-2.5 / 2)) < 1e-6
    assert stats.tis_truncated == pytest.approx(0.5)
    uncapped, _ = policy_loss(logp, old, t([[1.0]]), t([[1, 1]]), ClipConfig(tis_cap=None),
                              rollout_logp=rollout)
    assert abs(uncapped.item() - (-1.0)) < 1e-6  # correction off: plain ratio-1 loss


def test_micro_batches_normalised_by_the_batch_token_count_sum_to_the_full_loss() -> None:
    torch.manual_seed(0)
    logp = torch.randn(4, 6, dtype=torch.float64) * 0.3 - 1
    old = logp + torch.randn(4, 6, dtype=torch.float64) * 0.3
    adv = torch.randn(4, 1, dtype=torch.float64)
    mask = (torch.rand(4, 6) > 0.3).double()
    full, _ = policy_loss(logp, old, adv, mask, NO_TIS)
    total = float(mask.sum())
    parts = [policy_loss(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], NO_TIS,
                         num_tokens=total)[0] for i in (0, 2)]
    assert abs((parts[0] + parts[1]).item() - full.item()) < 1e-9


def test_overlong_penalty_ramp() -> None:
    # L_max 20, cache 5: no penalty to 15, then -(L - 15) / 5, -1 from 20 on.
    assert [overlong_penalty(n, 20, 5) for n in (0, 15, 16, 18, 20, 25)] == \
        pytest.approx([0, 0, -0.2, -0.6, -1, -1], abs=1e-12)
    assert overlong_penalty(21, 20, 0) == -1 and overlong_penalty(20, 20, 0) == 0


def test_group_advantages() -> None:
    # [1, 0, 1, 0]: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735.
    adv = group_advantages([1, 0, 1, 0], eps=0.0)
    assert adv == pytest.approx([0.8660254, -0.8660254] * 2, abs=1e-6)
    zero = group_advantages([1.0, 1.0, 1.0])
    assert zero == [0.0, 0.0, 0.0] and not any(math.isnan(a) for a in zero)
    assert group_advantages([0.7]) == [0.0] and group_advantages([]) == []


def test_zero_variance_group_contributes_no_gradient() -> None:
    logp, old = logs([[0.5, 2.0, 1.0]])
    logp.requires_grad_(True)
    adv = torch.tensor(group_advantages([1, 1, 1]), dtype=torch.float64).reshape(3, 1)[:1]
    loss, _ = policy_loss(logp, old, adv, t([[1, 1, 1]]), ClipConfig())
    loss.backward()
    assert loss.item() == 0 and logp.grad is not None and not logp.grad.any()
    assert not torch.isnan(logp.grad).any()


def test_token_logprobs_and_entropy_by_hand() -> None:
    # Logits [0, ln 3] -> p = [1/4, 3/4]; log p(1) = ln 0.75; entropy = -(.25 ln .25 + .75 ln .75).
    logits = torch.tensor([[[0.0, math.log(3)]]])
    lp, ent = token_logprobs(logits, torch.tensor([[1]]))
    assert abs(lp.item() - math.log(0.75)) < 1e-6
    assert abs(ent.item() + 0.25 * math.log(0.25) + 0.75 * math.log(0.75)) < 1e-6
    # Temperature 2 halves the logits: p = softmax([0, ln 3 / 2]) = [1/(1+sqrt3), sqrt3/(1+sqrt3)].
    lp2, _ = token_logprobs(logits, torch.tensor([[0]]), temperature=2.0)
    assert abs(lp2.item() - math.log(1 / (1 + math.sqrt(3)))) < 1e-6


def test_chunked_logprobs_equal_the_whole_logits_and_their_gradients() -> None:
    torch.manual_seed(3)
    head = torch.nn.Linear(5, 11, bias=False).double()
    hidden = torch.randn(2, 7, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 7))
    whole_lp, whole_ent = token_logprobs(head(hidden), targets, temperature=0.7)
    (whole_lp * torch.arange(14.0).reshape(2, 7)).sum().backward()
    want, want_w = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad = head.weight.grad = None
    lp, ent = chunked_token_logprobs(hidden, head, targets, temperature=0.7, chunk=3)
    (lp * torch.arange(14.0).reshape(2, 7)).sum().backward()
    assert torch.allclose(lp, whole_lp, atol=1e-6) and torch.allclose(ent, whole_ent, atol=1e-6)
    assert torch.allclose(hidden.grad, want, atol=1e-6)
    assert torch.allclose(head.weight.grad, want_w, atol=1e-6)


def test_chunked_logprobs_hold_at_most_two_chunks_of_logits_through_the_backward_pass() -> None:
    """The batch's 256 positions x 4096 logits are never whole, and neither pass keeps a
    chunk's softmax or temporaries beside its logits: at most two ``chunk x vocabulary``
    buffers are alive at once, forward and backward (the checkpointed form holds six)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 4096, bias=False)
    hidden = torch.randn(4, 64, 8, requires_grad=True)
    targets = torch.randint(0, 4096, (4, 64))
    one_chunk = 16 * 4096 * 4
    watch = LargeTensors(floor=one_chunk // 2)
    with watch:
        lp, _ = chunked_token_logprobs(hidden, head, targets, temperature=0.7, chunk=16)
        lp.sum().backward()
    assert head.weight.grad is not None and hidden.grad is not None
    assert watch.peak <= 2 * one_chunk, f"{watch.peak / one_chunk} chunks alive at once"


VERL_SCRIPT = """
import json, sys, torch
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
d = json.load(sys.stdin)
class Cfg(dict):
    clip_ratio = 0.2; clip_ratio_low = 0.2; clip_ratio_high = 0.28
    global_batch_info = {}
cfg = Cfg(clip_ratio_c=3.0)
T = lambda k: torch.tensor(d[k], dtype=torch.float64)
loss, m = compute_policy_loss_vanilla(T("old"), T("logp"), T("adv"), T("mask"), "token-mean",
                                      cfg, rollout_is_weights=T("w"))
print(json.dumps({"loss": loss.item(), "clipfrac_lower": m["actor/pg_clipfrac_lower"]}))
"""


@pytest.mark.slow  # importing verl in its own venv takes a minute on this machine
@pytest.mark.timeout(600)
def test_matches_verl_policy_loss_on_identical_tensors(verl_venv: Path) -> None:
    torch.manual_seed(1)
    logp = torch.randn(6, 9, dtype=torch.float64) * 0.2 - 2
    old = logp + torch.randn(6, 9, dtype=torch.float64) * 0.6  # many clipped tokens
    rollout = old + torch.randn(6, 9, dtype=torch.float64) * 0.5
    adv = torch.randn(6, 1, dtype=torch.float64).expand(6, 9).contiguous()
    mask = (torch.rand(6, 9) > 0.25).double()
    cfg = ClipConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, tis_cap=2.0)
    ours, stats = policy_loss(logp, old, adv, mask, cfg, rollout_logp=rollout)
    from rollout.trainer_adapters.dapo.loss import importance_weights

    weights = importance_weights(old, rollout, 2.0)
    payload = {k: v.tolist() for k, v in dict(logp=logp, old=old, adv=adv, mask=mask,
                                               w=weights).items()}
    proc = subprocess.run([str(verl_venv), "-c", VERL_SCRIPT], input=json.dumps(payload),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert abs(ours.item() - theirs["loss"]) < 1e-6
    assert stats.dual_clip == pytest.approx(theirs["clipfrac_lower"], abs=1e-9)
