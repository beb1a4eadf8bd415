"""``rollout bench gateway``: what the model gateway costs a harness, and what it saves a trainer.

(a) overhead — the same generations (a scripted policy: exact token scripts, a fixed
    ``--latency-ms`` per turn) asked for twice in one run: through the gateway (an HTTP
    ``POST /v1/chat/completions`` over the job's Unix socket, with the conversation rendered,
    the previous ids reused and the answer's tool calls parsed) and on the backend pool directly
    (a ``GenerateRequest`` with prompt ids of the same length). Per request: request in to the
    first content token out (``stream: true``) and to the last byte; p50 / p99 of each and the
    gateway's added time. The floor rows send the same requests, right after, to the
    gateway's HTTP stack alone (same client, socket kind, connection guard, body read and
    parse) answering with the gateway's recorded answers: the part of the added time that is
    HTTP itself rather than the gateway's work. The gateway streams the pool's pieces as they
    come; the scripted policy here gives each turn as one piece (``--latency-ms`` is a
    per-turn wait), so first and last token stay close: the streaming itself is shown by
    ``tests/server/gateway/test_streaming.py``.
(b) trainer tokens — multi-turn episodes (each turn a tool call and its observation) through the
    gateway: the tokens a trainer receives from the merged trajectory (one sequence per segment)
    against one sequence per request (what a proxy that records each request on its own hands
    over: every prompt again), for a harness that only appends and one that compacts its
    history every ``--compact-every`` turns (a new segment each time).

(c) a sub-agent-heavy harness — a main thread and two sub-agents (each its own system prompt)
    whose requests alternate (main, sub-agent 1, sub-agent 2, main, ...): the tokens a trainer
    receives with one chain per line of conversation (this gateway), with one current segment
    that every switch re-renders from scratch (one segment per rewrite: the gateway before
    chains), and with one sequence per request.

The model is the scripted policy over the SmolLM2 tokenizer (no weights run), so the numbers are
the gateway's own cost; ``--latency-ms`` adds a fixed generation time to both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from rich.console import Console
from rich.table import Table

from rollout.runtime.gateway import GatewayLease, HarnessCapture
from rollout.runtime.llm import GenerateRequest
from rollout.runtime.types import JobSpec, Limits, SamplingParams
from rollout.server.gateway import Gateway
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.scripted import ScriptedEngine

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
SYSTEM = {"role": "system", "content": "You are a software engineering agent. " * 8}
TASK = {"role": "user", "content": "Fix the failing test in the repository. " * 4}


def reply(turn: int) -> str:
    command = f"grep -rn 'def test_{turn}' tests/ && python -m pytest -q tests/test_{turn}.py"
    return (f"Step {turn}: I will look at the tests next.\n<tool_call>\n"
            + json.dumps({"name": "bash", "arguments": {"command": command}})
            + "\n</tool_call>")


def observation(turn: int) -> str:
    return "\n".join(f"tests/test_{turn}.py:{i}: assert add({i}, {i}) == {2 * i}"
                     for i in range(12))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Episode:
    """One harness conversation over a lease, speaking raw HTTP (no client library cost)."""

    def __init__(self, lease: GatewayLease, system: dict[str, Any] = SYSTEM,
                 url: str = "http://gateway/v1/chat/completions",
                 record: list[bytes] | None = None) -> None:
        self.lease = lease
        self.messages: list[dict[str, Any]] = [system, TASK]
        self.url = url
        self.record = record
        """Where each answer's raw body goes (what the HTTP floor replays)."""

    async def turn(self, session: aiohttp.ClientSession, index: int, *, stream: bool
                   ) -> tuple[float, float]:
        started = time.perf_counter()
        first = 0.0
        body = {"model": "m", "messages": self.messages, "tools": TOOLS, "stream": stream}
        async with session.post(self.url, json=body, headers={
                "Authorization": f"Bearer {self.lease.api_key}"}) as response:
            if response.status != 200:
                raise RuntimeError(f"gateway answered {response.status}: "
                                   f"{await response.text()}")
            if stream:
                content, calls = "", []
                async for raw in response.content:
                    if self.record is not None:
                        self.record.append(raw)
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    if delta.get("content") and not first:
                        first = time.perf_counter() - started
                    content += delta.get("content") or ""
                    for c in delta.get("tool_calls") or []:
                        if c.get("id"):
                            calls.append({"id": c["id"], "type": "function", "function": {
                                "name": c["function"]["name"], "arguments": ""}})
                        calls[c["index"]]["function"]["arguments"] += c["function"].get(
                            "arguments") or ""
                message: dict[str, Any] = {"role": "assistant", "content": content,
                                           "tool_calls": calls}
            else:
                raw = await response.read()
                if self.record is not None:
                    self.record.append(raw)
                message = json.loads(raw)["choices"][0]["message"]
        done = time.perf_counter() - started
        self.messages.append(message)
        for call in message.get("tool_calls") or []:
            self.messages.append({"role": "tool", "tool_call_id": call["id"],
                                  "content": observation(index)})
        return first or done, done

    def compact(self) -> None:
        """What a context-managing harness does: keep the task and the last exchange only."""
        self.messages = [SYSTEM, TASK, *self.messages[-2:]]


