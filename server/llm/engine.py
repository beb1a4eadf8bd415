"""The engine interface every inference backend implements (in-process, vLLM HTTP, scripted).

The backend pool (``server/llm/backend_pool.py``) owns a set of engines and implements
``runtime.llm.LLMClient`` on top of them.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator
from typing import Any

from rollout.runtime.llm import GenerateRequest, GenerateResult


class EngineError(RuntimeError):
    """The backend failed this request (connection refused, 5xx, crashed). The pool retries
    the turn on another backend and may eject this one."""


class Engine(abc.ABC):
    """One inference backend."""

    name: str = ""

    @property
    @abc.abstractmethod
    def policy_version(self) -> int:
        """Version of the weights currently served."""

    @property
    def tokenizer(self) -> Any:
        """The served model's tokenizer, where the engine has one locally."""
        return None

    @abc.abstractmethod
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Generate one turn. Raises :class:`EngineError` when the backend fails."""

    async def generate_stream(self, request: GenerateRequest,
                              ) -> AsyncGenerator[GenerateResult, None]:
        """Generate one turn as it comes: pieces of new tokens, ``finish_reason=""`` on all
        but the last (see :func:`rollout.runtime.llm.stream_generate`). An engine that cannot
        stream gives its whole turn as one piece."""
        yield await self.generate(request)

    async def abort(self, session_id: str) -> None:  # noqa: B027 - optional
        """Stop the session's in-flight generation, if any (job cancelled)."""

    async def release_session(self, session_id: str) -> None:  # noqa: B027 - optional
        """Drop the session's cached state (KV cache)."""

    @abc.abstractmethod
    async def health(self) -> bool:
        """Cheap liveness probe used by the pool's health checker."""

    async def update_weights(self, source: Any, version: int) -> None:
        """Swap in new weights and serve them as ``version``."""
        raise NotImplementedError(f"{type(self).__name__} cannot update weights")

    async def close(self) -> None:  # noqa: B027 - optional
        """Release everything the engine holds."""
