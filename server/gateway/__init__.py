"""The model gateway: OpenAI / Anthropic-compatible HTTP endpoints that capture a harness's
exact token ids (see ``service.py`` and docs/model-gateway.md)."""

from rollout.server.gateway.service import Gateway

__all__ = ["Gateway"]