async def bench_overhead(gateway: Gateway, pool: BackendPool, engine: ScriptedEngine,
                         episodes: int, turns: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"gw_first": [], "gw_last": [], "gw_plain": [],
                                   "direct": [], "http_first": [], "http_plain": []}
    for e in range(episodes):
        for stream in (True, False):
            job = f"gw-{e}-{int(stream)}"
            lease = await gateway.open(JobSpec(job, "bench", {}, sampling=SamplingParams(
                seed=e), limits=Limits(max_turns=turns + 1)), pool)
            answers: list[list[bytes]] = []
            episode = Episode(lease)
            connector = aiohttp.UnixConnector(path=lease.socket_path)
            async with aiohttp.ClientSession(connector=connector) as session:
                for t in range(turns):
                    episode.record = []
                    first, last = await episode.turn(session, t, stream=stream)
                    answers.append(episode.record)
                    if stream:
                        out["gw_first"].append(first)
                        out["gw_last"].append(last)
                    else:
                        out["gw_plain"].append(last)
            # The same requests and answers over HTTP alone, right after (same conditions).
            for first, _ in await http_floor(lease, answers, stream=stream, turns=turns):
                out["http_first" if stream else "http_plain"].append(first)
            capture = await gateway.close(lease)
            await pool.end_session(job)
            if stream:  # the same prompts and generations, on the pool directly
                prompt: list[int] = []
                for t, turn in enumerate(capture.turns):
                    prompt += turn.prompt_ids
                    request = GenerateRequest(prompt_ids=list(prompt),
                                              sampling=SamplingParams(seed=e), max_tokens=512,
                                              session_id=f"direct-{e}", seed=e + t)
                    started = time.perf_counter()
                    result = await pool.generate(request)
                    out["direct"].append(time.perf_counter() - started)
                    if result.output_ids != turn.output_ids:
                        raise RuntimeError("the direct generation differs from the gateway's")
                    prompt += turn.output_ids + turn.observation_ids
                await pool.end_session(f"direct-{e}")
    return out


async def http_floor(lease: GatewayLease, answers: list[list[bytes]], *, stream: bool,
                     turns: int) -> list[tuple[float, float]]:
    """An episode's requests again, on a socket of its own served by the gateway's HTTP
    stack (aiohttp with the same connection guard, body read and JSON parse) whose handler
    answers each with the gateway's recorded answer: what HTTP alone costs of the added
    time."""
    from rollout.server.gateway import connections, routes
    from rollout.server.gateway.messages import RequestLimits

    limits = RequestLimits()
    replies = iter(answers)

    async def handler(request: web.Request) -> web.StreamResponse:
        await routes._read_json(request, limits)
        body = b"".join(next(replies))
        if not stream:
            return web.Response(body=body, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(body)
        await response.write_eof()
        return response

    app = connections.guard(web.Application(client_max_size=limits.max_body_bytes + 1))
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    path = lease.socket_path + ".floor"
    try:
        await connections.unix_site(runner, path, "bench HTTP floor").start()
        episode = Episode(lease)
        async with aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=path)) as session:
            return [await episode.turn(session, t, stream=stream) for t in range(turns)]
    finally:
        await runner.cleanup()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def trainer_tokens(capture: HarnessCapture) -> tuple[int, int, int, int]:
    """(merged tokens, sequences) and (per-request tokens, sequences)."""
    merged = sum(len(t.prompt_ids) + len(t.output_ids) + len(t.observation_ids)
                 for t in capture.turns)
    per_request, prompt = 0, 0
    starts = {s.first_turn for s in capture.segments}
    for i, t in enumerate(capture.turns):
        prompt = len(t.prompt_ids) if i in starts else prompt + len(t.prompt_ids)
        per_request += prompt + len(t.output_ids)
        prompt += len(t.output_ids) + len(t.observation_ids)
    return merged, len(capture.segments), per_request, len(capture.turns)


