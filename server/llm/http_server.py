"""``rollout llm-serve``: the in-process engine behind the subset of vLLM's HTTP API we use.

It makes the vLLM path (:class:`~rollout.server.llm.http_engine.HttpEngine`, the pool, weight
coordination) run end to end on a machine with no GPU and no vLLM. Routes, with vLLM's shapes:

- ``POST /inference/v1/generate`` — tokens in, ``choices[0].token_ids`` + logprobs out
  (``logprobs.content[i].{token_id, logprob}``, vLLM's ``output_mode="tokens"`` shape).
  ``sampling_params.logprobs: k`` adds ``top_logprobs`` as vLLM lists them: the sampled token
  first, then the most likely ones, ``max(k, 1)`` entries in all; ``-inf`` is sent as ``-9999.0``
  (JSON has no infinity), as vLLM does.
- ``POST /v1/completions`` — ``prompt`` as token ids (or text, tokenized here);
  ``return_tokens_as_token_ids`` / ``return_token_ids`` honoured.
- Both stream with ``"stream": true`` as vLLM does: server-sent events, one ``data: {...}`` chunk
  per decode step carrying that step's ``token_ids`` and logprobs (``finish_reason`` set on the
  last), then ``data: [DONE]``. A client that disconnects aborts the turn.
- Logprobs: ``--logprobs-mode processed_logprobs`` (default: under the distribution sampled from,
  as vLLM's flag of that name) or ``raw_logprobs``; the ``X-Rollout-Logprobs-Mode: processed|raw``
  header overrides it per request (vLLM has only the server flag). Every reply says which it
  carries in ``logprobs_mode``.
- Routed experts (an MoE model): every reply that ends a turn carries ``choices[0].
  routed_experts`` as vLLM does with ``enable_return_routed_experts`` (base64 ``.npy`` of shape
  ``(prompt + output - 1 - start, layers, k)``, row ``p`` the experts position ``p`` was routed
  to; ``start`` is vLLM's ``routed_experts_prompt_start``, default 0). A stream sends it with its
  last chunk only, for the whole turn, as vLLM does. One difference: this server routes only
  the positions that produced output tokens (the prompt's KV may be cached from an earlier
  turn), so the prompt's rows before ``prompt - 1`` hold -1; ask with
  ``routed_experts_prompt_start = prompt - 1`` for exactly the output's rows. A dense model's
  replies carry none.
- ``GET /health``, ``GET /v1/models``, ``POST /pause``, ``POST /resume``, ``GET /is_paused``.
- Extensions (not in vLLM): ``POST /update_weights`` ``{"path", "version"}`` hot-swaps a
  checkpoint; every reply carries ``policy_version``; the ``X-Rollout-Session`` header names the
  trajectory so its KV cache is kept between turns (vLLM uses prefix caching instead);
  ``POST /rollout/v1/release_session`` ``{"session_id"}`` drops that KV when the trajectory ends
  (vLLM answers 404, which :class:`~rollout.server.llm.http_engine.HttpEngine` tolerates).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from rollout.runtime.llm import GenerateRequest, GenerateResult
from rollout.runtime.types import InvalidArgument, SamplingParams
from rollout.server.llm.engine import EngineError
from rollout.server.llm.http_engine import LOGPROBS_HEADER, RELEASE_PATH, SESSION_HEADER
from rollout.server.llm.transformers_engine import TransformersEngine

log = logging.getLogger(__name__)
ENGINE_KEY = web.AppKey("engine", TransformersEngine)
MODEL_KEY = web.AppKey("model_name", str)
MODE_KEY = web.AppKey("logprobs_mode", str)
SERVER_MODES = {"processed_logprobs": "processed", "raw_logprobs": "raw",
                "processed": "processed", "raw": "raw"}
"""vLLM's ``--logprobs-mode`` names (and our short ones) -> ``SamplingParams.logprobs_mode``."""


def build_app(engine: TransformersEngine, model_name: str,
              logprobs_mode: str = "processed") -> web.Application:
    app = web.Application(client_max_size=64 * 2**20)
    app[ENGINE_KEY] = engine
    app[MODEL_KEY] = model_name
    app[MODE_KEY] = SERVER_MODES[logprobs_mode]
    app.add_routes([
        web.get("/health", _health), web.get("/v1/models", _models),
        web.post("/inference/v1/generate", _generate), web.post("/v1/completions", _completions),
        web.post("/pause", _pause), web.post("/resume", _resume), web.get("/is_paused", _is_paused),
        web.post("/update_weights", _update_weights),
        web.post(RELEASE_PATH, _release_session),
    ])
    return app


