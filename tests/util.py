"""Small helpers shared by tests.

Every fixed wait here is stretched by :func:`patience`: the runnable processes per core at the
moment (capped at 6), times ``ROLLOUT_TIMEOUT_SCALE`` (``rollout.runtime.timeouts``, the same
factor the IPython kernel start uses). These waits only detect something that
never happens; a busy machine gets more time instead of a failure.
"""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rollout.runtime.timeouts import scaled, timeout_scale

__all__ = ["assert_eventually", "hang_guard_factor", "patience", "scaled"]


def hang_guard_factor(load: float, cpus: int, scale: float = 1.0) -> float:
    """How much longer than on an idle 2-core machine a wait may take before it counts as
    never: runnable processes per core (at least 1, capped at 6), times ``ROLLOUT_TIMEOUT_SCALE``
    (which may also shrink it, for tests of the waits themselves).

    At load 14 a test that builds three images did its minute of work in 115 s, and importing
    torch in a child server took over 60 s: fixed waits failed where nothing was wrong.
    """
    return scale * max(1.0, min(6.0, load / max(1, cpus)))


def patience(seconds: float) -> float:
    """``seconds`` stretched by :func:`hang_guard_factor` as the machine is now."""
    return seconds * hang_guard_factor(os.getloadavg()[0], os.cpu_count() or 1,
                                       timeout_scale(os.environ))


async def assert_eventually(check: Callable[[], Any | Awaitable[Any]], timeout: float = 10.0,
                            interval: float = 0.02, message: str = "") -> Any:
    """Poll ``check`` until it returns something truthy (or stops raising AssertionError);
    ``timeout`` is stretched by :func:`patience`."""
    timeout = patience(timeout)
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


ROOT = Path(__file__).resolve().parents[1]


async def leave_sandboxes(state_dir: Path, n: int) -> None:
    """Make ``n`` sandboxes under ``state_dir`` in a process that is then SIGKILLed, so nothing
    tears them down: what a SIGKILLed server, or a teardown past its deadline, leaves."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", textwrap.dedent("""
            import asyncio, sys
            from pathlib import Path
            from rollout.runtime.sandbox import SandboxConfig, create_sandbox
            async def main():
                cfg = SandboxConfig(state_dir=Path(sys.argv[1]))
                boxes = [await create_sandbox(cfg) for _ in range(int(sys.argv[2]))]
                print("ready", flush=True)
                await asyncio.sleep(300)
            asyncio.run(main())
        """), str(state_dir), str(n), stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])})
    assert child.stdout is not None
    assert (await child.stdout.readline()).strip() == b"ready"
    child.kill()
    await child.wait()


def mounts_below(path: Path) -> list[str]:
    """Mount points below ``path`` in this process's mount namespace."""
    prefix = os.path.realpath(path) + "/"
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(prefix)]
