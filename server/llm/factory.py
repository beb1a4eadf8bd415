"""Build the backend pool from the ``[[llm.backends]]`` configuration.

Kept apart from the engines so that a server configured without a model never imports torch.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rollout.runtime.types import InvalidArgument
from rollout.server.config import Config
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.engine import Engine

KINDS = ("transformers", "vllm", "vllm-launch", "scripted")


def _tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _model_dir(model: str) -> Path:
    if model in ("", "smollm2", "SmolLM2-135M-Instruct"):
        from rollout.server.llm.smollm2 import smollm2_dir

        return smollm2_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise InvalidArgument(
            f"llm backend model {model!r} is neither 'smollm2' nor a checkpoint directory "
            "(no model is downloaded from a hub)", "BAD_CONFIG", "llm.backends.model")
    return path


async def build_engine(spec: dict[str, Any], index: int = 0) -> tuple[Engine, float]:
    """One engine from one ``[[llm.backends]]`` table; returns it with its pool weight."""
    kind = spec.get("kind", "transformers")
    name = spec.get("name") or f"{kind}-{index}"
    weight = float(spec.get("weight", 1.0))
    engine: Engine
    if kind == "transformers":
        from rollout.server.llm.transformers_engine import TransformersEngine

        model_dir = await asyncio.to_thread(_model_dir, str(spec.get("model", "smollm2")))
        options = {k: v for k, v in spec.items()
                   if k in ("kv_cache_budget_bytes", "max_batch_size", "num_threads",
                            "prefill_overhead_tokens")}
        # The constructor loads the weights: keep that off the event loop.
        engine = await asyncio.to_thread(
            TransformersEngine, model_dir, device=spec.get("device", "cpu"), name=name,
            **options)
    elif kind == "vllm":
        from rollout.server.llm.vllm_http import VLLMEngine

        if not spec.get("url"):
            raise InvalidArgument("a vllm backend needs url = \"http://host:port\"",
                                  "BAD_CONFIG", "llm.backends.url")
        tok_dir = spec.get("tokenizer") or spec.get("model")
        tokenizer = await asyncio.to_thread(_tokenizer, _model_dir(str(tok_dir or "smollm2")))
        mode = str(spec.get("logprobs_mode", "processed"))
        if mode not in ("processed", "raw"):
            raise InvalidArgument(
                f"llm backend logprobs_mode must be 'processed' (a vLLM started with "
                f"--logprobs-mode processed_logprobs) or 'raw' (vLLM's default), got {mode!r}",
                "BAD_CONFIG", "llm.backends.logprobs_mode")
        engine = VLLMEngine(spec["url"], model=spec.get("model", ""), tokenizer=tokenizer,
                            name=name, protocol=spec.get("protocol", "generate"),
                            logprobs_mode=mode, stream=spec.get("stream"))
    elif kind == "vllm-launch":
        from rollout.server.llm.vllm_launcher import launch_vllm_engine

        engine = await launch_vllm_engine(spec, name=name)
    elif kind == "scripted":
        from rollout.server.llm.scripted import ScriptedEngine

        tokenizer = await asyncio.to_thread(
            _tokenizer, _model_dir(str(spec.get("tokenizer", "smollm2"))))
        engine = ScriptedEngine.from_file(spec["file"], tokenizer, name=name,
                                          latency_s=float(spec.get("latency_s", 0.0)))
    else:
        raise InvalidArgument(f"unknown llm backend kind {kind!r}; use one of {KINDS}",
                              "BAD_CONFIG", "llm.backends.kind")
    return engine, weight


async def build_pool(cfg: Config) -> BackendPool:
    pool = BackendPool(health_interval_s=cfg.llm.health_interval_s)
    for i, spec in enumerate(cfg.llm.backends):
        engine, weight = await build_engine(dict(spec), i)
        pool.add(engine, weight=weight)
    await pool.start()
    return pool
