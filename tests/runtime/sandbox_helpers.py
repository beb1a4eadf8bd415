"""Helpers shared by the sandbox and tool tests: a throw-away state dir, a sandbox living in
it, and a /proc probe for processes that must not outlive their sandbox."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from rollout.runtime.sandbox import Sandbox, SandboxConfig, create_sandbox


@contextlib.contextmanager
def temp_config(prefix: str) -> Iterator[SandboxConfig]:
    """A bwrap config whose state dir is a fresh directory, removed afterwards. Directly below
    /tmp on purpose: kernel ipc sockets live below it and Unix socket paths max out at 107
    bytes."""
    d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        yield SandboxConfig(state_dir=Path(d) / "state")
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.asynccontextmanager
async def temp_sandbox(prefix: str, **options: Any) -> AsyncIterator[Sandbox]:
    """A sandbox in a :func:`temp_config` state dir (``options`` go to ``create_sandbox``),
    destroyed before its directory is removed."""
    with temp_config(prefix) as cfg:
        sandbox = await create_sandbox(cfg, **options)
        try:
            yield sandbox
        finally:
            await sandbox.destroy()


def host_has(marker: str) -> bool:
    """Whether any host process's command line starts with ``marker``."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read().startswith(marker.encode()):
                        return True
            except OSError:
                continue
    return False
