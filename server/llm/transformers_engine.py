"""The in-process transformers engine (CPU or CUDA) with continuous batching and sticky KV.

How it works:
- One scheduler task on the event loop admits queued requests and hands a *step* to a single
  worker thread (model forwards never run on the loop). A step prefills the requests that joined
  in one forward (each reusing its session's cached KV, so only new tokens are computed; see
  :class:`~rollout.server.llm.decode_batch.PrefillBatch` for the padding), then runs one batched
  decode step for every active sequence. Sequences join and leave the batch between steps, so
  16 concurrent generations cost about one forward per token instead of sixteen.
- The batch's KV cache is left-padded to a common length; each row has its own attention mask
  and position ids, so padding never changes a sequence's result.
- When a turn ends, its KV is stored in a :class:`~rollout.server.llm.kv_store.KVStore` under the
  session id (LRU within a byte budget). The next turn reuses the longest common prefix.

Weight hot-swap (:meth:`TransformersEngine.update_weights`): admission pauses, the turns in flight
**finish on the old weights** (up to ``drain_timeout_s``; after that they are cut with
``finish_reason="preempted"`` and keep the tokens produced so far, which the agent loop discards
and re-issues), then the weights are copied in place, every cached KV is dropped (it was computed
by the old policy) and the version is bumped. So every token of a turn comes from the single
version reported in its result.

Turn deadlines (``GenerateRequest.timeout_s``): the worker checks the clock before every decode
step and ends a turn whose time is up with ``finish_reason="deadline"``, keeping its tokens and
logprobs; a turn still queued when its time runs out returns ``deadline`` with no tokens.

Logprobs are those of the distribution sampled from (or raw, per request); see
:mod:`~rollout.server.llm.sampling`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import itertools
import os
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollout.runtime.llm import GenerateRequest, GenerateResult
from rollout.runtime.types import InvalidArgument
from rollout.server.llm.decode_batch import DecodeBatch, PrefillBatch, plan_prefill
from rollout.server.llm.engine import Engine, EngineError
from rollout.server.llm.kv_store import KVStore, LayerKV, SessionKV, common_prefix
from rollout.server.llm.sampling import Sampler, TopLogprobs, sample, validate_request
from rollout.server.llm.weights import load_state_dict_into

_names = itertools.count()


@dataclass(frozen=True)
class TurnStats:
    """What one finished turn cost; kept for benchmarks and tests (``engine.turn_stats``)."""

    session_id: str
    cached_tokens: int
    """Prompt tokens whose KV came from the session cache."""
    prefilled_tokens: int
    """Prompt tokens that had to be computed."""
    prefill_s: float
    generated_tokens: int


class _Seq:
    """One generation in flight (owned by the worker thread once admitted)."""

    def __init__(self, request: GenerateRequest, sampler: Sampler, stop_ids: frozenset[int],
                 max_tokens: int, future: asyncio.Future[GenerateResult]) -> None:
        self.request = request
        self.prompt = list(request.prompt_ids)
        self.sampler = sampler
        self.stop_ids = stop_ids
        self.max_tokens = max_tokens
        self.future = future
        self.output: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[TopLogprobs] = []
        """Per output token, the most likely tokens when the request asked for them."""
        self.kv: SessionKV | None = None  # own cache until the sequence joins the batch
        self.length = 0  # positions holding KV
        self.finish: str | None = None
        self.aborted = False
        self.progress: asyncio.Event | None = None
        """Set after every step while someone streams this turn."""
        self.cut: str | None = None
        """Set from the loop to end the turn at the next step with this finish reason
        (``preempted``: a weight swap's drain ran out)."""
        self.deadline = (None if request.timeout_s is None
                         else time.monotonic() + max(0.0, request.timeout_s))
        self.retired = False
        self.released = False  # the session ended while this turn ran: don't keep its KV
        self.version = 0
        self.cached_tokens = 0
        self.prefill_s = 0.0
        self.routed: list[int] = []
        """MoE routing per output token, flattened [token][layer][k] (R3)."""
        self.routed_layers = 0

    @property
    def session_id(self) -> str:
        return self.request.session_id


def cache_keyword(model: Any) -> str:
    """The name a model's ``forward`` (and its output) gives the KV cache: ``cache`` in newer
    transformers, ``past_key_values`` before (the old name still works there but warns)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def moe_top_k(config: Any) -> int:
    """``k`` of a mixture-of-experts config (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE name it
    ``num_experts_per_tok``, the expert count ``num_experts`` or ``num_local_experts``); 0 for a
    dense model."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    k = getattr(config, "num_experts_per_tok", None)
    return int(k) if experts and k else 0


def pick_threads(cores: int | None = None, load: float | None = None) -> int:
    """Intra-op threads for a CPU engine: the cores this process may use that other work is
    not already keeping busy (the 1-minute load average), at least 1.

    OpenMP threads spin while they wait for each other, so on a machine whose cores are taken
    every thread beyond the free ones costs more than it adds: one thread degrades gently
    where the full count stalls.
    """
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = 0.0
    return max(1, min(cores, int(cores - load + 0.5)))


class TransformersEngine(Engine):
    """A Hugging Face causal LM served in-process. See the module docstring."""

    kind = "in_process"

    def __init__(self, model_dir: str | Path, device: str = "cpu", name: str | None = None,
                 kv_cache_budget_bytes: int = 512 * 2**20, max_batch_size: int = 16,
                 dtype: torch.dtype | None = None, drain_timeout_s: float = 60.0,
                 policy_version: int = 0, ignore_eos: bool = False,
                 num_threads: int | None = None, prefill_overhead_tokens: int = 32) -> None:
        """``ignore_eos`` makes every turn run to ``max_tokens`` (benchmarks: equal work).

        ``prefill_overhead_tokens`` is a prefill forward's fixed cost in tokens of compute, which
        :func:`~rollout.server.llm.decode_batch.plan_prefill` weighs against padding when it groups
        the joining turns. The default suits a small model on one CPU thread; on a GPU the fixed
        cost is far larger relative to a token, so set it higher there (e.g. 512) to batch more
        eagerly.

        ``num_threads`` sets torch's (process-wide) intra-op threads; None picks
        :func:`pick_threads` on a CPU (cores not already busy) and leaves a GPU's alone.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        # A server's output is a log, and the quickstart's is its progress bars: no
        # "Loading weights" bar of the library's own in either.
        hf_logging.disable_progress_bar()
        if num_threads is None and torch.device(device).type == "cpu":
            num_threads = pick_threads()
        if num_threads:
            torch.set_num_threads(num_threads)
        self.num_threads = torch.get_num_threads()
        self.name = name or f"transformers-{next(_names)}"
        self.model_dir = Path(model_dir)
        self.model_name = str(model_dir)
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.drain_timeout_s = drain_timeout_s
        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        self.model.to(self.device).eval()  # type: ignore[arg-type]
        self._cache_kw = cache_keyword(self.model)
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 1 << 20))
        self.moe_top_k = moe_top_k(self.model.config)
        """Experts per token of a mixture-of-experts model (0: dense). Such a model's turns
        carry the router's choices per output token, for routing replay in the trainer."""
        self.eos_ids = frozenset() if ignore_eos else frozenset(self._eos_ids())
        self.kv_store = KVStore(kv_cache_budget_bytes)
        self.turn_stats: collections.deque[TurnStats] = collections.deque(maxlen=4096)
        self.decode_steps = 0
        self.batched_prefills = 0
        """Prefill forwards that covered more than one sequence."""
        self.batched_cached_prefills = 0
        """Of those, the ones where at least one sequence reused its session's cached KV."""
        self.batch_cached_prefill = True
        self.prefill_overhead_tokens = prefill_overhead_tokens
        """False: turns with a cached prefix prefill one at a time (benchmark baseline)."""
        self.max_batch_seen = 0
        self._version = policy_version
        self._executor = concurrent.futures.ThreadPoolExecutor(1, f"{self.name}-worker")
        self._pending: collections.deque[_Seq] = collections.deque()
        self._active: list[_Seq] = []  # admitted; the worker thread owns their state
        self._batch: DecodeBatch[_Seq] | None = None
        self._wakeup: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._paused = False
        self._shares_weights = False
        """Whether :meth:`share_weights` made the tensors another owner's (who then relabels)."""
        self._swap_lock: asyncio.Lock | None = None
        self._closed = False

    # ----------------------------------------------------------------- Engine interface
    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def load(self) -> int:
        """Requests queued or generating."""
        return len(self._pending) + len(self._active)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        seq = self._submit(request)
        try:
            return await asyncio.shield(seq.future)
        except asyncio.CancelledError:
            self._give_up(seq)
            raise

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[GenerateResult, None]:
        """One turn as it is generated: each result holds the tokens (and logprobs) produced
        since the previous one, with ``finish_reason=""`` until the last. Closing the iterator
        early aborts the turn (``rollout llm-serve`` streams with it)."""
        seq = self._submit(request)
        seq.progress = asyncio.Event()
        sent = 0
        try:
            while not seq.future.done():
                progress = asyncio.ensure_future(seq.progress.wait())
                waiters: set[asyncio.Future[Any]] = {progress, seq.future}
                try:
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    progress.cancel()
                seq.progress.clear()
                # The worker may be appending to the lists right now: take only the tokens
                # whose logprob (and, for an MoE model, routing) is recorded too.
                ready = min(len(seq.output), len(seq.logprobs))
                if seq.sampler.top_logprobs:
                    ready = min(ready, len(seq.tops))
                stride = seq.routed_layers * self.moe_top_k
                if stride:
                    ready = min(ready, len(seq.routed) // stride)
                if ready > sent and not seq.future.done():
                    yield GenerateResult(seq.output[sent:ready], seq.logprobs[sent:ready], "",
                                         seq.version, self.name, seq.sampler.logprobs_kind,
                                         top_logprobs=seq.tops[sent:ready],
                                         **_routing(seq.routed[sent * stride:ready * stride],
                                                    self.moe_top_k, seq.routed_layers))
                    sent = ready
            final = seq.future.result()
            stride = final.routed_expert_layers * final.routed_expert_top_k
            yield GenerateResult(final.output_ids[sent:], final.logprobs[sent:],
                                 final.finish_reason, final.policy_version, final.backend,
                                 final.logprobs_kind, top_logprobs=final.top_logprobs[sent:],
                                 **_routing(final.routed_experts[sent * stride:],
                                            final.routed_expert_top_k,
                                            final.routed_expert_layers))
        except (asyncio.CancelledError, GeneratorExit):
            self._give_up(seq)
            raise

    def generate_stream(self, request: GenerateRequest) -> AsyncGenerator[GenerateResult, None]:
        """The pool's streaming interface: :meth:`stream`."""
        return self.stream(request)

    def _submit(self, request: GenerateRequest) -> _Seq:
        if self._closed:
            raise EngineError(f"{self.name} is closed")
        validate_request(request.sampling, request.max_tokens, list(request.prompt_ids),
                         self.vocab_size, request.top_logprobs)
        room = self.max_context - len(request.prompt_ids)
        if room <= 0:
            raise InvalidArgument(
                f"prompt of {len(request.prompt_ids)} tokens exceeds the model context of "
                f"{self.max_context}", "CONTEXT_LENGTH_EXCEEDED", "prompt_ids")
        self._ensure_started()
        seed = request.seed if request.seed is not None else request.sampling.seed
        loop = asyncio.get_running_loop()
        seq = _Seq(request, Sampler.create(request.sampling, seed, self.device,
                                           request.top_logprobs),
                   self.eos_ids | frozenset(request.sampling.stop_token_ids),
                   min(request.max_tokens, room), loop.create_future())
        self._pending.append(seq)
        if request.timeout_s is not None:
            # The worker checks admitted turns each step; this timer covers a turn still
            # queued (a weight swap or a full batch holding it) when its time runs out.
            timer = loop.call_later(max(0.0, request.timeout_s), self._expire_queued, seq)
            seq.future.add_done_callback(lambda _: timer.cancel())
        assert self._wakeup is not None
        self._wakeup.set()
        return seq

    def _expire_queued(self, seq: _Seq) -> None:
        if seq in self._pending and not seq.future.done():
            self._pending.remove(seq)
            seq.version = self._version
            seq.future.set_result(self._result(seq, "deadline"))

    def _give_up(self, seq: _Seq) -> None:
        """The caller went away (job cancelled): free the batch slot at the next step."""
        seq.aborted = True
        if seq in self._pending:
            self._pending.remove(seq)

    async def abort(self, session_id: str) -> None:
        for seq in list(self._pending) + list(self._active):
            if seq.session_id == session_id:
                seq.aborted = True
        if self._wakeup is not None:
            self._wakeup.set()

    async def release_session(self, session_id: str) -> None:
        """Drop the session's KV, including what a turn still running would check in later
        (a cancelled job aborts its turn and ends the session before the turn retires)."""
        for seq in list(self._pending) + list(self._active):
            if seq.session_id == session_id:
                seq.released = True
        self.kv_store.drop(session_id)

    async def health(self) -> bool:
        return not self._closed and (self._task is None or not self._task.done())

    async def update_weights(self, source: Any, version: int) -> None:
        """Swap weights (a checkpoint directory or a state dict) between turns; see module doc."""
        self._ensure_started()
        assert self._swap_lock is not None and self._idle is not None
        async with self._swap_lock:
            self._paused = True
            try:
                try:
                    # Not wait_for: Python 3.11's drops a cancel arriving as the engine goes
                    # idle (gh-86296), and a cancelled swap would load the weights anyway.
                    async with asyncio.timeout(self.drain_timeout_s):
                        await self._idle.wait()
                except TimeoutError:
                    # The turns still running would mix two policies: cut them, marked so
                    # the agent loop re-issues them rather than scoring a partial turn.
                    for seq in self._active:
                        seq.cut = "preempted"
                    await self._idle.wait()
                loop = asyncio.get_running_loop()
                state = source if isinstance(source, Mapping) else Path(source)
                await loop.run_in_executor(self._executor, load_state_dict_into, self.model,
                                           state)
                self.kv_store.clear()
                self._version = version
            finally:
                self._paused = False
                assert self._wakeup is not None
                self._wakeup.set()

    def share_weights(self, model: Any) -> None:
        """Serve ``model``'s own parameter tensors from now on (an in-process trainer's policy
        of the same architecture, dtype and device), freeing this engine's copy. The trainer
        then changes them in place: it must :meth:`pause` the engine before its optimizer steps
        and :meth:`set_policy_version` after, so no turn runs on half-updated weights."""
        mine = dict(self.model.named_parameters())
        theirs = dict(model.named_parameters())
        wrong = [name for name, p in mine.items()
                 if name not in theirs or theirs[name].shape != p.shape
                 or theirs[name].dtype != p.dtype or theirs[name].device != p.device]
        if wrong or len(mine) != len(theirs):
            raise ValueError(f"{self.name}: cannot share weights with a model of another "
                             f"architecture, dtype or device (first mismatches: {wrong[:3]})")
        for name, param in mine.items():
            param.data = theirs[name].data
        self._shares_weights = True
        self.kv_store.clear()

    def set_policy_version(self, version: int) -> None:
        """The weights were changed in place by their owner (see :meth:`share_weights`): label
        later turns ``version`` and drop the KV caches the old weights computed.

        An engine with weights of its own refuses (the pool's ``BACKEND_LOADS_OWN_WEIGHTS``):
        nobody else can change them, so a new label would lie about what it serves."""
        if not self._shares_weights:
            raise NotImplementedError(f"{self.name} loads its own weights; its version changes "
                                      "only through update_weights")
        self.kv_store.clear()
        self._version = version

    async def pause(self, wait: bool = True) -> None:
        """Stop admitting turns (vLLM's ``/pause``); with ``wait``, return once none is running."""
        self._ensure_started()
        self._paused = True
        if wait:
            assert self._idle is not None
            await self._idle.wait()

    async def resume(self) -> None:
        self._paused = False
        if self._wakeup is not None:
            self._wakeup.set()

    @property
    def paused(self) -> bool:
        return self._paused

    async def close(self) -> None:
        self._closed = True
        for seq in list(self._pending) + list(self._active):
            seq.aborted = True
        if self._task is not None:
            assert self._wakeup is not None
            self._wakeup.set()
            try:
                # Awaiting the task directly: the timeout's cancel (or our caller's) reaches it,
                # as wait_for's did, without Python 3.11 wait_for's lost cancel (gh-86296).
                async with asyncio.timeout(30):
                    await self._task
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
        for seq in self._pending:
            if not seq.future.done():
                seq.future.set_exception(EngineError(f"{self.name} closed"))
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------- scheduler (event loop)
    def _ensure_started(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._idle = asyncio.Event()
            self._idle.set()
            self._swap_lock = asyncio.Lock()
            self._task = asyncio.create_task(self._run(), name=f"{self.name}-scheduler")

    async def _run(self) -> None:
        assert self._wakeup is not None and self._idle is not None
        loop = asyncio.get_running_loop()
        while True:
            joining: list[_Seq] = []
            while (self._pending and not self._paused and not self._closed
                   and len(self._active) + len(joining) < self.max_batch_size):
                seq = self._pending.popleft()
                seq.version = self._version
                joining.append(seq)
            if not joining and not self._active:
                self._idle.set()
                if self._closed:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self._idle.clear()
            self._active.extend(joining)
            try:
                await loop.run_in_executor(self._executor, self._step, joining)
            except Exception as exc:  # the model itself failed: fail everything in flight
                self._batch = None
                for seq in self._active:
                    seq.finish = "error"
                    if not seq.future.done():
                        seq.future.set_exception(EngineError(f"{self.name}: {exc!r}"))
                self._active = []
                continue
            still: list[_Seq] = []
            for seq in self._active:
                if seq.progress is not None:
                    seq.progress.set()
                if seq.finish is None:
                    still.append(seq)
                elif not seq.future.done():
                    seq.future.set_result(self._result(seq))
            self._active = still

    def _result(self, seq: _Seq, finish: str | None = None) -> GenerateResult:
        return GenerateResult(output_ids=list(seq.output), logprobs=list(seq.logprobs),
                              finish_reason=finish or seq.finish or "abort",
                              policy_version=seq.version,
                              backend=self.name, logprobs_kind=seq.sampler.logprobs_kind,
                              routed_experts=list(seq.routed),
                              routed_expert_top_k=self.moe_top_k if seq.routed else 0,
                              routed_expert_layers=seq.routed_layers if seq.routed else 0,
                              top_logprobs=list(seq.tops))

    # ----------------------------------------------------------------- worker thread
    @torch.inference_mode()
    def _step(self, joining: list[_Seq]) -> None:
        live: list[_Seq] = []
        now = time.monotonic()
        for seq in joining:
            self._check_cut(seq, now)
            if seq.finish is None:
                live.append(seq)
        if live:
            self._prefill(live)
        now = time.monotonic()
        for seq in self._active:
            self._check_cut(seq, now)
            if seq.finish is not None:
                self._retire(seq)  # rows of the previous batch are still readable here
        members = [s for s in self._active if s.finish is None]
        self._batch = DecodeBatch.rebuild(self._batch, members) if members else None
        if self._batch is not None:
            logits, routing = self._forward_decode(self._batch)
            tokens, logprobs, tops = sample(logits, [s.sampler for s in self._batch.seqs])
            for row, (seq, token, logprob) in enumerate(zip(self._batch.seqs, tokens, logprobs,
                                                            strict=True)):
                seq.length += 1
                self._record_routing(seq, routing, row)
                self._append(seq, token, logprob, tops[row])
        for seq in self._active:
            if seq.finish is not None:
                self._retire(seq)

    @staticmethod
    def _check_cut(seq: _Seq, now: float) -> None:
        """End a running turn that was aborted, preempted or ran out of time."""
        if seq.finish is not None:
            return
        if seq.aborted:
            seq.finish = "abort"
        elif seq.cut is not None:
            seq.finish = seq.cut
        elif seq.deadline is not None and now >= seq.deadline:
            seq.finish = "deadline"

    def _cached_prefix(self, seq: _Seq) -> list[LayerKV] | None:
        """Check the session's KV out and crop it to the reusable prefix (None: nothing to reuse).

        At least one prompt token is always left to compute: its logits give the first output.
        """
        cached = self.kv_store.checkout(seq.session_id)
        if cached is None:
            return None
        reuse = min(common_prefix(cached.tokens, seq.prompt), len(seq.prompt) - 1)
        return cached.crop(reuse).layers if reuse > 0 else None

    def _prefill(self, seqs: list[_Seq]) -> None:
        """Prefill the joining sequences, reusing each one's cached prefix.

        They go through :class:`PrefillBatch` forwards (cached or not) grouped by
        :func:`plan_prefill` so padding stays cheap; with ``batch_cached_prefill=False`` the ones
        with a cached prefix go one at a time and the rest in one forward (the behaviour before
        batched cached prefill; kept as the benchmark's baseline).
        """
        pasts = [self._cached_prefix(seq) for seq in seqs]
        if not self.batch_cached_prefill:
            for seq, past in zip(seqs, pasts, strict=True):
                if past is not None:
                    self._prefill_rows([seq], [past])
            fresh = [s for s, p in zip(seqs, pasts, strict=True) if p is None]
            if fresh:
                self._prefill_rows(fresh, [None] * len(fresh))
            return
        new = [len(s.prompt) - (0 if p is None else p[0][0].shape[2])
               for s, p in zip(seqs, pasts, strict=True)]
        for group in plan_prefill(new, self.prefill_overhead_tokens):
            self._prefill_rows([seqs[i] for i in group], [pasts[i] for i in group])

    def _prefill_rows(self, seqs: list[_Seq], pasts: list[list[LayerKV] | None]) -> None:
        start = time.perf_counter()
        batch = PrefillBatch([s.prompt for s in seqs], pasts, self.device)
        single = len(seqs) == 1  # no padding: skip the mask
        out = self.model(input_ids=batch.ids, position_ids=batch.positions,
                         attention_mask=None if single else batch.mask,
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: batch.cache},
                         **self._router_kwargs())
        if not single:
            self.batched_prefills += 1
            self.batched_cached_prefills += batch.past_width > 0
        tokens, logprobs, tops = sample(out.logits[:, -1, :], [s.sampler for s in seqs])
        elapsed = time.perf_counter() - start
        for row, seq in enumerate(seqs):
            layers = batch.row_kv(getattr(out, self._cache_kw), row)
            seq.kv = SessionKV(list(seq.prompt), layers)
            seq.length = len(seq.prompt)
            seq.cached_tokens = batch.cached[row]
            seq.prefill_s = elapsed
            # The first output token was sampled from the last prompt position's logits.
            width = batch.ids.shape[1]
            self._record_routing(seq, getattr(out, "router_logits", None),
                                 row * width + width - 1)
            self._append(seq, tokens[row], logprobs[row], tops[row])

    def _forward_decode(self, batch: DecodeBatch[_Seq]) -> tuple[torch.Tensor, Any]:
        """The next-token logits of each row, and the MoE router logits (None if dense)."""
        last = torch.tensor([[s.output[-1]] for s in batch.seqs], device=self.device)
        positions = torch.tensor([[s.length] for s in batch.seqs], device=self.device)
        mask = batch.attention_mask(self.device)
        out = self.model(input_ids=last, position_ids=positions, attention_mask=mask,
                         use_cache=True, **{self._cache_kw: batch.cache},
                         **self._router_kwargs())
        batch.width += 1
        self.decode_steps += 1
        self.max_batch_seen = max(self.max_batch_seen, len(batch.seqs))
        return out.logits[:, -1, :], getattr(out, "router_logits", None)

    def _router_kwargs(self) -> dict[str, Any]:
        return {"output_router_logits": True} if self.moe_top_k else {}

    def _record_routing(self, seq: _Seq, router_logits: Any, index: int) -> None:
        """Append the experts each MoE layer chose at flat position ``index`` of the forward
        (row-major over batch and positions, as the router logits are laid out): the top-k of
        the router's logits, which is the selection of softmax-then-top-k routers (Qwen-MoE,
        Mixtral); a router that adds a bias before choosing (DeepSeek-V3) is not covered."""
        if not self.moe_top_k or not router_logits:
            return
        layers = [layer[index] for layer in router_logits]
        chosen = torch.stack(layers).topk(self.moe_top_k, dim=-1).indices  # [layers, k]
        seq.routed.extend(int(e) for e in chosen.flatten().tolist())
        seq.routed_layers = len(layers)

    def _append(self, seq: _Seq, token: int, logprob: float, top: TopLogprobs) -> None:
        if seq.sampler.top_logprobs:
            seq.tops.append(top)  # first: a streamer reads output, then tops, up to both
        seq.output.append(token)
        seq.logprobs.append(logprob)
        if token in seq.stop_ids or self._hits_stop_string(seq):
            seq.finish = "stop"
        elif len(seq.output) >= seq.max_tokens:
            seq.finish = "length"

    def _hits_stop_string(self, seq: _Seq) -> bool:
        stops = seq.request.sampling.stop
        if not stops:
            return False
        # Decode only the tail: enough tokens to contain the longest stop string.
        tail = self._tokenizer.decode(seq.output[-(max(map(len, stops)) + 4):])
        return any(s in tail for s in stops)

    def _retire(self, seq: _Seq) -> None:
        """Move a finished sequence's KV (prompt + output[:-1]) back into the session store.

        Its batch row is dropped at the next step's rebuild (one re-pad per membership change).
        """
        if seq.retired:
            return
        seq.retired = True
        if self._batch is not None and seq in self._batch.seqs:
            layers = self._batch.extract(seq)
        elif seq.kv is not None:
            layers = seq.kv.layers
        else:
            return
        seq.kv = None
        tokens = (seq.prompt + seq.output)[:seq.length]
        if not seq.released:
            self.kv_store.checkin(seq.session_id, SessionKV(tokens, layers))
        self.turn_stats.append(TurnStats(seq.session_id, seq.cached_tokens,
                                         len(seq.prompt) - seq.cached_tokens, seq.prefill_s,
                                         len(seq.output)))

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.model.config, getattr(self.model, "generation_config", None)):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        if self._tokenizer.eos_token_id is not None:
            ids.add(int(self._tokenizer.eos_token_id))
        return ids


def _routing(routed: list[int], top_k: int, layers: int) -> dict[str, Any]:
    """A streamed piece's routing fields: its tokens' experts, or none at all."""
    if not routed:
        return {}
    return {"routed_experts": list(routed), "routed_expert_top_k": top_k,
            "routed_expert_layers": layers}
