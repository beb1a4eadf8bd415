"""A real Rollout Service in-process on a free port, with scripted test environments.

The server is the production ``server.app.Server`` (interceptors, servicer, scheduler, SQLite
store) with ``llm.backends = []``; only the environments are test doubles
(``tests/server/handlers.py``), so client tests exercise the real wire protocol.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.handler import HandlerRegistry
from rollout.server.app import Server
from rollout.server.config import Config, load_config
from tests.server.handlers import ScriptedHandler


async def _no_sandbox(**options: Any) -> Any:
    raise RuntimeError("client tests run no sandboxes")


def make_config(state_dir: Path, port: int = 0, **server: Any) -> Config:
    overrides = [f"server.port={port}", f"server.state_dir={state_dir}",
                 "server.grace_s=0.2", "server.heartbeat_s=0.2", "llm.backends=[]",
                 "pipeline.init_workers=4", "pipeline.run_workers=4",
                 "pipeline.eval_workers=4"]
    overrides += [f"server.{k}={v}" for k, v in server.items()]
    return load_config(None, overrides, environ={})


class ServerHarness:
    """Starts, stops and restarts one server on one state directory (and one port)."""

    def __init__(self, state_dir: Path, **server: Any) -> None:
        self.state_dir = state_dir
        self.server_opts = server
        self.handler = ScriptedHandler()
        self.registry = HandlerRegistry()
        self.registry.register("scripted", self.handler)
        self.server: Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> Server:
        cfg = make_config(self.state_dir, self.port, **self.server_opts)
        self.server = await Server(cfg, registry=self.registry,
                                   sandbox_factory=_no_sandbox).start()
        self.port = self.server.port
        return self.server

    async def stop(self, grace_s: float = 0.1) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
            self.server = None

    async def restart(self) -> Server:
        await self.stop()
        self.handler = ScriptedHandler()  # a fresh process would have fresh handlers
        self.registry.register("scripted", self.handler)
        return await self.start()


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[ServerHarness]:
    h = ServerHarness(tmp_path / "state")
    await h.start()
    yield h
    await h.stop()


@pytest.fixture
async def make_harness(tmp_path: Path) -> AsyncIterator[Callable[..., ServerHarness]]:
    """Harnesses with non-default server settings (tokens, message limits); not started."""
    made: list[ServerHarness] = []

    def make(**server: Any) -> ServerHarness:
        h = ServerHarness(tmp_path / f"state{len(made)}", **server)
        made.append(h)
        return h

    yield make
    for h in made:
        await h.stop()




def task(**fields: Any) -> dict[str, Any]:
    """A job dict for the scripted environment."""
    return {"environment": "scripted", "task": fields or {"reward": 1.0}}


class ThreadedServer:
    """A harness on its own event loop thread, for code that runs ``asyncio.run`` itself
    (the command line, the sync client)."""

    def __init__(self, state_dir: Path, **server: Any) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.harness = ServerHarness(state_dir, **server)
        self.call(self.harness.start())

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(20)

    @property
    def address(self) -> str:
        return self.harness.address

    def open_gate(self, job_id: str, stage: str) -> None:
        self.loop.call_soon_threadsafe(self.harness.handler.open, job_id, stage)

    def stop(self) -> None:
        self.call(self.harness.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        # An event loop holds an epoll fd and a self-pipe until closed: one per test piled up
        # to "Too many open files" over the whole suite.
        if not self._thread.is_alive():
            self.loop.close()


@pytest.fixture
def threaded_server(tmp_path: Path) -> Iterator[ThreadedServer]:
    srv = ThreadedServer(tmp_path / "state")
    yield srv
    srv.stop()
