"""``Policy``'s memory switches (what ``rollout bench train-memory`` turns off for its baseline):
each really switches, and turning them all off leaves the update's maths as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout.benchmarks.train_memory import BASELINE, synthetic_items
from rollout.trainer_adapters.dapo import policy as policy_module
from rollout.trainer_adapters.dapo.loss import ClipConfig
from rollout.trainer_adapters.dapo.policy import Policy
from tests.fixtures.tiny_model import tiny_model_dir

pytestmark = pytest.mark.timeout(300)

LR = 1e-3


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir()


def _items(vocab: int) -> list:
    # 2 groups x 2 samples of three turns: 8 + 3 x 6 model tokens + 2 x 4 tool tokens.
    return synthetic_items(groups=2, samples=2, turns=3, prompt=8, turn_tokens=6, tool_tokens=4,
                           vocab=vocab)


def _update(policy: Policy) -> object:
    return policy.update(_items(policy.model.config.vocab_size), ClipConfig(), temperature=0.7,
                         micro_batch_size=2, grad_clip=1.0)


def test_the_savings_leave_the_parameters_after_an_update_as_the_baseline_has_them(
        model_dir: Path) -> None:
    """One step of the shipped configuration (chunked fused log-probs, chunk 5 so a micro-batch
    spans several chunks; fused AdamW) against the baseline (full logits, torch's default
    AdamW), from the same weights.

    Tolerance: Adam's first step moves each parameter by lr * g / (|g| + eps), about ``lr``, so
    a change in the maths (a wrong gradient element, a wrong temperature) shows as differences
    of order ``lr``. Float32 rounding differs between the two paths by up to ~1e-9 in a
    gradient element (the chunks sum in another order); for an element with |g| under
    eps = 1e-8 that moves the update by up to lr * 1e-9 / eps = lr / 10 in the worst case, and
    by about lr / 500 in this batch (measured). lr / 100 sits between the two. Adam's step
    ignores a uniform scale of the gradient, so the gradient norm (before clipping) and the
    loss are compared too."""
    base = Policy(model_dir, device="cpu", lr=LR, **BASELINE)
    shipped = Policy(model_dir, device="cpu", lr=LR, logit_chunk=5)
    assert shipped.logit_chunk and shipped._plain_head  # the fused log-prob path runs
    a, b = _update(base), _update(shipped)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)  # type: ignore[attr-defined]
    assert b.loss == pytest.approx(a.loss, rel=1e-5, abs=1e-7)  # type: ignore[attr-defined]
    moved = max(float((p - q).detach().abs().max()) for p, q in zip(
        base.model.parameters(), Policy(model_dir, device="cpu").model.parameters(),
        strict=True))
    assert moved > LR / 2  # the step did move the parameters (by about lr)
    diff = max(float((p - q).detach().abs().max()) for p, q in zip(
        base.model.parameters(), shipped.model.parameters(), strict=True))
    assert diff < LR * 1e-2, diff


def test_fused_adamw_is_the_default_and_can_be_turned_off(model_dir: Path) -> None:
    assert Policy(model_dir, device="cpu").optimizer.defaults["fused"] is True
    assert not Policy(model_dir, device="cpu", fused_adamw=False).optimizer.defaults["fused"]


def test_set_to_none_frees_the_gradients_and_false_keeps_zeroed_ones(model_dir: Path) -> None:
    freed = Policy(model_dir, device="cpu", lr=LR)
    _update(freed)
    assert all(p.grad is None for p in freed.model.parameters())
    kept = Policy(model_dir, device="cpu", lr=LR, set_to_none=False)
    _update(kept)
    grads = [p.grad for p in kept.model.parameters()]
    assert all(g is not None and not torch.count_nonzero(g) for g in grads)


def test_the_mmap_threshold_is_set_unless_turned_off(model_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[None] = []
    monkeypatch.setattr(policy_module, "map_large_allocations", lambda: calls.append(None))
    Policy(model_dir, device="cpu", mmap_threshold=False)
    assert calls == []
    Policy(model_dir, device="cpu")
    assert calls == [None]