def _error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                             status=status)


async def _health(request: web.Request) -> web.Response:
    ok = await request.app[ENGINE_KEY].health()
    return web.Response(status=200 if ok else 503)


async def _models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response({"object": "list", "data": [{
        "id": request.app[MODEL_KEY], "object": "model", "owned_by": "rollout",
        "max_model_len": engine.max_context}]})


def _sampling(params: dict[str, Any], logprobs_mode: str
              ) -> tuple[SamplingParams, int, int | None]:
    try:
        top_k = int(params.get("top_k", 0) or 0)
        sampling = SamplingParams(
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=0 if top_k == -1 else top_k,
            stop=tuple(params.get("stop") or ()) if not isinstance(params.get("stop"), str)
            else (params["stop"],),
            stop_token_ids=tuple(int(t) for t in params.get("stop_token_ids") or ()),
            logprobs_mode=logprobs_mode,
        )
        max_tokens = int(params.get("max_tokens", 16))
        seed = params.get("seed")
        return sampling, max_tokens, None if seed is None else int(seed)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"bad sampling parameter: {exc}") from exc


def _mode(request: web.Request) -> str:
    asked = request.headers.get(LOGPROBS_HEADER)
    if asked is None:
        return request.app[MODE_KEY]
    if asked not in ("processed", "raw"):
        raise InvalidArgument(f"{LOGPROBS_HEADER} must be 'processed' or 'raw', got {asked!r}")
    return asked


def _turn(request: web.Request, prompt: list[int], params: dict[str, Any]
          ) -> tuple[GenerateRequest, bool]:
    """The engine request, and whether the session is anonymous (released after the turn)."""
    sampling, max_tokens, seed = _sampling(params, _mode(request))
    session = request.headers.get(SESSION_HEADER)
    try:
        top = int(params.get("logprobs") or 0)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"bad sampling parameter: logprobs: {exc}") from exc
    return GenerateRequest(prompt, sampling, max_tokens, session or f"anon-{uuid.uuid4().hex}",
                           seed=seed, top_logprobs=top), not session


def _clamp(logprob: float) -> float:
    return max(logprob, -9999.0)


def _listed(token: int, logprob: float, top: list[tuple[int, float]]
            ) -> list[tuple[int, float]]:
    """One step's entries in vLLM's order: the sampled token, then the most likely others,
    as many as were asked (at least one)."""
    others = [(t, lp) for t, lp in top if t != token]
    return [(token, logprob), *others][:max(len(top), 1)]


async def _run(request: web.Request, prompt: list[int], params: dict[str, Any],
               ) -> tuple[Any, str | None, web.Response | None]:
    """The turn, its routed experts in vLLM's form, or the error reply."""
    engine = request.app[ENGINE_KEY]
    try:
        turn, anonymous = _turn(request, prompt, params)
        start = _routing_start(params, len(prompt))
        result = await engine.generate(turn)
        if anonymous:
            await engine.release_session(turn.session_id)
        return result, _routed_experts(result, len(prompt), start), None
    except InvalidArgument as exc:
        return None, None, _error(400, str(exc))
    except EngineError as exc:
        return None, None, _error(500, str(exc), "InternalServerError")


def _routing_start(params: dict[str, Any], prompt_len: int) -> int:
    """vLLM's ``routed_experts_prompt_start``: the first position whose routing is returned."""
    try:
        start = int(params.get("routed_experts_prompt_start") or 0)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"bad sampling parameter: routed_experts_prompt_start: {exc}",
                              field="routed_experts_prompt_start") from exc
    if not 0 <= start <= prompt_len:
        raise InvalidArgument(f"routed_experts_prompt_start must be between 0 and the prompt's "
                              f"length {prompt_len}, got {start}",
                              field="routed_experts_prompt_start")
    return start


