"""Helpers for the harness environment's tests: a driver that runs a harness job's three stages
with a model gateway, and a stand-in gateway for the tests that check only the sandbox's way to
it (the network ones), which answer a fixed reply and record nothing."""

from __future__ import annotations

import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from rollout.runtime.gateway import GatewayLease, HarnessCapture
from rollout.runtime.llm import LLMClient
from rollout.runtime.types import JobSpec

PING_REPLY = {"object": "list", "data": [{"id": "relay-ok", "object": "model"}]}


@dataclass
class PingGateway:
    """TEST DOUBLE of the gateway's transport only: one Unix socket per lease that answers
    ``GET /v1/models`` for the lease's key (401 otherwise). No model behind it."""

    leases: dict[str, tuple[web.AppRunner, str]] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)

    async def open(self, spec: JobSpec, llm: LLMClient) -> GatewayLease:
        key = secrets.token_hex(16)

        async def models(request: web.Request) -> web.Response:
            self.seen.append(request.headers.get("Authorization", ""))
            if request.headers.get("Authorization") != f"Bearer {key}":
                return web.json_response({"error": "bad key"}, status=401)
            return web.json_response(PING_REPLY)

        app = web.Application()
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        path = str(Path(tempfile.mkdtemp(prefix="gw-", dir="/tmp")) / "s")
        await web.UnixSite(runner, path).start()
        self.leases[key] = (runner, path)
        return GatewayLease(api_key=key, socket_path=path)

    async def close(self, lease: GatewayLease) -> HarnessCapture:
        runner, path = self.leases.pop(lease.api_key)
        await runner.cleanup()
        Path(path).unlink(missing_ok=True)
        Path(path).parent.rmdir()
        return HarnessCapture(requests=len(self.seen))


def harness_task(inner: str, task: dict[str, Any], harness: Any, **extra: Any) -> dict[str, Any]:
    return {"environment": inner, "task": task, "harness": harness, **extra}
