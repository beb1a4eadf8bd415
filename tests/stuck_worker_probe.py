"""Run only by ``tests/test_under_load.py``: a test whose ``to_thread`` call never returns,
as a ``readline`` on a child that never answers would."""

import asyncio
import threading

never = threading.Event()


async def test_leaves_a_worker_thread_blocked() -> None:
    asyncio.get_running_loop().run_in_executor(None, never.wait)
    await asyncio.sleep(0.05)
