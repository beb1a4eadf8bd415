"""Compatibility name: the vLLM HTTP backend lives in :mod:`server.llm.http_engine`."""

from server.llm.http_engine import HttpEngine as VLLMEngine

__all__ = ["VLLMEngine"]
