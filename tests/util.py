"""Small helpers shared by tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def assert_eventually(check: Callable[[], Any | Awaitable[Any]], timeout: float = 10.0,
                            interval: float = 0.02, message: str = "") -> Any:
    """Poll ``check`` until it returns something truthy (or stops raising AssertionError)."""
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
            raise AssertionError(message or f"condition not met within {timeout}s") from last
        await asyncio.sleep(interval)
