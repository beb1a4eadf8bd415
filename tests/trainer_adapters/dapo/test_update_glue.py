"""The glue between a batch and the DAPO loss, against computations done here by hand:
overlong shaping and group advantages per sample, the logprobs check, and one ``Policy.update``
(tensors built from the samples, micro- and mini-batches, the normaliser, the old logprobs)
against a reference gradient step written from the definitions with plain torch.

The reference never calls the trainer's tensor code: it runs the model on each sample alone
(no padding, no batching), picks the logprob of every next token, and applies the per-token
loss ``-A * r`` (clipping disabled by range) summed over the loss-masked tokens and divided by
the mini-batch's masked-token count."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

from rollout.client.batcher import Batch, BatchStats, Group, Sample
from rollout.client.trajectory import Flat
from rollout.trainer_adapters.dapo.loss import ClipConfig, rollout_weights
from rollout.trainer_adapters.dapo.policy import Policy, TrainItem
from rollout.trainer_adapters.dapo.run_config import load_config
from rollout.trainer_adapters.dapo.trainer import check_logprobs, shape_and_normalise
from tests.fixtures.tiny_model import tiny_model_dir
from tests.trainer_adapters.dapo.large_tensors import LargeTensors

pytestmark = pytest.mark.timeout(300)

NO_CLIP = ClipConfig(eps_low=0.999, eps_high=1e6, dual_clip_c=None, tis_cap=None)
"""Every ratio stays inside the clip range, so the per-token loss is exactly -A * r."""
TEMPERATURE = 0.7


def sample(job: str, tokens: list[int], mask: list[int], reward: float = 0.0,
           kind: str = "PROCESSED", prompt_length: int = 2) -> Sample:
    flat = Flat(job_id=job, group_id="g", token_ids=tokens, loss_mask=mask,
                logprobs=[-1.0 if m else 0.0 for m in mask], prompt_length=prompt_length,
                reward=reward, logprobs_kind=kind)
    return Sample(job_id=job, delivery_id=0, flat=flat, turn_versions=(0,),
                  finish_reasons=("stop",))


def generated(job: str, n: int, reward: float, observed: int = 0) -> Sample:
    """A sample with ``n`` model tokens over two turns (prompt 2, model, ``observed`` tokens
    of tool output, model)."""
    mask = [0, 0] + [1] * (n // 2) + [0] * observed + [1] * (n - n // 2)
    return sample(job, list(range(10, 10 + len(mask))), mask, reward)


def batch_of(*groups: list[Sample]) -> Batch:
    return Batch(groups=tuple(Group(f"g{i}", {}, tuple(g)) for i, g in enumerate(groups)),
                 stats=BatchStats(), policy_version=0)


def test_advantages_go_to_their_own_samples_in_group_order() -> None:
    # Group 0 rewards [1, 0, 0, 1]: mean 0.5, sample std (n-1) sqrt(1/3) = 0.57735;
    # advantages +-0.866025. Group 1 rewards [0, 1]: mean 0.5, std sqrt(0.5) = 0.707107;
    # advantages -0.707107, +0.707107. No shaping (overlong_cache 0).
    cfg = load_config(None, {"algo.overlong_cache": 0})
    g0 = [generated(f"a{i}", 3, r) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])]
    g1 = [generated(f"b{i}", 3, r) for i, r in enumerate([0.0, 1.0])]
    items, mean = shape_and_normalise(batch_of(g0, g1), cfg)
    got = {i.sample.job_id: i.advantage for i in items}
    a = 0.5 / math.sqrt(1 / 3)
    b = 0.5 / math.sqrt(0.5)
    expected = {"a0": a, "a1": -a, "a2": -a, "a3": a, "b0": -b, "b1": b}
    assert got == pytest.approx(expected, abs=1e-5)
    assert mean == pytest.approx(3 / 6)


def test_overlong_shaping_measures_the_episode_against_its_budget() -> None:
    # max_tokens 24 per turn, 3 turns: budget 72, ramp over the last 8 (64..72).
    # 40 tokens over three turns (never cut): no penalty, although 40 > 24.
    # 68 tokens: (64 - 68) / 8 = -0.5. 72 or more: -1. Tool output (10 tokens in each
    # sample) is no generation and counts for nothing.
    cfg = load_config(None, {"rollout.max_tokens": 24, "rollout.max_turns": 3,
                             "algo.overlong_cache": 8})
    group = [generated("x0", 40, 1.0, 10), generated("x1", 68, 1.0, 10),
             generated("x2", 72, 1.0, 10), generated("x3", 40, 0.0, 10)]
    items, mean = shape_and_normalise(batch_of(group), cfg)
    shaped = [1.0, 0.5, 0.0, 0.0]
    assert mean == pytest.approx(sum(shaped) / 4)
    # Advantages of the shaped rewards, by hand: mean 0.375; deviations .625 .125 -.375 -.375;
    # sample variance (0.390625 + 0.015625 + 0.140625 * 2) / 3 = 0.229167, std 0.478714.
    std = math.sqrt((0.625 ** 2 + 0.125 ** 2 + 2 * 0.375 ** 2) / 3)
    assert [i.advantage for i in items] == pytest.approx(
        [0.625 / std, 0.125 / std, -0.375 / std, -0.375 / std], abs=1e-5)


def test_raw_or_unknown_logprobs_are_refused_before_training() -> None:
    check_logprobs(batch_of([generated("ok", 3, 1.0)]))
    for kind in ("RAW", ""):
        bad = sample("bad", [1, 2, 3], [0, 0, 1], kind=kind)
        with pytest.raises(ValueError, match=r"job bad: its logprobs .*PROCESSED"):
            check_logprobs(batch_of([generated("ok", 3, 1.0), bad]))


# ------------------------------------------------------------------ Policy.update vs by hand

SAMPLES = [
    # tokens, loss mask (a multi-turn one: model, observation, model), advantage
    ([5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 0, 1], 1.0),
    ([11, 12, 13, 14], [0, 0, 1, 1], -0.5),
    ([15, 16, 17, 18, 19, 20, 21], [0, 0, 0, 1, 1, 1, 1], 0.8),
    ([22, 23, 24, 25, 26], [0, 1, 0, 0, 1], -1.2),
]


def reference_token_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[t] | tokens[:t]) for t = 1.., one sample alone, logits / temperature."""
    logits = model(input_ids=torch.tensor([tokens])).logits[0].float() / TEMPERATURE
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return logp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]