async def bench_tokens(gateway: Gateway, pool: BackendPool, turns: int,
                       compact_every: int) -> dict[str, tuple[int, int, int, int]]:
    out = {}
    for name, every in (("appending harness", 0), ("compacting harness", compact_every)):
        job = f"tokens-{every}"
        lease = await gateway.open(JobSpec(job, "bench", {}, sampling=SamplingParams(
            seed=1, total_token_budget=1 << 20), limits=Limits(max_turns=turns + 1)), pool)
        episode = Episode(lease)
        async with aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=lease.socket_path)) as session:
            for t in range(turns):
                if every and t and t % every == 0:
                    episode.compact()
                await episode.turn(session, t, stream=False)
        out[name] = trainer_tokens(await gateway.close(lease))
        await pool.end_session(job)
    return out


async def bench_sub_agents(gateway: Gateway, pool: BackendPool, rounds: int,
                           ) -> tuple[int, int, int, int, int, int]:
    """(chains tokens, sequences), (one segment per rewrite), (one sequence per request)."""
    job = "tokens-sub-agents"
    lease = await gateway.open(JobSpec(job, "bench", {}, sampling=SamplingParams(
        seed=1, total_token_budget=1 << 20), limits=Limits(max_turns=3 * rounds + 1)), pool)
    threads = [Episode(lease), *(Episode(lease, {
        "role": "system", "content": f"You are sub-agent {k}: explore and report. " * 6})
        for k in (1, 2))]
    order: list[int] = []
    async with aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=lease.socket_path)) as session:
        for r in range(rounds):
            for k, thread in enumerate(threads):
                await thread.turn(session, r, stream=False)
                order.append(k)
    capture = await gateway.close(lease)
    await pool.end_session(job)
    if len(capture.segments) != len(threads):
        raise RuntimeError(f"expected {len(threads)} chains, got {len(capture.segments)}")
    return sub_agent_tokens(capture, order)


def sub_agent_tokens(capture: HarnessCapture, order: list[int],
                     ) -> tuple[int, int, int, int, int, int]:
    """Trainer tokens and sequences of three shapes of one capture whose chain ``k`` served
    the requests marked ``k`` in ``order`` (request order): chains; one current segment that
    each switch of chain starts again from a whole prompt; one sequence per request."""
    chains = [capture.turns[a:b] for a, b in zip(
        [s.first_turn for s in capture.segments],
        [*(s.first_turn for s in capture.segments[1:]), len(capture.turns)], strict=True)]
    full: list[list[int]] = []  # per chain, each turn's whole prompt length
    for turns in chains:
        lengths, so_far = [], 0
        for t in turns:
            so_far += len(t.prompt_ids)
            lengths.append(so_far)
            so_far += len(t.output_ids) + len(t.observation_ids)
        full.append(lengths)
    merged = sum(len(t.prompt_ids) + len(t.output_ids) + len(t.observation_ids)
                 for t in capture.turns)
    seen = [0] * len(chains)
    rewrite = per_request = rewrite_sequences = 0
    previous = -1
    for k in order:
        j = seen[k]
        turn = chains[k][j]
        per_request += full[k][j] + len(turn.output_ids)
        if k == previous:  # extends the one current segment
            rewrite += len(chains[k][j - 1].observation_ids) + len(turn.prompt_ids)
        else:  # a switch: the whole conversation again, as a new segment
            rewrite += full[k][j]
            rewrite_sequences += 1
        rewrite += len(turn.output_ids)
        seen[k], previous = j + 1, k
    return (merged, len(chains), rewrite, rewrite_sequences, per_request, len(order))


