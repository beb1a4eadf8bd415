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

``logprobs: 0`` asks for the sampled token's logprob only (no alternatives). vLLM V1 returns raw
model logprobs by default, like the in-process engine. ``top_k`` is sent as ``-1`` when disabled
(older vLLM rejects 0; newer accepts both). A turn's session id travels in the
``X-Rollout-Session`` header, which vLLM ignores and ``rollout llm-serve`` uses for its sticky KV.

Weight coordination: :meth:`pause` / :meth:`resume` call vLLM's ``POST /pause?mode=wait`` and
``POST /resume`` (vLLM's async-RL API, ``vllm/entrypoints/serve/rlhf/api_router.py``; v0.14
took ``wait_for_inflight_requests=true``, later versions ``mode=wait``, so both are sent; the
default ``clear_cache=true`` drops KV computed by the old weights; v0.16+ mounts these routes
only with ``VLLM_SERVER_DEV_MODE=1``, which the launcher sets); :meth:`sleep` /
:meth:`wake_up` call ``POST /sleep?level=1`` / ``POST /wake_up`` (vLLM sleep mode, needs
``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``). :meth:`update_weights` pauses, asks the
server to load a checkpoint directory through ``POST /update_weights`` (a ``rollout llm-serve``
extension; with vLLM, push weights out of band and call :meth:`set_policy_version`), and resumes.

Session end: :meth:`release_session` calls ``POST /rollout/v1/release_session``
``{"session_id"}``, a ``rollout llm-serve`` extension that drops the session's cached KV at once
instead of leaving it to LRU eviction. Real vLLM has no such route (its prefix cache is not per
session) and answers 404; the client then remembers the server lacks it and never asks again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import aiohttp

from rollout.runtime.llm import GenerateRequest, GenerateResult
from rollout.runtime.types import InvalidArgument
from rollout.server.llm.engine import Engine, EngineError

SESSION_HEADER = "X-Rollout-Session"
RELEASE_PATH = "/rollout/v1/release_session"
_ids = itertools.count()


class HttpEngine(Engine):
    """Client of one OpenAI-compatible vLLM (or ``rollout llm-serve``) server."""

    kind = "http"

    def __init__(self, url: str, model: str, *, name: str | None = None,
                 protocol: str = "generate", tokenizer: Any = None, policy_version: int = 0,
                 request_timeout_s: float = 600.0, health_timeout_s: float = 5.0) -> None:
        if protocol not in ("generate", "completions"):
            raise ValueError(f"protocol must be 'generate' or 'completions', got {protocol!r}")
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
        request.sampling.validate()
        if request.max_tokens <= 0:
            raise InvalidArgument(f"max_tokens must be > 0, got {request.max_tokens}",
                                  "INVALID_SAMPLING_PARAMS", "max_tokens")
        path, body = self._body(request)
        call = asyncio.ensure_future(
            self._post_json(path, body, {SESSION_HEADER: request.session_id}))
        self._inflight.setdefault(request.session_id, set()).add(call)
        try:
            data = await call
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # our caller was cancelled (awaiting `call` cancelled it too)
            # abort() cancelled the HTTP call; the disconnect makes the server abort the turn.
            return GenerateResult([], [], "abort", self._version, self.name)
        finally:
            self._inflight.get(request.session_id, set()).discard(call)
        return self._parse(data)

    def _body(self, request: GenerateRequest) -> tuple[str, dict[str, Any]]:
        s = request.sampling
        seed = request.seed if request.seed is not None else s.seed
        params: dict[str, Any] = {
            "max_tokens": request.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
            "top_k": s.top_k if s.top_k > 0 else -1, "stop_token_ids": list(s.stop_token_ids),
            "logprobs": 0, "skip_special_tokens": False,
        }
        if seed is not None:
            params["seed"] = seed
        if s.stop:
            params["stop"] = list(s.stop)
            params["include_stop_str_in_output"] = True
        prompt = [int(t) for t in request.prompt_ids]
        if self.protocol == "generate":
            params["detokenize"] = bool(s.stop)  # stop strings need text; token ids never do
            return "/inference/v1/generate", {
                "model": self.model, "token_ids": prompt, "sampling_params": params,
                "stream": False, "request_id": f"{request.session_id}-{next(_ids)}"}
        return "/v1/completions", {"model": self.model, "prompt": prompt, **params,
                                   "return_tokens_as_token_ids": True, "return_token_ids": True}

    def _parse(self, data: dict[str, Any]) -> GenerateResult:
        try:
            choice = data["choices"][0]
            finish = choice.get("finish_reason") or "stop"
            logprobs = choice.get("logprobs") or {}
            if self.protocol == "generate":
                ids = [int(t) for t in choice["token_ids"]]
                values = [float(c["logprob"]) for c in logprobs.get("content") or []]
            else:
                tokens = logprobs.get("tokens") or []
                ids = [int(t) for t in choice["token_ids"]] if choice.get("token_ids") \
                    is not None else [int(t.removeprefix("token_id:")) for t in tokens]
                values = [float(v) for v in logprobs.get("token_logprobs") or []]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(f"{self.name}: malformed reply ({exc!r})") from exc
        if len(values) != len(ids):
            raise EngineError(f"{self.name}: {len(ids)} tokens but {len(values)} logprobs")
        version = int(data.get("policy_version", self._version))
        return GenerateResult(ids, values, finish if finish in ("stop", "length") else "abort",
                              version, self.name)

    async def _post_json(self, path: str, body: dict[str, Any] | None,
                         headers: dict[str, str] | None = None) -> dict[str, Any]:
        try:
            async with self._http().post(self.url + path, json=body, headers=headers,
                                         timeout=self._timeout) as response:
                if response.status == 400:
                    raise InvalidArgument(f"{self.name} rejected the request: "
                                          f"{(await response.text())[:500]}",
                                          "BACKEND_REJECTED_REQUEST")
                if response.status >= 300:
                    raise EngineError(f"{self.name}: HTTP {response.status} on {path}: "
                                      f"{(await response.text())[:500]}")
                return dict(await response.json(content_type=None) or {})
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise EngineError(f"{self.name}: {path} failed: {exc!r}") from exc

    # ----------------------------------------------------------------- control
    async def abort(self, session_id: str) -> None:
        """vLLM aborts a request whose client disconnects, so closing the call is the abort.

        The turn then returns ``finish_reason="abort"`` with no tokens (a non-streaming reply
        carries nothing until it is complete).
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
