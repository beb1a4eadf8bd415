"""The model gateway: one HTTP app per job lease on its own Unix socket, plus an optional TCP
listener for harnesses outside sandboxes.

A lease's key is a capability: 32 random bytes, compared in constant time, valid on that
lease's socket only (another job's key is refused there) and on the TCP listener (where the
key alone selects the job), and refused everywhere once the lease is closed. Closing a lease
cancels its in-flight requests (which aborts their generation in the backend pool), removes its
socket, and returns what it captured.

Socket files live in ``<state dir>/gateway/`` (mode 0700, sockets 0600); a state directory
whose path is too long for a Unix socket address falls back to a private directory under the
system's temporary directory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from aiohttp import web

from rollout.runtime.gateway import GatewayLease, GatewayOptions, HarnessCapture
from rollout.runtime.llm import LLMClient
from rollout.runtime.types import JobSpec
from rollout.server.gateway.conversation import JobConversation
from rollout.server.gateway.messages import RequestLimits
from rollout.server.gateway.routes import LeaseResources, build_app

log = logging.getLogger(__name__)

MAX_SOCKET_PATH = 100
"""``sun_path`` holds 108 bytes on Linux (104 on macOS); leave room for the terminator."""
KEY_PREFIX = "rk-"


class Gateway:
    """Implements :class:`rollout.runtime.gateway.ModelGateway` over aiohttp."""

    def __init__(self, state_dir: str | Path, *, limits: RequestLimits | None = None,
                 tcp_host: str = "127.0.0.1", tcp_port: int | None = None) -> None:
        self.limits = limits or RequestLimits()
        self._state_dir = Path(state_dir)
        self._root: Path | None = None
        self._own_root = False
        self._leases: dict[str, LeaseResources] = {}
        self.tcp_host = tcp_host
        self.tcp_port = tcp_port
        """``None``: no TCP listener; 0 picks a free port (read it back after :meth:`start`)."""
        self._tcp: web.AppRunner | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> Gateway:
        if self.tcp_port is not None and self._tcp is None:
            runner = web.AppRunner(build_app(self._leases.get, self.limits), access_log=None,
                                   handler_cancellation=True)
            await runner.setup()
            site = web.TCPSite(runner, self.tcp_host, self.tcp_port)
            await site.start()
            self._tcp = runner
            server = getattr(site, "_server", None)
            sockets = getattr(server, "sockets", None) or []
            if sockets:
                self.tcp_port = int(sockets[0].getsockname()[1])
        return self

    async def stop(self) -> None:
        for lease in list(self._leases.values()):
            await self._close(lease)
        if self._tcp is not None:
            await self._tcp.cleanup()
            self._tcp = None
        if self._own_root and self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)

    @property
    def base_url(self) -> str:
        """``http://host:port/v1`` of the TCP listener ("" when there is none)."""
        return f"http://{self.tcp_host}:{self.tcp_port}/v1" if self._tcp is not None else ""

    # ------------------------------------------------------------------ ModelGateway
    async def open(self, spec: JobSpec, llm: LLMClient, *, options: GatewayOptions | None = None,
                   deadline: float | None = None) -> GatewayLease:
        """``deadline`` (``time.monotonic()`` time): when the job's RUN ends; by default its
        ``limits.run_timeout_s`` from now."""
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        root = await asyncio.to_thread(self._socket_root)
        path = str(root / f"{secrets.token_hex(8)}.sock")
        conversation = JobConversation(spec, llm, deadline=deadline if deadline is not None
                                       else time.monotonic() + spec.limits.run_timeout_s,
                                       options=options or GatewayOptions())
        lease = LeaseResources(key, conversation, path)
        runner = web.AppRunner(build_app(lambda k: lease if _same(k, lease.key) else None,
                                         self.limits), access_log=None, handler_cancellation=True)
        await runner.setup()
        try:
            await web.UnixSite(runner, path).start()
            os.chmod(path, 0o600)
        except BaseException:
            await runner.cleanup()
            raise
        lease.runner = runner
        self._leases[key] = lease
        return GatewayLease(api_key=key, socket_path=path)

    async def release_job(self, job_id: str) -> None:
        """Close every lease of ``job_id`` still open (the job ended; its handler did not)."""
        for lease in [x for x in self._leases.values()
                      if x.conversation.spec.job_id == job_id]:
            await self._close(lease)

    def capture(self, lease: GatewayLease) -> HarnessCapture:
        found = self._leases.get(lease.api_key)
        if found is None:
            raise KeyError("the lease is closed or was never opened here")
        return found.conversation.capture

    async def close(self, lease: GatewayLease) -> HarnessCapture:
        found = self._leases.get(lease.api_key)
        if found is None:
            raise KeyError("the lease is closed or was never opened here")
        await self._close(found)
        return found.conversation.capture

    async def _close(self, lease: LeaseResources) -> None:
        self._leases.pop(lease.key, None)
        await lease.close()

    def _socket_root(self) -> Path:
        if self._root is None:
            root = self._state_dir / "gateway"
            if len(str(root)) + 22 > MAX_SOCKET_PATH:
                root, self._own_root = Path(tempfile.mkdtemp(prefix="rollout-gw-")), True
            root.mkdir(parents=True, exist_ok=True)
            os.chmod(root, 0o700)
            self._root = root
        return self._root


def _same(given: str, key: str) -> bool:
    return secrets.compare_digest(given.encode(), key.encode())
