"""Compatibility name: the vLLM HTTP backend lives in :mod:`rollout.server.llm.http_engine`."""

from rollout.server.llm.http_engine import HttpEngine as VLLMEngine

__all__ = ["VLLMEngine"]