def _routed_experts(result: GenerateResult, prompt_len: int, start: int) -> str | None:
    """A whole turn's routing in vLLM's form (see the module docstring), or None when the
    model is dense or the turn's routing is incomplete."""
    layers, k, n = result.routed_expert_layers, result.routed_expert_top_k, len(result.output_ids)
    if (not result.routed_experts or n == 0 or prompt_len < 1
            or len(result.routed_experts) != n * layers * k):
        return None
    import base64
    import io

    import numpy as np

    rows = np.full((prompt_len - 1 + n, layers, k), -1, dtype=np.int32)
    rows[prompt_len - 1:] = np.asarray(result.routed_experts, dtype=np.int32).reshape(n, layers, k)
    buf = io.BytesIO()
    np.save(buf, rows[start:], allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


Chunk = Callable[[GenerateResult, "str | None"], dict[str, Any]]
"""One reply (or streamed chunk) from a result and the turn's routed experts (None: none)."""


async def _stream(request: web.Request, prompt: list[int], params: dict[str, Any],
                  chunk: Chunk) -> web.StreamResponse:
    """Server-sent events as vLLM sends them: one ``data:`` chunk per step, then ``[DONE]``;
    the last chunk carries the whole turn's routed experts."""
    engine = request.app[ENGINE_KEY]
    try:
        turn, anonymous = _turn(request, prompt, params)
        start = _routing_start(params, len(prompt))
        steps = engine.stream(turn)
        first = await anext(steps)  # validation errors surface here, before the 200
    except InvalidArgument as exc:
        return _error(400, str(exc))
    except EngineError as exc:
        return _error(500, str(exc), "InternalServerError")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    ids: list[int] = []
    routed: list[int] = []
    try:
        delta: GenerateResult | None = first
        while delta is not None:
            ids.extend(delta.output_ids)
            routed.extend(delta.routed_experts)
            whole = None
            if delta.finish_reason and routed:
                whole = _routed_experts(dataclasses.replace(
                    delta, output_ids=ids, routed_experts=routed), len(prompt), start)
            await response.write(f"data: {json.dumps(chunk(delta, whole))}\n\n".encode())
            delta = None if delta.finish_reason else await anext(steps, None)
    except EngineError as exc:
        error = {"error": {"message": str(exc), "type": "InternalServerError", "code": 500}}
        await response.write(f"data: {json.dumps(error)}\n\n".encode())
    finally:
        await steps.aclose()
    if anonymous:
        await engine.release_session(turn.session_id)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _generate_choice(result: GenerateResult, with_logprobs: bool,
                     routed: str | None) -> dict[str, Any]:
    tops = result.top_logprobs or [[] for _ in result.output_ids]
    content = [{"token_id": t, "token": f"token_id:{t}", "logprob": _clamp(lp),
                "top_logprobs": [{"token_id": o, "logprob": _clamp(v)}
                                 for o, v in _listed(t, lp, top)] if top else []}
               for t, lp, top in zip(result.output_ids, result.logprobs, tops, strict=True)]
    return {"index": 0, "token_ids": result.output_ids,
            "finish_reason": result.finish_reason or None,
            "logprobs": {"content": content} if with_logprobs else None,
            "routed_experts": routed}


async def _generate(request: web.Request) -> web.StreamResponse:
    body = await _json(request)
    if body is None or not isinstance(body.get("token_ids"), list):
        return _error(400, "body must be a JSON object with token_ids (a list of ints)")
    params = body.get("sampling_params") or {}
    prompt = [int(t) for t in body["token_ids"]]
    request_id = body.get("request_id") or uuid.uuid4().hex
    with_logprobs = params.get("logprobs") is not None
    if body.get("stream"):
        return await _stream(request, prompt, params, lambda delta, routed: {
            "request_id": request_id,
            "choices": [_generate_choice(delta, with_logprobs, routed)],
            "policy_version": delta.policy_version, "logprobs_mode": delta.logprobs_kind})
    result, routed, error = await _run(request, prompt, params)
    if error is not None:
        return error
    return web.json_response({
        "request_id": request_id, "choices": [_generate_choice(result, with_logprobs, routed)],
        "policy_version": result.policy_version, "logprobs_mode": result.logprobs_kind,
    })


def _completion_choice(engine: TransformersEngine, body: dict[str, Any],
                       result: GenerateResult, routed: str | None) -> dict[str, Any]:
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    tokens = [f"token_id:{t}" if as_ids else engine.tokenizer.decode([t])
              for t in result.output_ids]
    tops = None
    if result.top_logprobs:
        tops = [{(f"token_id:{o}" if as_ids else engine.tokenizer.decode([o])): _clamp(v)
                 for o, v in _listed(t, lp, top)}
                for t, lp, top in zip(result.output_ids, result.logprobs, result.top_logprobs,
                                      strict=True)]
    choice: dict[str, Any] = {
        "index": 0, "text": engine.tokenizer.decode(result.output_ids),
        "finish_reason": result.finish_reason or None,
        "logprobs": {"tokens": tokens, "token_logprobs": [_clamp(v) for v in result.logprobs],
                     "top_logprobs": tops, "text_offset": []}
        if body.get("logprobs") is not None else None,
        "routed_experts": routed}
    if body.get("return_token_ids"):
        choice["token_ids"] = result.output_ids
    return choice


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await _json(request)
    if body is None or "prompt" not in body:
        return _error(400, "body must be a JSON object with a prompt")
    prompt = body["prompt"]
    engine = request.app[ENGINE_KEY]
    if isinstance(prompt, str):
        prompt = engine.tokenizer.encode(prompt, add_special_tokens=False)
    if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
        return _error(400, "prompt must be a string or a list of token ids")
    completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": completion_id, "object": "text_completion", "created": created,
            "model": request.app[MODEL_KEY]}
    if body.get("stream"):
        return await _stream(request, prompt, body, lambda delta, routed: {
            **head, "choices": [_completion_choice(engine, body, delta, routed)],
            "policy_version": delta.policy_version, "logprobs_mode": delta.logprobs_kind})
    result, routed, error = await _run(request, prompt, body)
    if error is not None:
        return error
    return web.json_response({
        **head, "choices": [_completion_choice(engine, body, result, routed)],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(result.output_ids),
                  "total_tokens": len(prompt) + len(result.output_ids)},
        "policy_version": result.policy_version, "logprobs_mode": result.logprobs_kind,
    })