async def _main(args: argparse.Namespace, console: Console) -> None:
    from transformers import AutoTokenizer

    from rollout.server.llm.smollm2 import smollm2_dir

    tok: Any = AutoTokenizer.from_pretrained(str(await asyncio.to_thread(smollm2_dir)))
    engine = ScriptedEngine(tok, lambda _sid, turn: reply(turn),
                            end_of_turn_id=tok.convert_tokens_to_ids("<|im_end|>"),
                            latency_s=args.latency_ms / 1000)
    pool = BackendPool([engine], health_interval_s=0)
    with tempfile.TemporaryDirectory(prefix="rollout-bench-gw-") as state:
        gateway = await Gateway(Path(state)).start()
        try:
            await bench_overhead(gateway, pool, engine, 1, 2)  # warm-up: template, imports
            if args.gc_freeze:  # as `rollout serve` does once it is up
                gc.freeze()
            o = await bench_overhead(gateway, pool, engine, args.episodes, args.turns)
            t = await bench_tokens(gateway, pool, args.turns, args.compact_every)
            sub = await bench_sub_agents(gateway, pool, args.turns)
        finally:
            gc.unfreeze()  # a caller in the same process (a test) gets its collector back whole
            await gateway.stop()
            await pool.close()
    n = len(o["direct"])
    table = Table(title=f"rollout bench gateway: (a) per-request latency, {n} requests "
                        f"({args.episodes} episodes x {args.turns} turns, scripted policy, "
                        f"{args.latency_ms:g} ms generation)")
    for column in ("path", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms"):
        table.add_column(column)
    base = o["direct"]
    table.add_row("backend pool directly (baseline)", f"{pct(base, .5) * 1e3:.2f}",
                  f"{pct(base, .99) * 1e3:.2f}", "-", "-")
    for key, label in (("http_first", "HTTP alone (floor), stream: first token"),
                       ("http_plain", "HTTP alone (floor), no stream: whole answer"),
                       ("gw_first", "gateway, stream: first token"),
                       ("gw_last", "gateway, stream: last token"),
                       ("gw_plain", "gateway, no stream: whole answer")):
        values = o[key]
        # HTTP alone generates nothing: all of its time is added to the pool's.
        floor = 0.0 if key.startswith("http") else 1.0
        table.add_row(label, f"{pct(values, .5) * 1e3:.2f}", f"{pct(values, .99) * 1e3:.2f}",
                      f"{(pct(values, .5) - floor * pct(base, .5)) * 1e3:.2f}",
                      f"{(pct(values, .99) - floor * pct(base, .99)) * 1e3:.2f}")
    console.print(table)
    tokens = Table(title=f"(b) tokens a trainer receives for one {args.turns}-turn episode")
    for column in ("harness", "merged trajectory", "one sequence per request", "ratio"):
        tokens.add_column(column)
    for name, (merged, segments, per_request, requests) in t.items():
        tokens.add_row(name, f"{merged:,} tokens in {segments} sequence(s)",
                       f"{per_request:,} tokens in {requests} sequences",
                       f"{per_request / merged:.2f}x")
    console.print(tokens)
    chained, chain_n, rewrite, rewrite_n, per_request, requests = sub
    agents = Table(title=f"(c) sub-agent-heavy harness: main thread and 2 sub-agents "
                         f"alternating, {requests} requests")
    for column in ("trajectory shape", "tokens a trainer receives", "sequences", "vs chains"):
        agents.add_column(column)
    agents.add_row("one chain per line of conversation (this gateway)", f"{chained:,}",
                   str(chain_n), "1.00x")
    agents.add_row("one current segment, a new one per switch", f"{rewrite:,}",
                   str(rewrite_n), f"{rewrite / chained:.2f}x")
    agents.add_row("one sequence per request", f"{per_request:,}", str(requests),
                   f"{per_request / chained:.2f}x")
    console.print(agents)
    console.print(f"mean direct {statistics.mean(base) * 1e3:.2f} ms over {n} turns")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollout bench gateway",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                        help="freeze what warm-up made out of the collector's reach, as the "
                        "server does after start (--no-gc-freeze: the baseline)")
    parser.add_argument("--turns", type=int, default=10, help="requests per episode")
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="fixed generation time of each scripted turn (both paths)")
    parser.add_argument("--compact-every", type=int, default=4,
                        help="in (b), the compacting harness rewrites its history this often")
    args = parser.parse_args(argv)
    asyncio.run(_main(args, Console()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
