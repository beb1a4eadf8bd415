"""``rollout serve --gateway-port``: the server's TCP listener, and a taken port in one line."""

from __future__ import annotations

import socket
from pathlib import Path

import aiohttp
import pytest

from rollout.server.app import Server
from tests.client.conftest import make_config
from tests.server.test_startup import _one_line, _run_serve

pytestmark = pytest.mark.timeout(120)


def test_gateway_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        code, err = _run_serve(tmp_path / "s", "--port", "0", "--gateway-port", str(port))
    assert code == 2, err
    line = _one_line(err, "FAILED_PRECONDITION PORT_IN_USE")
    assert f"127.0.0.1:{port} (the model gateway)" in line and "--gateway-port" in line


async def test_the_server_serves_its_gateway_on_loopback_with_keys(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = await Server(make_config(tmp_path / "state", gateway_port=port)).start()
    try:
        assert server.gateway.base_url == f"http://127.0.0.1:{port}/v1"
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{server.gateway.base_url}/models",
                                   headers={"Authorization": "Bearer rk-nobody"}) as r:
                assert r.status == 401
                assert (await r.json())["error"]["code"] == "invalid_api_key"
    finally:
        await server.stop(0.1)
    with socket.socket() as again:  # the listener is gone with the server
        again.bind(("127.0.0.1", port))
