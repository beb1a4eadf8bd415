"""The DAPO training loop against a running Rollout Service.

Each step: the batcher hands over ``groups_per_batch`` groups with differing rewards (dynamic
sampling, staleness bound, redundant groups cancelled); rewards get the soft overlong shaping and
are normalised within their group; one DAPO update runs (in a worker thread, so the session's
heartbeats and acknowledgements go on); the new weights are written and pushed to the backends
through ``BackendService`` with the next policy version, and the batcher learns that version.
Held-out accuracy is measured through the service at step 0, every ``eval_every`` steps and at
the end. Metrics go to the console, ``metrics.csv``, TensorBoard (when installed) and
``curves.png``; the last step writes a full checkpoint and ``summary.json``.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from rollout.client.aio import RolloutClient
from rollout.client.batcher import Batch, BatcherConfig, GroupBatcher
from rollout.trainer_adapters.dapo import task_set as shipped
from rollout.trainer_adapters.dapo.advantages import group_advantages, overlong_penalty
from rollout.trainer_adapters.dapo.evaluate import EvalResult, evaluate
from rollout.trainer_adapters.dapo.loss import ClipConfig
from rollout.trainer_adapters.dapo.metrics import (
    MetricsLog,
    paired_bootstrap,
    peak_rss_gib,
    release_free_memory,
    reset_peak_rss,
    rss_gib,
)
from rollout.trainer_adapters.dapo.policy import Policy, TrainItem
from rollout.trainer_adapters.dapo.run_config import DapoConfig
from rollout.trainer_adapters.dapo.weights import SharedWeights, WeightPusher

StepHook = Callable[[int, int], Awaitable[None]]
"""``await hook(step, policy_version)`` after each step's weights were pushed (tests)."""


@dataclass(frozen=True)
class RunSummary:
    steps: int
    policy_version: int
    heldout_before: float
    heldout_after: float
    heldout_delta: float
    heldout_ci95: tuple[float, float]
    heldout_tasks: int
    by_family_before: dict[str, float]
    by_family_after: dict[str, float]
    elapsed_s: float
    run_dir: str


def read_jobs(path: Path) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: not a JSON job line: {exc}") from None
    if not rows:
        raise ValueError(f"{path}: no job lines")
    return rows


def endless(rows: Sequence[Mapping[str, Any]], *, shuffle: bool, seed: int
            ) -> Iterator[Mapping[str, Any]]:
    """The training set, epoch after epoch (reshuffled each epoch when ``shuffle``)."""
    rng = random.Random(seed)
    order = list(rows)
    while True:
        if shuffle:
            rng.shuffle(order)
        yield from order


def episode_budget(cfg: DapoConfig) -> int:
    """The most model tokens one episode can generate: ``max_turns`` turns of ``max_tokens``
    each. The overlong shaping measures an episode against this, not against one turn's
    ``max_tokens``: three turns of 20 tokens under a 24-token turn limit were never cut."""
    return cfg.rollout.max_tokens * cfg.rollout.max_turns


def check_logprobs(batch: Batch) -> None:
    """Refuse samples whose logprobs are not the sampling distribution's: the loss uses them as
    the behaviour policy (importance weights), and raw logprobs at T < 1 are off by orders of
    magnitude per sequence, which corrupts the update silently."""
    for sample in batch.samples:
        kind = sample.flat.logprobs_kind
        if kind != "PROCESSED":
            raise ValueError(
                f"job {sample.job_id}: its logprobs are {kind or 'of unknown or mixed kinds'}, "
                "not PROCESSED (the distribution sampled from); the DAPO loss needs the "
                "behaviour policy's logprobs. Serve with backends that record PROCESSED "
                "logprobs (the default) and do not set sampling.logprobs_mode to RAW.")


def shape_and_normalise(batch: Batch, cfg: DapoConfig) -> tuple[list[TrainItem], float]:
    """Overlong shaping (on each episode's generated tokens against :func:`episode_budget`),
    then group advantages. Returns the items and the mean shaped reward."""
    items: list[TrainItem] = []
    shaped_all: list[float] = []
    budget = episode_budget(cfg)
    for group in batch.groups:
        shaped = [s.reward + (overlong_penalty(s.generated_tokens, budget,
                                               cfg.algo.overlong_cache)
                              if cfg.algo.overlong_cache else 0.0) for s in group.samples]
        shaped_all += shaped
        for sample, adv in zip(group.samples, group_advantages(shaped, cfg.algo.adv_eps),
                               strict=True):
            # Each token sequence of a harness trajectory trains with the trajectory's advantage.
            items += [TrainItem(replace(sample, flat=flat, segments=()), adv)
                      for flat in sample.flats]
    return items, (sum(shaped_all) / len(shaped_all) if shaped_all else 0.0)


