"""The policy model on the trainer side: tensors from a batch, one DAPO update, checkpoints.

Everything here is synchronous torch; the trainer loop runs it in a worker thread so the gRPC
session (heartbeats, acknowledgements, the batcher's reader) keeps running meanwhile.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rollout.client.batcher import Sample
from rollout.trainer_adapters.dapo.correction import CorrectionConfig, correct
from rollout.trainer_adapters.dapo.loss import (
    ClipConfig,
    chunked_token_logprobs,
    policy_loss,
    rollout_weights,
    token_logprobs,
)
from rollout.trainer_adapters.dapo.metrics import map_large_allocations


@dataclass(frozen=True)
class TrainItem:
    """One sample with its advantage, ready for the model."""

    sample: Sample
    advantage: float

    @property
    def key(self) -> tuple[str, int]:
        """The training row: one segment of one rollout."""
        return (self.sample.job_id, self.sample.flat.segment)


@dataclass(frozen=True)
class UpdateStats:
    loss: float
    entropy: float
    clip_low: float
    clip_high: float
    dual_clip: float
    tis_truncated: float
    approx_kl: float
    grad_norm: float
    tokens: int
    """Tokens the forward passes processed (prompts included)."""
    loss_tokens: int
    seconds: float
    mismatch_kl_token: float = 0.0
    """Mean over loss tokens of log pi_rollout - log pi_train (k1 estimate of the KL)."""
    mismatch_kl_seq: float = 0.0
    """The same summed per sequence, averaged over sequences."""
    mismatch_masked: float = 0.0
    """Fraction of loss tokens the correction removed (rejection) or weighted 0 (masked IS)."""
    mismatch_weight_mean: float = 0.0
    """Mean importance weight over the loss tokens (0 for removed ones)."""


class Policy:
    """A causal LM under training, with AdamW, linear warm-up and gradient clipping.

    The memory savings each have a switch so that ``rollout bench train-memory`` can measure
    the configuration without them (and each one's share) in the same run; the defaults are
    what training uses, and none of them changes the maths:

    - ``logit_chunk``: positions of full-vocabulary logits held at once (0: the whole
      micro-batch's logits, the plain path);
    - ``fused_adamw``: False keeps torch's default AdamW kernel;
    - ``set_to_none``: False zeroes the gradients in place between updates instead of freeing
      them (torch's ``zero_grad(set_to_none=False)``), so a model's worth of them stays
      allocated through the rollouts;
    - ``mmap_threshold``: False leaves glibc's allocator as it is (no
      :func:`map_large_allocations`), so freed large tensors can stay in its heap.
    """

    def __init__(self, model_dir: str | Path, *, device: str = "", lr: float = 1e-5,
                 warmup_steps: int = 0, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), seed: int = 0,
                 logit_chunk: int = 1024, gradient_checkpointing: bool = False,
                 fused_adamw: bool = True, set_to_none: bool = True,
                 mmap_threshold: bool = True) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if mmap_threshold:
            map_large_allocations()  # freed activations go back to the system, not the heap
        self.mmap_threshold = mmap_threshold
        self.set_to_none = set_to_none
        torch.manual_seed(seed)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        # fp32 master weights everywhere; on CUDA the forward runs under bf16 autocast.
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                          dtype=torch.float32)
        self.model.to(self.device)  # type: ignore[arg-type]  # transformers types .to oddly
        self.model.train()
        self.logit_chunk = logit_chunk
        # Chunking needs logits = output_layer(last hidden state); a model that post-processes
        # them (soft-capping, a logit scale) keeps the plain path.
        cfg = self.model.config
        self._plain_head = not any(getattr(cfg, name, None) for name in (
            "final_logit_softcapping", "logit_scale", "logits_scaling"))
        if gradient_checkpointing:
            # The backward pass then keeps one layer's activations at a time, recomputing the
            # rest, instead of every layer's for the whole micro-batch.
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            if enable is not None:  # transformers >= 5.x's name
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
        # Fused: one kernel per parameter updates it and its two moments in place. The default
        # (foreach) form makes whole-model temporaries (sqrt of the second moments, ...) that
        # add a model's size to the step and stay in the C heap afterwards.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=betas,
                                           weight_decay=weight_decay,
                                           **_adamw_kernel(self.model, self.device,
                                                           fused_adamw))
        self.base_lr = lr
        self.warmup_steps = warmup_steps
        self.updates = 0

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.device.type == "cuda":
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def lr(self) -> float:
        if self.warmup_steps and self.updates < self.warmup_steps:
            return self.base_lr * (self.updates + 1) / self.warmup_steps
        return self.base_lr

    def _tensors(self, items: Sequence[TrainItem],
                 weights: dict[tuple[str, int], float] | None = None) -> dict[str, torch.Tensor]:
        """Right-padded, shifted by one: position t of ``targets`` is predicted from
        ``input_ids[:t+1]``, and masks/logprobs are aligned with the targets. ``weights``: each
        row's per-token loss weight (see :func:`rollout_weights`)."""
        weights = weights or {}
        width = max(len(i.sample.flat.token_ids) for i in items) - 1
        pad = self.tokenizer.pad_token_id or 0

        def row(values: Sequence[Any], fill: Any) -> list[Any]:
            return list(values) + [fill] * (width - len(values))

        ids = [i.sample.flat.token_ids for i in items]
        out = {
            "input_ids": torch.tensor([row(x[:-1], pad) for x in ids]),
            "attention": torch.tensor([row([1] * (len(x) - 1), 0) for x in ids]),
            "targets": torch.tensor([row(x[1:], pad) for x in ids]),
            "mask": torch.tensor([row(i.sample.flat.loss_mask[1:], 0) for i in items],
                                 dtype=torch.float32),
            "rollout_logp": torch.tensor([row(i.sample.flat.logprobs[1:], 0.0) for i in items],
                                         dtype=torch.float32),
            "advantages": torch.tensor([[i.advantage] for i in items], dtype=torch.float32),
            "row_weights": torch.tensor([[weights.get(i.key, 0.0)] for i in items],
                                        dtype=torch.float32),
        }
        return {k: v.to(self.device) for k, v in out.items()}

    def _logprobs(self, t: dict[str, torch.Tensor], temperature: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token logprobs and entropy. With ``logit_chunk`` > 0 (and a model whose logits
        are its output layer applied to the last hidden states) the full-vocabulary logits of
        the micro-batch are never materialised: see :func:`chunked_token_logprobs`."""
        with self._autocast():
            if self.logit_chunk and self._plain_head:
                base = getattr(self.model, self.model.base_model_prefix)
                hidden = base(input_ids=t["input_ids"],
                              attention_mask=t["attention"]).last_hidden_state
                return chunked_token_logprobs(hidden, self.model.get_output_embeddings(),
                                              t["targets"], temperature, self.logit_chunk)
            logits = self.model(input_ids=t["input_ids"], attention_mask=t["attention"]).logits
        return token_logprobs(logits, t["targets"], temperature)

    def _micro_batches(self, items: Sequence[TrainItem], size: int
                       ) -> Iterator[Sequence[TrainItem]]:
        # Similar lengths together: less padding per forward.
        ordered = sorted(items, key=lambda i: len(i.sample.flat.token_ids))
        for start in range(0, len(ordered), size):
            yield ordered[start:start + size]

    def update(self, items: Sequence[TrainItem], clip: ClipConfig, *, temperature: float,
               micro_batch_size: int, grad_clip: float, mini_batches: int = 1,
               loss_agg: str = "token-mean",
               correction: CorrectionConfig | None = None) -> UpdateStats:
        """One DAPO step over ``items`` (``mini_batches`` optimizer steps; gradients of each
        mini-batch accumulated over micro-batches of ``micro_batch_size`` samples). ``loss_agg``
        weighs every loss token the same (``token-mean``) or every rollout the same
        (``rollout-mean``), within each mini-batch. ``correction``: the rollout-vs-trainer
        mismatch correction (importance weights, rejection, bypass; see
        :mod:`rollout.trainer_adapters.dapo.correction`); None keeps ``clip.tis_cap``'s
        token-level truncated weights."""
        started = time.monotonic()
        items = [i for i in items if any(i.sample.flat.loss_mask)]
        if not items:
            raise ValueError("nothing to train on: no sample has a model token")
        old: dict[tuple[str, int], torch.Tensor] = {}
        if mini_batches > 1:
            # Off-policy within the step: the reference ("old") logprobs must be those of the
            # weights before the first optimizer step, so compute them all up front.
            with torch.no_grad():
                for mb in self._micro_batches(items, micro_batch_size):
                    lp, _ = self._logprobs(self._tensors(mb), temperature)
                    for k, item in enumerate(mb):
                        old[item.key] = lp[k].detach()
        per_mini = max(1, -(-len(items) // mini_batches))
        totals = dict(loss=0.0, entropy=0.0, clip_low=0.0, clip_high=0.0, dual_clip=0.0,
                      tis_truncated=0.0, approx_kl=0.0)
        mm = dict(kl=0.0, sequences=0, tokens=0, masked=0, weight=0.0, truncated=0)
        processed = loss_tokens = 0
        grad_norms = []
        for m in range(0, len(items), per_mini):
            mini = items[m:m + per_mini]
            weights = dict(zip((i.key for i in mini), rollout_weights(
                [i.sample.job_id for i in mini],
                [sum(i.sample.flat.loss_mask[1:]) for i in mini], loss_agg), strict=True))
            for group in self._param_groups():
                group["lr"] = self.lr
            self.optimizer.zero_grad(set_to_none=self.set_to_none)
            for mb in self._micro_batches(mini, micro_batch_size):
                t = self._tensors(mb, weights)
                logp, entropy = self._logprobs(t, temperature)
                if correction is not None and correction.bypass:
                    # The rollout's logprobs are the old policy: the ratio is pi_theta /
                    # pi_rollout (prompt positions keep the trainer's; they are masked).
                    old_lp = torch.where(t["mask"] > 0, t["rollout_logp"], logp.detach())
                elif old:
                    old_lp = torch.stack([_fit(old[i.key], logp.shape[1])
                                          for i in mb])
                else:
                    old_lp = logp.detach()  # one optimizer step per batch: on-policy
                if correction is not None:
                    # Bypass measures (and rejects on) the current policy against the
                    # rollout's, as verl's bypass mode does; its weights are all 1.
                    trainer_lp = logp.detach() if correction.bypass else old_lp.detach()
                    corr = correct(trainer_lp, t["rollout_logp"], t["mask"], correction)
                    loss, st = policy_loss(logp, old_lp, t["advantages"], corr.mask,
                                           replace(clip, tis_cap=None),
                                           row_weights=t["row_weights"],
                                           is_weights=corr.weights)
                    mm["kl"] += corr.kl_sum
                    mm["sequences"] += corr.sequences
                    mm["tokens"] += corr.tokens
                    mm["masked"] += corr.masked_tokens
                    mm["weight"] += corr.weight_sum
                    mm["truncated"] += corr.truncated_tokens
                else:
                    loss, st = policy_loss(logp, old_lp, t["advantages"], t["mask"], clip,
                                           rollout_logp=t["rollout_logp"],
                                           row_weights=t["row_weights"])
                loss.backward()
                w = st.tokens
                totals["loss"] += float(loss.detach())  # micro-batch parts sum to the mini's
                totals["entropy"] += float((entropy.detach() * t["mask"]).sum())
                for key in ("clip_low", "clip_high", "dual_clip", "tis_truncated", "approx_kl"):
                    totals[key] += getattr(st, key) * w
                loss_tokens += w
                processed += int(t["attention"].sum())
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
            grad_norms.append(float(norm))
            self.optimizer.step()
            # The gradients are dead weight until the next backward pass: free them now so the
            # rollouts between two updates do not carry a model's worth of them.
            self.optimizer.zero_grad(set_to_none=self.set_to_none)
            self.updates += 1
        denom = max(loss_tokens, 1)
        if correction is not None:
            totals["tis_truncated"] = float(mm["truncated"])
            denom_mm = max(int(mm["tokens"]), 1)
            extra = dict(mismatch_kl_token=mm["kl"] / denom_mm,
                         mismatch_kl_seq=mm["kl"] / max(int(mm["sequences"]), 1),
                         mismatch_masked=mm["masked"] / denom_mm,
                         mismatch_weight_mean=mm["weight"] / denom_mm)
        else:
            extra = {}
        return UpdateStats(
            loss=totals["loss"] / max(len(grad_norms), 1), entropy=totals["entropy"] / denom,
            clip_low=totals["clip_low"] / denom, clip_high=totals["clip_high"] / denom,
            dual_clip=totals["dual_clip"] / denom, tis_truncated=totals["tis_truncated"] / denom,
            approx_kl=totals["approx_kl"] / denom, grad_norm=max(grad_norms),
            tokens=processed, loss_tokens=loss_tokens, seconds=time.monotonic() - started,
            **extra)

    def _param_groups(self) -> list[dict[str, Any]]:
        return list(self.optimizer.param_groups)

    def save_weights(self, directory: Path) -> Path:
        """A safetensors checkpoint the serving engines load (ties handled by transformers)."""
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(directory), safe_serialization=True)
        return directory

    def save_checkpoint(self, directory: Path) -> Path:
        """Weights, tokenizer and optimizer state: enough to serve or to resume."""
        self.save_weights(directory)
        self.tokenizer.save_pretrained(str(directory))
        torch.save({"optimizer": self.optimizer.state_dict(), "updates": self.updates},
                   directory / "trainer_state.pt")
        return directory


def _fit(row: torch.Tensor, width: int) -> torch.Tensor:
    if row.shape[0] >= width:
        return row[:width]
    return torch.cat([row, row.new_zeros(width - row.shape[0])])


def _adamw_kernel(model: torch.nn.Module, device: torch.device,
                  fused: bool = True) -> dict[str, bool]:
    """``fused=True`` where torch has the fused AdamW for these parameters (float32 or
    half-precision on CPU or CUDA), else the per-parameter loop (``foreach=False``): neither
    allocates temporaries over the whole model at once. ``fused`` False: no choice, torch's
    default kernel (the baseline ``rollout bench train-memory`` compares against)."""
    if not fused:
        return {}
    float_params = all(p.dtype in (torch.float32, torch.float16, torch.bfloat16)
                       for p in model.parameters())
    if float_params and device.type in ("cpu", "cuda"):
        return {"fused": True}
    return {"foreach": False}