def reference_loss(model: torch.nn.Module, rows: list[tuple[list[int], list[int], float]],
                   old: list[torch.Tensor] | None) -> torch.Tensor:
    n_tokens = sum(sum(mask[1:]) for _, mask, _ in rows)
    total = torch.zeros(())
    for k, (tokens, mask, adv) in enumerate(rows):
        logp = reference_token_logprobs(model, tokens)
        old_k = logp.detach() if old is None else old[k]
        ratio = torch.exp(logp - old_k)
        m = torch.tensor(mask[1:], dtype=torch.float32)  # token t+1 is predicted at t
        total = total + (-adv * ratio * m).sum()
    return total / n_tokens


def sgd_policy(lr: float, logit_chunk: int = 1024) -> Policy:
    policy = Policy(tiny_model_dir(), device="cpu", lr=lr, seed=0, logit_chunk=logit_chunk)
    # Plain SGD: the parameter change is exactly -lr * gradient, so the test reads the
    # gradient the update computed (AdamW's first step is about lr * sign(g) and would hide
    # a wrong scale).
    policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=lr)
    return policy


def items_of(rows: list[tuple[list[int], list[int], float]]) -> list[TrainItem]:
    return [TrainItem(sample(f"s{k}", tokens, mask), adv)
            for k, (tokens, mask, adv) in enumerate(rows)]


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_same_params(got: list[torch.Tensor], want: list[torch.Tensor], scale: float) -> None:
    worst = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    assert worst < 1e-3 * scale, f"parameters differ from the reference step by {worst}"


@pytest.mark.parametrize(("micro_batch_size", "logit_chunk", "checkpointing"),
                         [(1, 1024, False), (3, 1024, False), (3, 0, False), (3, 4, False),
                          (3, 4, True)])
