"""Small helpers shared by tests.

Every fixed wait here is stretched by ``ROLLOUT_TIMEOUT_SCALE`` (``rollout.runtime.timeouts``,
the same factor the IPython kernel start uses), so a suite run on a loaded machine gets more
time instead of failing: ``ROLLOUT_TIMEOUT_SCALE=3 pytest``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rollout.runtime.timeouts import scaled

__all__ = ["assert_eventually", "scaled"]


async def assert_eventually(check: Callable[[], Any | Awaitable[Any]], timeout: float = 10.0,
                            interval: float = 0.02, message: str = "") -> Any:
    """Poll ``check`` until it returns something truthy (or stops raising AssertionError);
    ``timeout`` is scaled by ``ROLLOUT_TIMEOUT_SCALE``."""
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            result = check()
            if asyncio.iscoroutine(result) or isinstance(result, Awaitable):
                result = await result
            if result:
                return result
            last = None
        except AssertionError as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(message or f"condition not met within {timeout:g} s") from last
        await asyncio.sleep(interval)
