"""The DAPO policy-gradient loss on padded ``[batch, tokens]`` tensors.

Per token, with ratio ``r = exp(logp - old_logp)`` and advantage ``A``:

- decoupled clip (DAPO, "clip-higher"): ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``;
  a larger ``eps_high`` lets unlikely tokens with positive advantage grow, which keeps entropy
  from collapsing;
- dual clip (Ye et al. 2020): for ``A < 0`` the loss is also capped at ``-A c``, so one token
  whose ratio exploded cannot dominate the step with an unbounded negative-advantage push;
- truncated importance sampling: the rollout engine's sampling distribution is not exactly the
  trainer's (kernels, precision, a backend that was one version behind); each token's loss is
  weighted by ``min(exp(old_logp - rollout_logp), cap)``, detached, so the gradient estimates
  the trainer's policy while a token the engine found far likelier cannot blow it up;
- token-mean aggregation over the *whole batch*: the sum over all masked tokens divided by the
  batch's token count (``num_tokens``), not a mean of per-sequence means, so long and short
  answers weigh the same per token. With gradient accumulation every micro-batch divides by the
  token count of the whole batch, which makes the accumulated gradient equal the full-batch one;
- or rollout-mean (``row_weights``): each rollout weighs the same whatever its number of
  segments or tokens. A token of a rollout with ``n`` loss tokens (over all its segments) in a
  batch of ``R`` rollouts weighs ``1 / (R n)``. With one segment per rollout this is verl's
  ``seq-mean-token-mean``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

LOG_RATIO_LIMIT = 20.0
"""``logp - old_logp`` is clamped to +-this before ``exp``: an overflowed ratio would turn the
whole batch into NaN; past it every clip is active anyway."""


@dataclass(frozen=True)
class ClipConfig:
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip_c: float | None = 3.0
    """None disables the dual clip; otherwise it must exceed 1."""
    tis_cap: float | None = 2.0
    """Cap of the truncated importance weight; None disables the correction."""

    def __post_init__(self) -> None:
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, "
                             f"{self.eps_high}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ValueError(f"dual_clip_c must be > 1, got {self.dual_clip_c}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")


@dataclass(frozen=True)
class LossStats:
    """Token fractions over the masked tokens of the call (detached floats)."""

    clip_low: float
    """A < 0 and r < 1 - eps_low: the clip stopped pushing the token further down."""
    clip_high: float
    """A > 0 and r > 1 + eps_high: the clip stopped pushing the token further up."""
    dual_clip: float
    """A < 0 and the loss capped at -A c."""
    tis_truncated: float
    """Importance weights cut at the cap."""
    approx_kl: float
    """Mean of old_logp - logp (k1 estimator of KL(old || new))."""
    tokens: int


def importance_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                       cap: float | None) -> torch.Tensor:
    """``min(exp(old - rollout), cap)`` per token, detached (a constant weight)."""
    log_w = (old_logp - rollout_logp).detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    weights = torch.exp(log_w)
    return weights if cap is None else weights.clamp(max=cap)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cfg: ClipConfig, *, rollout_logp: torch.Tensor | None = None,
                num_tokens: float | None = None, row_weights: torch.Tensor | None = None,
                is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, LossStats]:
    """The loss of one (micro-)batch; all tensors ``[B, T]`` (advantages may be ``[B, 1]``).

    ``num_tokens``: the normaliser, the masked-token count of the whole batch this micro-batch
    belongs to; defaults to this call's own count. ``row_weights`` (``[B, 1]``), when given,
    replaces it: each token's loss is multiplied by its row's weight and summed (rollout-mean
    passes ``1 / (rollouts x the rollout's loss tokens)``, see :func:`rollout_weights`).
    ``is_weights`` (``[B, T]``, constant): importance weights from
    :func:`rollout.trainer_adapters.dapo.correction.correct`, used instead of ``cfg.tis_cap``.
    """
    mask = mask.to(logp.dtype)
    advantages = advantages.to(logp.dtype).expand_as(logp)
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    per_token = torch.maximum(unclipped, clipped)
    negative = advantages < 0
    dual = torch.zeros_like(negative)
    if cfg.dual_clip_c is not None:
        cap = -advantages * cfg.dual_clip_c
        dual = negative & (per_token > cap)
        per_token = torch.where(negative, torch.minimum(per_token, cap), per_token)
    truncated = torch.zeros_like(negative)
    if is_weights is not None:
        per_token = per_token * is_weights.to(logp.dtype).detach()
    elif rollout_logp is not None and cfg.tis_cap is not None:
        weights = importance_weights(old_logp, rollout_logp, cfg.tis_cap)
        truncated = torch.exp((old_logp - rollout_logp).detach()) > cfg.tis_cap
        per_token = per_token * weights
    count = mask.sum()
    if row_weights is not None:
        loss = (per_token * mask * row_weights.to(logp.dtype)).sum()
    else:
        denominator = count if num_tokens is None else torch.as_tensor(num_tokens,
                                                                       dtype=logp.dtype)
        loss = (per_token * mask).sum() / denominator.clamp(min=1)

    def frac(flags: torch.Tensor) -> float:
        return float((flags.to(mask.dtype) * mask).sum() / count.clamp(min=1))

    stats = LossStats(
        clip_low=frac(negative & (ratio < 1 - cfg.eps_low)),
        clip_high=frac((advantages > 0) & (ratio > 1 + cfg.eps_high)),
        dual_clip=frac(dual), tis_truncated=frac(truncated),
        approx_kl=float(((old_logp - logp).detach() * mask).sum() / count.clamp(min=1)),
        tokens=int(count))
    return loss, stats


LOSS_AGG_MODES = ("token-mean", "rollout-mean")
"""How the per-token losses of a batch add up: every token the same (``token-mean``), or every
rollout the same (``rollout-mean``)."""


def rollout_weights(rollouts: list[str], loss_tokens: list[int], mode: str) -> list[float]:
    """Per training row, the weight of each of its loss tokens.

    ``rollouts`` names each row's rollout (rows of one rollout: its segments or chains share the
    name) and ``loss_tokens`` counts each row's loss tokens. ``token-mean``: ``1 / total tokens``
    for every row. ``rollout-mean``: ``1 / (R x n_r)`` with ``R`` rollouts and ``n_r`` the loss
    tokens of the row's rollout over all its rows, so each rollout's tokens sum to ``1 / R``.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss aggregation must be one of {LOSS_AGG_MODES}, got {mode!r}")
    if len(rollouts) != len(loss_tokens):
        raise ValueError("one rollout name per row")
    if mode == "token-mean":
        total = max(sum(loss_tokens), 1)
        return [1.0 / total] * len(rollouts)
    per_rollout: dict[str, int] = {}
    for name, n in zip(rollouts, loss_tokens, strict=True):
        per_rollout[name] = per_rollout.get(name, 0) + n
    counted = [name for name, n in per_rollout.items() if n > 0]
    return [1.0 / (len(counted) * per_rollout[name]) if per_rollout[name] else 0.0
            for name in rollouts]


def chunked_token_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor,
                           temperature: float = 1.0, chunk: int = 512
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs` from the model's last hidden states (``[B, T, H]``) and its output
    layer, ``chunk`` positions at a time, without ever holding the batch's full-vocabulary
    logits. A bias-free linear head (the usual tied or untied LM head) outside autocast goes
    through :class:`_LinearLogprobs`, whose backward pass recomputes each chunk's logits and
    turns them into their gradient in place: one ``chunk x vocabulary`` buffer at a time in
    either pass. Any other head runs each chunk inside a checkpointed function (the backward
    recomputes the chunk, keeping its softmax and temporaries alive meanwhile). Entropy is a
    metric (no gradient flows through it)."""
    chunk = max(chunk, 1)
    weight = getattr(head, "weight", None)
    if (type(head) is torch.nn.Linear and head.bias is None and weight is not None
            and not torch.is_autocast_enabled(hidden.device.type)):
        lp, ent = _LinearLogprobs.apply(hidden, weight, targets, temperature, chunk)
        return lp, ent
    from torch.utils.checkpoint import checkpoint

    def piece(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lp, ent = token_logprobs(head(h), t, temperature)
        return lp, ent.detach()

    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    logps, ents = [], []
    for start in range(0, flat_h.shape[0], chunk):
        h, t = flat_h[start:start + chunk], flat_t[start:start + chunk]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(piece, h, t, use_reentrant=False)
        else:
            lp, ent = piece(h, t)
        logps.append(lp)
        ents.append(ent)
    shape = targets.shape
    return torch.cat(logps).reshape(shape), torch.cat(ents).reshape(shape)


class _LinearLogprobs(torch.autograd.Function):
    """``log softmax(h W^T / temperature)[target]`` and the entropy, chunk by chunk.

    Forward keeps only ``h``, ``W``, the targets and each position's log-normaliser (one float
    per position). Backward recomputes a chunk's logits into one buffer and overwrites it with
    ``(onehot - softmax) * grad / temperature`` (the gradient of a log-probability with respect
    to its logits), from which the hidden states' and the head's gradients follow; the head's
    gradient is summed over the chunks into one ``vocabulary x hidden`` tensor."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                temperature: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        flat_h = hidden.reshape(-1, hidden.shape[-1])
        flat_t = targets.reshape(-1)
        n = flat_h.shape[0]
        logp = flat_h.new_empty(n, dtype=torch.float32)
        entropy = flat_h.new_empty(n, dtype=torch.float32)
        logz = flat_h.new_empty(n, dtype=torch.float32)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            logits = _scaled_logits(flat_h[start:end], weight, temperature)
            z = torch.logsumexp(logits, dim=-1)
            logz[start:end] = z
            logp[start:end] = logits.gather(-1, flat_t[start:end, None]).squeeze(-1) - z
            # entropy = logz - sum p * logits, with p made in the logits' own buffer
            weighted = logits.sub(z[:, None]).exp_().mul_(logits).sum(-1)
            entropy[start:end] = z - weighted
            del logits
        ctx.save_for_backward(hidden, weight, targets, logz)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logp.reshape(targets.shape), entropy.reshape(targets.shape)

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        hidden, weight, targets, logz = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        flat_h = hidden.reshape(-1, hidden.shape[-1])
        flat_t = targets.reshape(-1)
        g = grad_logp.reshape(-1).float()
        n = flat_h.shape[0]
        grad_h = torch.empty_like(flat_h) if ctx.needs_input_grad[0] else None
        grad_w = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                  if ctx.needs_input_grad[1] else None)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            buf = _scaled_logits(flat_h[start:end], weight, temperature)
            # d logp / d logits = (onehot - softmax) / temperature, scaled by the incoming grad
            buf.sub_(logz[start:end, None]).exp_().neg_()
            buf.scatter_add_(-1, flat_t[start:end, None],
                             torch.ones_like(flat_t[start:end, None], dtype=buf.dtype))
            buf.mul_((g[start:end] / temperature)[:, None])
            if grad_h is not None:
                grad_h[start:end] = (buf @ weight.float()).to(grad_h.dtype)
            if grad_w is not None:
                grad_w.addmm_(buf.t(), flat_h[start:end].float())
            del buf
        return (None if grad_h is None else grad_h.reshape(hidden.shape),
                None if grad_w is None else grad_w.to(weight.dtype), None, None, None)


def _scaled_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """One chunk's float32 logits divided by the temperature, in a fresh buffer."""
    logits = (h.float() @ weight.float().t())
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                   temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token and the entropy of each position's distribution.

    ``logits[:, t]`` predicts ``targets[:, t]`` (the caller shifts). Logits are divided by the
    sampling temperature first, so the trainer's probabilities are those of the distribution
    the rollout sampled from (top-k / top-p truncation aside).
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    probs = torch.softmax(logits, dim=-1)
    entropy = logz - (probs * logits).sum(-1)
    return picked - logz, entropy