def test_one_update_is_the_hand_computed_gradient_step(micro_batch_size: int, logit_chunk: int,
                                                       checkpointing: bool) -> None:
    """One mini-batch, split into micro-batches: the token mean over the whole batch (9 masked
    next-tokens: 2 + 2 + 4 + 1), each token's own advantage, the mask on the right tokens;
    with the logits whole (0), or 4 positions at a time (recomputed in the backward pass), and
    with the layers' activations recomputed (gradient checkpointing, active in train mode)."""
    lr = 1.0
    policy = Policy(tiny_model_dir(), device="cpu", lr=lr, seed=0, logit_chunk=logit_chunk,
                    gradient_checkpointing=checkpointing)
    policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=lr)
    ref = copy.deepcopy(policy.model).float().eval()
    before = params(policy.model)
    if not checkpointing:  # the tiny model has no dropout: train and eval forwards agree
        policy.model.eval()
    policy.update(items_of(SAMPLES), NO_CLIP, temperature=TEMPERATURE,
                  micro_batch_size=micro_batch_size, grad_clip=1e9)
    loss = reference_loss(ref, SAMPLES, None)
    grads = torch.autograd.grad(loss, list(ref.parameters()), allow_unused=True)
    want = [b - lr * (g if g is not None else torch.zeros_like(b))
            for b, g in zip(before, grads, strict=True)]
    moved = max(float((a - b).abs().max()) for a, b in zip(params(policy.model), before,
                                                            strict=True))
    assert moved > 1e-4  # the step did something measurable
    assert_same_params(params(policy.model), want, moved)


def test_two_mini_batches_use_the_old_weights_logprobs_in_the_second() -> None:
    """Mini-batch 1 (samples 0, 1) steps from the old weights; mini-batch 2 (samples 2, 3)
    is computed at the new weights, with ratios against the OLD weights' logprobs."""
    lr = 20.0  # large enough that the second mini-batch's ratios differ visibly from 1
    policy = sgd_policy(lr)
    ref = copy.deepcopy(policy.model).float().eval()
    policy.model.eval()
    before = params(policy.model)
    with torch.no_grad():
        old = [reference_token_logprobs(ref, tokens) for tokens, _, _ in SAMPLES]
    policy.update(items_of(SAMPLES), NO_CLIP, temperature=TEMPERATURE, micro_batch_size=1,
                  grad_clip=1e9, mini_batches=2)
    # The reference: two SGD steps by hand.
    first = reference_loss(ref, SAMPLES[:2], None)
    g1 = torch.autograd.grad(first, list(ref.parameters()), allow_unused=True)
    with torch.no_grad():
        for p, g in zip(ref.parameters(), g1, strict=True):
            if g is not None:
                p -= lr * g
    second = reference_loss(ref, SAMPLES[2:], old[2:])
    with torch.no_grad():
        new = [reference_token_logprobs(ref, tokens) for tokens, _, _ in SAMPLES[2:]]
        # The test is only meaningful if the ratios moved away from 1.
        assert max(float((n - o).abs().max()) for n, o in zip(new, old[2:], strict=True)) > 0.05
    g2 = torch.autograd.grad(second, list(ref.parameters()), allow_unused=True)
    with torch.no_grad():
        for p, g in zip(ref.parameters(), g2, strict=True):
            if g is not None:
                p -= lr * g
    moved = max(float((a - b).abs().max()) for a, b in zip(params(policy.model), before,
                                                            strict=True))
    assert_same_params(params(policy.model), params(ref), moved)


def segmented(job: str, rows: list[tuple[list[int], list[int]]], reward: float) -> Sample:
    """One rollout of several segments (a harness that rewrote its history)."""
    flats = tuple(replace(sample(job, tokens, mask, reward).flat, segment=n,
                          num_segments=len(rows)) for n, (tokens, mask) in enumerate(rows))
    return replace(sample(job, *rows[-1], reward=reward), flat=flats[-1], segments=flats)


