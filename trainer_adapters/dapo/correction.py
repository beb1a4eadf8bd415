"""Rollout-vs-trainer mismatch corrections: importance weights, rejection, and their metrics.

The rollout engine samples from a distribution that is not exactly the trainer's (other kernels
and precision, a backend one version behind, a stale sample). With ``rho = pi_train /
pi_rollout`` per token (``pi_train`` is the trainer's "old" policy, the weights before this
step's update), the corrections the field ships, each selectable in the run config:

- **importance weights** (``is_level``): per token ``rho_t`` (``token``), or one weight per
  sequence, the product ``prod_t rho_t`` (``sequence``; unbiased, high variance), or none.
  ``is_mode = "truncate"`` caps them at ``is_upper`` (truncated IS, TIS); ``"mask"`` zeroes
  weights outside ``[is_lower, is_upper]`` (masked IS, MIS; verl's "IcePop" at token level).
- **rejection** (``rs_level``): drop from the loss every token whose ``rho_t`` (``token``), or
  every sequence whose geometric-mean ratio ``exp(mean_t log rho_t)`` (``sequence``), lies
  outside ``[rs_lower, rs_upper]``.
- **bypass** (``bypass``): the rollout logprobs *are* the old policy; the PPO ratio
  ``pi_theta / pi_rollout`` then carries the whole correction and no old logprobs are needed.

The weights are constants (detached); rejection only shrinks the loss mask. Each definition
follows verl 0.9.1's ``rollout_corr_helper`` (its tests check them on the same tensors).

Metrics, per step over the loss tokens: ``kl_token`` (mean over tokens of ``log pi_rollout -
log pi_train``, the k1 estimator of KL(rollout || train)), ``kl_seq`` (the same summed per
sequence, averaged over sequences), ``masked`` (fraction of loss tokens the correction removed
or weighted 0) and ``weight_mean``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SAFETY_BOUND = 20.0
"""Log ratios are clamped to +-this before ``exp`` (as verl does): exp(20) is large enough that
every cap is active, and no weight overflows."""

IS_LEVELS = ("token", "sequence", "none")
IS_MODES = ("truncate", "mask")
RS_LEVELS = ("none", "token", "sequence")


@dataclass(frozen=True)
class CorrectionConfig:
    is_level: str = "token"
    is_mode: str = "truncate"
    is_lower: float = 0.5
    """Lower bound of the weights ``mask`` mode keeps (unused by ``truncate``)."""
    is_upper: float = 2.0
    rs_level: str = "none"
    rs_lower: float = 0.5
    rs_upper: float = 2.0
    bypass: bool = False

    def __post_init__(self) -> None:
        for name, value, allowed in (("is_level", self.is_level, IS_LEVELS),
                                     ("is_mode", self.is_mode, IS_MODES),
                                     ("rs_level", self.rs_level, RS_LEVELS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if not 0 < self.is_lower <= self.is_upper:
            raise ValueError(f"need 0 < is_lower <= is_upper, got {self.is_lower}, "
                             f"{self.is_upper}")
        if not 0 < self.rs_lower <= self.rs_upper:
            raise ValueError(f"need 0 < rs_lower <= rs_upper, got {self.rs_lower}, "
                             f"{self.rs_upper}")


@dataclass(frozen=True)
class Correction:
    """What the loss needs: per-token weights and the loss mask after rejection."""

    weights: torch.Tensor
    """``[B, T]``, detached; 1 where no importance weighting applies."""
    mask: torch.Tensor
    """``[B, T]``: the loss mask with rejected tokens set to 0."""
    kl_sum: float
    """Sum over loss tokens of ``log pi_rollout - log pi_train`` (per token: divide by
    ``tokens``; per sequence: by ``sequences``)."""
    sequences: int
    """Sequences with at least one loss token."""
    tokens: int
    masked_tokens: int
    """Loss tokens whose weight is 0 after the correction (rejected, or masked IS)."""
    weight_sum: float
    truncated_tokens: int
    """Loss tokens whose weight the truncation cut."""


def correct(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
            cfg: CorrectionConfig) -> Correction:
    """Weights and mask for one (micro-)batch; ``old_logp`` is the trainer's old policy (in
    bypass mode the caller passes the rollout logprobs, so every ratio is 1)."""
    mask = mask.to(old_logp.dtype)
    log_ratio = (old_logp - rollout_logp).detach() * mask
    seq_log_ratio = log_ratio.sum(-1, keepdim=True)
    counts = mask.sum(-1, keepdim=True)
    truncated = torch.zeros_like(mask, dtype=torch.bool)
    if cfg.is_level == "none" or cfg.bypass:
        weights = torch.ones_like(log_ratio)
    else:
        level = log_ratio if cfg.is_level == "token" else seq_log_ratio.expand_as(log_ratio)
        raw = torch.exp(level.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * mask
        if cfg.is_mode == "truncate":
            weights = raw.clamp(max=cfg.is_upper)
            truncated = raw > cfg.is_upper
        else:
            keep = (raw >= cfg.is_lower) & (raw <= cfg.is_upper)
            weights = torch.where(keep, raw, torch.zeros_like(raw))
    keep_mask = torch.ones_like(mask)
    if cfg.rs_level != "none":
        if cfg.rs_level == "token":
            stat = log_ratio
        else:  # the geometric-mean ratio of the sequence
            stat = (seq_log_ratio / counts.clamp(min=1)).expand_as(log_ratio)
        stat = stat.clamp(-SAFETY_BOUND, SAFETY_BOUND)
        lo, hi = torch.log(torch.tensor(cfg.rs_lower)), torch.log(torch.tensor(cfg.rs_upper))
        keep_mask = ((stat >= lo) & (stat <= hi)).to(mask.dtype)
    out_mask = mask * keep_mask
    effective = weights * out_mask
    has_tokens = counts.squeeze(-1) > 0
    return Correction(
        weights=weights.detach(), mask=out_mask, kl_sum=float((-log_ratio).sum()),
        sequences=int(has_tokens.sum()), tokens=int(mask.sum()),
        masked_tokens=int(((effective == 0) & (mask > 0)).sum()),
        weight_sum=float(effective.sum()),
        truncated_tokens=int((truncated & (out_mask > 0)).sum()))
