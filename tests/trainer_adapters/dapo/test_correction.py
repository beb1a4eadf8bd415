"""The mismatch corrections against verl 0.9.1's own ``rollout_corr_helper`` and bypass-mode
loss on identical tensors (the approach of the DAPO-loss oracle test), and their metrics by
hand. Every mode of the config is checked: token and sequence truncated IS, token and sequence
masked IS, token and sequence rejection by ratio bounds, bypass."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from rollout.trainer_adapters.dapo.correction import CorrectionConfig, correct
from rollout.trainer_adapters.dapo.loss import ClipConfig, policy_loss
from rollout.trainer_adapters.dapo.run_config import load_config

MODES = {
    "token_tis": CorrectionConfig(is_level="token", is_upper=2.0),
    "seq_tis": CorrectionConfig(is_level="sequence", is_upper=2.0),
    "token_mis": CorrectionConfig(is_level="token", is_mode="mask", is_lower=0.5, is_upper=2.0),
    "seq_mis": CorrectionConfig(is_level="sequence", is_mode="mask", is_lower=0.5,
                                is_upper=2.0),
    "token_rs": CorrectionConfig(is_level="none", rs_level="token", rs_lower=0.6, rs_upper=1.5),
    "seq_rs": CorrectionConfig(is_level="none", rs_level="sequence", rs_lower=0.8,
                               rs_upper=1.25),
}


def tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    old = torch.randn(8, 10, dtype=torch.float64) * 0.3 - 2
    rollout = old + torch.randn(8, 10, dtype=torch.float64) * 0.35  # some far off
    logp = old + torch.randn(8, 10, dtype=torch.float64) * 0.1
    mask = (torch.rand(8, 10) > 0.2).double()
    mask[3] = 0  # a row without loss tokens
    adv = torch.randn(8, 1, dtype=torch.float64).expand(8, 10).contiguous()
    return {"old": old, "rollout": rollout, "logp": logp, "mask": mask, "adv": adv}


def test_metrics_and_flags_by_hand() -> None:
    # Two tokens of one sequence: log ratios ln 3 and ln 0.25 (old - rollout).
    old = torch.tensor([[math.log(3.0), math.log(0.25)]], dtype=torch.float64)
    rollout = torch.zeros_like(old)
    mask = torch.ones_like(old)
    tis = correct(old, rollout, mask, CorrectionConfig(is_upper=2.0))
    assert tis.weights[0].tolist() == pytest.approx([2.0, 0.25]) and tis.truncated_tokens == 1
    mis = correct(old, rollout, mask, CorrectionConfig(is_mode="mask", is_lower=0.5))
    assert mis.weights[0].tolist() == pytest.approx([0.0, 0.0]) and mis.masked_tokens == 2
    seq = correct(old, rollout, mask, CorrectionConfig(is_level="sequence"))
    assert seq.weights[0].tolist() == pytest.approx([0.75, 0.75])  # 3 x 0.25
    # KL(rollout || train) per token: mean of rollout - old = -(ln 3 + ln 0.25) / 2.
    assert tis.kl_sum / tis.tokens == pytest.approx(-(math.log(3) + math.log(0.25)) / 2)
    assert tis.kl_sum / tis.sequences == pytest.approx(-(math.log(3) + math.log(0.25)))
    with pytest.raises(ValueError, match="is_level"):
        CorrectionConfig(is_level="sentence")
    with pytest.raises(ValueError, match=r"\[algo\] mismatch correction: rs_level"):
        load_config(None, {"algo.rs_level": "batch"})
    assert load_config(None, {"algo.tis_cap": 0}).correction().is_level == "none"


VERL_SCRIPT = """
import json, sys, torch
from verl.trainer.ppo.core_algos import compute_policy_loss_bypass_mode
from verl.trainer.ppo.rollout_corr_helper import (
    compute_offpolicy_metrics, compute_rollout_correction_weights,
    compute_rollout_rejection_mask)
d = json.load(sys.stdin)
T = lambda k: torch.tensor(d[k], dtype=torch.float64)
old, rollout, mask, logp, adv = T("old"), T("rollout"), T("mask"), T("logp"), T("adv")
lr = old - rollout
out = {}
for name, level, thr in (("token_tis", "token", 2.0), ("seq_tis", "sequence", 2.0),
                         ("token_mis", "token", "0.5_2.0"), ("seq_mis", "sequence", "0.5_2.0")):
    w, _ = compute_rollout_correction_weights(lr, mask, rollout_is=level, rollout_is_threshold=thr)
    out[name] = {"weights": w.tolist(), "mask": mask.tolist()}
# verl's k1 bounds are on pi_rollout / pi_train: ratio bounds [L, U] are [1/U, 1/L] there.
for name, opt, lo, hi in (("token_rs", "token_k1", 0.6, 1.5), ("seq_rs", "seq_mean_k1", 0.8, 1.25)):
    m, _ = compute_rollout_rejection_mask(lr, mask, rollout_rs=opt,
                                          rollout_rs_threshold=f"{1 / hi}_{1 / lo}")
    out[name] = {"weights": mask.tolist(), "mask": m.tolist()}
out["kl"] = compute_offpolicy_metrics(old, rollout, mask)["kl"]
class Cfg(dict):
    clip_ratio = 0.2; clip_ratio_low = 0.2; clip_ratio_high = 0.28
    global_batch_info = {}
    policy_loss = {"rollout_correction": {"loss_type": "ppo_clip", "rollout_is": None,
                                          "rollout_rs": "token_k1",
                                          "rollout_rs_threshold": f"{1 / 1.5}_{1 / 0.6}"}}
loss, _ = compute_policy_loss_bypass_mode(rollout, logp, adv, mask, "token-mean",
                                          Cfg(clip_ratio_c=3.0))
out["bypass_loss"] = loss.item()
print(json.dumps(out))
"""


@pytest.mark.slow  # importing verl in its own venv takes a minute on this machine
@pytest.mark.timeout(600)
def test_every_mode_matches_verls_rollout_correction(verl_venv: Path) -> None:
    t = tensors()
    proc = subprocess.run([str(verl_venv), "-c", VERL_SCRIPT],
                          input=json.dumps({k: v.tolist() for k, v in t.items()}),
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, cfg in MODES.items():
        ours = correct(t["old"], t["rollout"], t["mask"], cfg)
        w = torch.tensor(theirs[name]["weights"], dtype=torch.float64)
        m = torch.tensor(theirs[name]["mask"], dtype=torch.float64)
        assert torch.allclose(ours.mask, m, atol=1e-6), name
        assert torch.allclose(ours.weights * ours.mask, w * m, atol=1e-6), name
        # The test data exercise the mode: something is capped, masked or rejected.
        assert ours.masked_tokens + ours.truncated_tokens > 0, name
    tis = correct(t["old"], t["rollout"], t["mask"], MODES["token_tis"])
    assert abs(tis.kl_sum / tis.tokens - theirs["kl"]) < 1e-6
    # Bypass: the rollout's logprobs are the old policy; rejection on pi_theta / pi_rollout.
    bypass = CorrectionConfig(is_level="none", rs_level="token", rs_lower=0.6, rs_upper=1.5,
                              bypass=True)
    corr = correct(t["logp"], t["rollout"], t["mask"], bypass)
    loss, _ = policy_loss(t["logp"], t["rollout"], t["adv"], corr.mask,
                          ClipConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, tis_cap=None),
                          is_weights=corr.weights)
    assert abs(loss.item() - theirs["bypass_loss"]) < 1e-6