class DapoTrainer:
    def __init__(self, cfg: DapoConfig, address: str, *, model_dir: Path,
                 console: Console | None = None, on_step: StepHook | None = None,
                 shared: SharedWeights | None = None) -> None:
        """``shared``: the serving engines live in this process and serve the policy's own
        tensors (see :class:`SharedWeights`); weights are then never written per step."""
        cfg.validate()
        self.shared = shared
        self.cfg = cfg
        self.address = address
        self.model_dir = model_dir
        self.console = console or Console()
        self.on_step = on_step
        self.run_dir = Path(cfg.run.dir).resolve()
        self.version = 0

    def _template(self, temperature: float) -> dict[str, Any]:
        r = self.cfg.rollout
        return {"sampling": {"temperature": temperature, "top_p": 1.0, "top_k": 0,
                             "max_tokens_per_turn": r.max_tokens,
                             "logprobs_mode": "LOGPROBS_KIND_PROCESSED"},
                "limits": {"max_turns": r.max_turns, "run_timeout": f"{r.run_timeout_s}s"}}

    async def run(self) -> RunSummary:
        cfg, console = self.cfg, self.console
        started = time.monotonic()
        train_rows = read_jobs(Path(cfg.data.train) if cfg.data.train else shipped.TRAIN_FILE)
        heldout = read_jobs(Path(cfg.data.heldout) if cfg.data.heldout
                            else shipped.HELDOUT_FILE)
        if cfg.data.heldout_limit:
            heldout = heldout[:cfg.data.heldout_limit]
        log = MetricsLog(self.run_dir, console)
        console.print(f"[bold]DAPO[/bold] model {self.model_dir} against {self.address}; "
                      f"{len(train_rows)} train / {len(heldout)} held-out tasks; run dir "
                      f"{self.run_dir}")
        policy = await asyncio.to_thread(
            Policy, self.model_dir, device=cfg.model.device, lr=cfg.algo.lr,
            warmup_steps=cfg.algo.warmup_steps, weight_decay=cfg.algo.weight_decay,
            betas=cfg.algo.betas, seed=cfg.run.seed, logit_chunk=cfg.algo.logit_chunk,
            gradient_checkpointing=cfg.algo.gradient_checkpointing)
        if self.shared is not None and not await self.shared.attach(policy.model):
            console.print("the in-process engine cannot share the policy's weights (another "
                          "dtype or device); pushing checkpoints instead")
            self.shared = None
        clip = ClipConfig(eps_low=cfg.algo.eps_low, eps_high=cfg.algo.eps_high,
                          dual_clip_c=cfg.algo.dual_clip_c or None,
                          tis_cap=cfg.algo.tis_cap or None)
        pusher = WeightPusher(self.address, token=cfg.service.token,
                              mode=cfg.service.weight_sync, backends=cfg.service.backends)
        b = cfg.batch
        bcfg = BatcherConfig(
            groups_per_batch=b.groups_per_batch, group_size=b.group_size,
            max_in_flight_groups=b.max_in_flight_groups, max_rounds=b.max_rounds,
            max_staleness=b.max_staleness, dynamic_sampling=b.dynamic_sampling,
            prefetch_groups=None if b.prefetch_groups < 0 else b.prefetch_groups,
            run_id=f"{cfg.service.client_id}-{int(time.time())}")
        tag = bcfg.run_id
        try:
            async with RolloutClient(self.address, token=cfg.service.token or None) as client:
                self.version = await pusher.served_version()

                async def held_out(step: int) -> EvalResult:
                    return await evaluate(
                        client, heldout, template=self._template(cfg.rollout.eval_temperature),
                        client_id=f"{cfg.service.client_id}-eval", run_tag=f"{tag}-eval{step}")

                first = await held_out(0)
                console.print(f"held-out accuracy at start: {first.accuracy:.3f} "
                              f"({len(heldout)} tasks, {first.failed} failed) {first.by_family}")
                log.log({"step": 0, "policy_version": self.version, **_eval_row(first),
                         "elapsed_s": time.monotonic() - started})
                last = first
                prompts = endless(train_rows, shuffle=cfg.data.shuffle, seed=cfg.run.seed)
                async with client.session(cfg.service.client_id) as session, \
                        GroupBatcher(session, prompts, bcfg,
                                     template=self._template(cfg.rollout.temperature),
                                     policy_version=self.version) as batcher:
                    step = 0
                    for step in range(1, cfg.run.steps + 1):
                        row = await self._step(step, batcher, policy, clip, pusher)
                        if step % max(cfg.run.eval_every, 1) == 0 or step == cfg.run.steps:
                            last = await held_out(step)
                            row.update(_eval_row(last))
                        row["elapsed_s"] = time.monotonic() - started
                        log.log(row)
                        if cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0:
                            await asyncio.to_thread(policy.save_checkpoint,
                                                    self.run_dir / f"checkpoint-{step}")
                        limit = cfg.run.time_limit_s
                        if limit and time.monotonic() - started >= limit:
                            console.print(f"time limit {limit:.0f} s reached after step {step}")
                            break
                    if log.rows[-1].get("heldout_accuracy") in ("", None):
                        last = await held_out(step)
                        log.log({**log.rows.pop(), **_eval_row(last)})
                await asyncio.to_thread(policy.save_checkpoint, self.run_dir / "checkpoint")
        finally:
            await pusher.close()
            log.close()
        delta, lo, hi = paired_bootstrap(first.scores, last.scores)
        summary = RunSummary(
            steps=step, policy_version=self.version, heldout_before=first.accuracy,
            heldout_after=last.accuracy, heldout_delta=delta, heldout_ci95=(lo, hi),
            heldout_tasks=len(heldout), by_family_before=first.by_family,
            by_family_after=last.by_family, elapsed_s=time.monotonic() - started,
            run_dir=str(self.run_dir))
        (self.run_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
        console.print(
            f"[bold]held-out accuracy {first.accuracy:.3f} -> {last.accuracy:.3f} "
            f"({delta * 100:+.1f} points; paired bootstrap 95% CI [{lo * 100:+.1f}, "
            f"{hi * 100:+.1f}] over {len(heldout)} tasks)[/bold] after {step} steps, "
            f"{summary.elapsed_s / 60:.1f} min; curves: {log.png_path}")
        return summary

    async def _step(self, step: int, batcher: GroupBatcher, policy: Policy, clip: ClipConfig,
                    pusher: WeightPusher) -> dict[str, Any]:
        cfg = self.cfg
        t0 = time.monotonic()
        reset_peak_rss()
        batch = await batcher.next_batch()
        t_roll = time.monotonic() - t0
        st = batch.stats
        row: dict[str, Any] = {
            "step": step, "kept_group_ratio": st.kept_group_ratio,
            "generation_rounds": st.generation_rounds,
            "groups_dropped_equal": st.groups_dropped_equal,
            "groups_cancelled": st.groups_cancelled, "cancelled_samples": st.cancelled_samples,
            "stale_dropped": st.stale_samples, "failed_samples": st.failed_samples,
            "accuracy": (sum(r >= 0.5 for r in st.rewards_all) / len(st.rewards_all)
                         if st.rewards_all else 0.0),
            "turns": _mean(st.turns_all), "tool_calls": _mean(st.tool_calls_all),
            "rollout_tokens_per_s": st.generated_tokens / max(t_roll, 1e-9),
            "time_rollout_s": t_roll, "lr": policy.lr}
        if not batch.groups:
            self.console.print(f"step {step}: no group with differing rewards within "
                               f"{st.generation_rounds} rounds; skipping the update")
            row["policy_version"] = self.version
            return row
        check_logprobs(batch)
        items, reward_mean = shape_and_normalise(batch, cfg)
        if self.shared is not None:
            await self.shared.pause()
        release_free_memory()
        row["rss_update_start_gib"] = rss_gib()
        upd = await asyncio.to_thread(
            policy.update, items, clip, temperature=cfg.rollout.temperature,
            micro_batch_size=cfg.algo.micro_batch_size, grad_clip=cfg.algo.grad_clip,
            mini_batches=cfg.algo.mini_batches, loss_agg=cfg.algo.loss_agg,
            correction=cfg.correction())
        t1 = time.monotonic()
        release_free_memory()  # the update's freed activations and gradients, before rollouts
        self.version += 1
        if self.shared is not None:
            await self.shared.publish(self.version)
        else:
            weights = self.run_dir / "weights" / f"v{self.version}"
            await asyncio.to_thread(policy.save_weights, weights)
            await pusher.push(weights, self.version)
            self._prune_weights()
        batcher.set_policy_version(self.version)
        t_push = time.monotonic() - t1
        if self.on_step is not None:
            await self.on_step(step, self.version)
        row.update({
            "policy_version": self.version, "reward_mean": reward_mean, "entropy": upd.entropy,
            "clip_low": upd.clip_low, "clip_high": upd.clip_high, "dual_clip": upd.dual_clip,
            "tis_truncated": upd.tis_truncated, "approx_kl": upd.approx_kl, "loss": upd.loss,
            "grad_norm": upd.grad_norm, "mismatch_kl_token": upd.mismatch_kl_token,
            "mismatch_kl_seq": upd.mismatch_kl_seq, "mismatch_masked": upd.mismatch_masked,
            "mismatch_weight_mean": upd.mismatch_weight_mean,
            "response_length": sum(i.sample.generated_tokens for i in items) / len(items),
            "train_tokens_per_s": upd.tokens / max(upd.seconds, 1e-9),
            "time_train_s": upd.seconds, "time_push_s": t_push, "peak_rss_gib": peak_rss_gib()})
        return row

    def _prune_weights(self) -> None:
        keep = self.cfg.run.keep_weights
        if not keep:
            return
        for old in range(self.version - keep, 0, -1):
            path = self.run_dir / "weights" / f"v{old}"
            if not path.exists():
                break
            shutil.rmtree(path, ignore_errors=True)


def _mean(values: Sequence[float]) -> float | str:
    return sum(values) / len(values) if values else ""


def _eval_row(result: EvalResult) -> dict[str, Any]:
    return {"heldout_accuracy": result.accuracy, "heldout_turns": result.turns,
            "heldout_tool_calls": result.tool_calls, "time_eval_s": result.seconds}