async def _pause(request: web.Request) -> web.Response:
    mode = request.query.get("mode", "wait")
    wait = mode == "wait" or request.query.get("wait_for_inflight_requests") == "true"
    await request.app[ENGINE_KEY].pause(wait=wait)
    return web.json_response({"status": "paused"})


async def _resume(request: web.Request) -> web.Response:
    await request.app[ENGINE_KEY].resume()
    return web.json_response({"status": "resumed"})


async def _is_paused(request: web.Request) -> web.Response:
    return web.json_response({"is_paused": request.app[ENGINE_KEY].paused})


async def _update_weights(request: web.Request) -> web.Response:
    body = await _json(request)
    if body is None or not isinstance(body.get("path"), str) or \
            not isinstance(body.get("version"), int):
        return _error(400, "body must be {\"path\": str, \"version\": int}")
    engine = request.app[ENGINE_KEY]
    try:
        await engine.update_weights(body["path"], body["version"])
    except (OSError, ValueError) as exc:
        return _error(400, f"cannot load {body['path']}: {exc}")
    return web.json_response({"policy_version": engine.policy_version})


async def _release_session(request: web.Request) -> web.Response:
    body = await _json(request)
    if body is None or not isinstance(body.get("session_id"), str):
        return _error(400, "body must be {\"session_id\": str}")
    await request.app[ENGINE_KEY].release_session(body["session_id"])
    return web.json_response({"released": body["session_id"]})


async def _json(request: web.Request) -> dict[str, Any] | None:
    try:
        body = await request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


async def serve(engine: TransformersEngine, host: str, port: int, model_name: str,
                ready: asyncio.Future[int] | None = None,
                logprobs_mode: str = "processed") -> None:
    """Serve until cancelled; ``ready`` receives the bound port (useful with port 0)."""
    runner = web.AppRunner(build_app(engine, model_name, logprobs_mode), access_log=None,
                           handler_cancellation=True)  # a disconnect aborts the turn
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = getattr(site, "_server", None)
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    log.info("llm-serve listening on http://%s:%d (model %s)", host, bound, model_name)
    print(f"llm-serve listening on http://{host}:{bound}", flush=True)
    if ready is not None and not ready.done():
        ready.set_result(bound)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollout llm-serve", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=None,
                        help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--logprobs-mode", default="processed_logprobs",
                        choices=["processed_logprobs", "raw_logprobs"],
                        help="logprobs every reply carries unless a request's "
                        f"{LOGPROBS_HEADER} header asks otherwise (vLLM's flag of that name)")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: the cores not already busy, at least 1, "
                        "so a busy shared CPU is not oversubscribed)")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO)
    if args.model is None:
        from rollout.server.llm.smollm2 import MODEL_NAME, smollm2_dir
        model_dir, name = smollm2_dir(), MODEL_NAME
    else:
        model_dir, name = args.model, args.model
    engine = TransformersEngine(model_dir, device=args.device, name="llm-serve",
                                max_batch_size=args.max_batch_size,
                                num_threads=args.threads or None)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(engine, args.host, args.port, args.served_model_name or name,
                          logprobs_mode=args.logprobs_mode))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