def test_a_rollout_votes_once_whatever_its_number_of_segments() -> None:
    # Group rewards per rollout [1, 0, 0, 0]; rollout a0 has three segments, a1 two. Counting
    # rows would make the mean (3 * 1 + 0 * 4) / 7; per rollout it is 0.25 with sample std
    # 0.5: advantages +1.5, -0.5, -0.5, -0.5, every segment carrying its rollout's.
    cfg = load_config(None, {"algo.overlong_cache": 0})
    seg = ([1, 2, 3], [0, 1, 1])
    group = [segmented("a0", [seg, seg, seg], 1.0), segmented("a1", [seg, seg], 0.0),
             generated("a2", 2, 0.0), generated("a3", 2, 0.0)]
    items, mean = shape_and_normalise(batch_of(group), cfg)
    assert [(i.sample.job_id, i.sample.flat.segment) for i in items] == [
        ("a0", 0), ("a0", 1), ("a0", 2), ("a1", 0), ("a1", 1), ("a2", 0), ("a3", 0)]
    assert [i.advantage for i in items] == pytest.approx(
        [1.5, 1.5, 1.5, -0.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert mean == pytest.approx(0.25)


def test_rollout_weights_give_each_rollout_the_same_total() -> None:
    # Rollout r0: rows of 3 and 1 loss tokens (4 in all); r1: 2; r2: 6. R = 3.
    w = rollout_weights(["r0", "r0", "r1", "r2"], [3, 1, 2, 6], "rollout-mean")
    assert w == pytest.approx([1 / 12, 1 / 12, 1 / 6, 1 / 18])
    totals = [3 * w[0] + 1 * w[1], 2 * w[2], 6 * w[3]]
    assert totals == pytest.approx([1 / 3] * 3)
    assert rollout_weights(["r0", "r0", "r1"], [3, 1, 2], "token-mean") == \
        pytest.approx([1 / 6] * 3)
    # A rollout with no loss token counts for nothing (not in R).
    assert rollout_weights(["r0", "r1"], [4, 0], "rollout-mean") == pytest.approx([1 / 4, 0.0])
    with pytest.raises(ValueError, match="loss aggregation"):
        rollout_weights(["r0"], [1], "seq-mean")


def test_rollout_mean_update_is_the_hand_computed_step() -> None:
    """SAMPLES 0 and 1 are two segments of one rollout; 2 and 3 are rollouts of their own.
    By hand: loss = 1/3 * sum over rollouts of (sum of -A r over its tokens) / its tokens."""
    lr = 1.0
    policy = sgd_policy(lr)
    ref = copy.deepcopy(policy.model).float().eval()
    before = params(policy.model)
    policy.model.eval()
    names = ["r0", "r0", "r1", "r2"]
    items = [TrainItem(replace(i.sample, job_id=name,
                               flat=replace(i.sample.flat, job_id=name, segment=k)), i.advantage)
             for k, (i, name) in enumerate(zip(items_of(SAMPLES), names, strict=True))]
    policy.update(items, NO_CLIP, temperature=TEMPERATURE, micro_batch_size=2, grad_clip=1e9,
                  loss_agg="rollout-mean")
    # reference_loss divides by its rows' token count: the token mean within one rollout.
    loss = sum((reference_loss(ref, rows, None) for rows in (SAMPLES[:2], SAMPLES[2:3],
                                                               SAMPLES[3:])), torch.zeros(())) / 3
    grads = torch.autograd.grad(loss, list(ref.parameters()), allow_unused=True)
    want = [b - lr * (g if g is not None else torch.zeros_like(b))
            for b, g in zip(before, grads, strict=True)]
    moved = max(float((a - b).abs().max()) for a, b in zip(params(policy.model), before,
                                                            strict=True))
    assert moved > 1e-4
    assert_same_params(params(policy.model), want, moved)


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)



def test_the_optimizer_step_makes_no_whole_model_temporaries() -> None:
    """AdamW's step updates each parameter and its moments in place: no op inside it creates
    tensors adding up to more than the largest parameter (torch's default foreach form makes a
    square root of every second moment at once), and it moves the weights as AdamW does."""
    policy = Policy(tiny_model_dir(), device="cpu", lr=1e-2, seed=0)
    reference = copy.deepcopy(policy.model)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0, foreach=True)
    for model in (policy.model, reference):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
    policy.optimizer.step()  # the first step creates the moments
    plain.step()
    for model in (policy.model, reference):
        for p in model.parameters():
            p.grad = torch.full_like(p, -0.25)
    largest = max(p.numel() * p.element_size() for p in policy.model.parameters())
    watch = LargeTensors(floor=1)
    with watch:
        policy.optimizer.step()
    plain.step()
    assert watch.peak <= largest, f"the step held {watch.peak} bytes of temporaries at once"
    for got, want in zip(policy.model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(got, want, atol=1e-6)


def test_gradients_are_freed_after_each_update() -> None:
    """Between two updates (while the next rollouts run) no parameter holds a gradient."""
    policy = sgd_policy(1e-3)
    policy.update(items_of(SAMPLES), NO_CLIP, temperature=TEMPERATURE, micro_batch_size=2,
                  grad_clip=1e9)
    assert all(p.grad is None for p in policy.model.parameters())
