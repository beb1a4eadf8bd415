"""Dashboard slots per tenant: live pages capped per identity with the admin's reserved,
unread streams closed, sessions capped per identity, and an open dashboard only where its
bind and its Host check say so."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request

from rollout.runtime.handler import HandlerRegistry
from rollout.server.app import Server
from rollout.server.dashboard import Dashboard, live
from rollout.server.dashboard.sessions import MAX_SESSIONS_PER_IDENTITY, Sessions
from rollout.server.startup import StartupError
from rollout.server.tenancy.auth import OPERATOR, Authenticator, Principal
from tests.client.conftest import _no_sandbox, make_config
from tests.server.dashboard.conftest import live_endpoint, open_live

pytestmark = pytest.mark.timeout(90)
ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789"
CLIENTS = [{"client_id": "alice", "token": ALICE}, {"client_id": "bob", "token": BOB},
           {"client_id": "ops", "token": "ops-token-0123456789", "roles": ["admin"]}]


def test_live_pages_are_capped_per_identity_with_the_admins_reserved() -> None:
    hub = live.Hub()
    alice = [live.Watcher(hub, Principal("alice")) for _ in range(live.MAX_WATCHERS)]
    taken = [w for w in alice if hub.add(w)]
    assert len(taken) == live.MAX_WATCHERS_PER_IDENTITY
    assert "already have" in hub.refusal(alice[-1])
    assert hub.add(live.Watcher(hub, Principal("bob")))  # another tenant still gets one
    n = 0
    while hub.add(live.Watcher(hub, Principal(f"t{n // live.MAX_WATCHERS_PER_IDENTITY}"))):
        n += 1
    assert hub.count == live.MAX_WATCHERS - live.ADMIN_RESERVED
    assert hub.add(live.Watcher(hub, Principal("ops", frozenset({"admin"}))))
    assert hub.add(live.Watcher(hub, OPERATOR))


async def _open_live(port: int, token: str) -> tuple[int, asyncio.StreamReader,
                                                     asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET /live/overview HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                 f"Authorization: Bearer {token}\r\n\r\n".encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
    return int(head.split(b" ", 2)[1]), reader, writer


async def test_one_tenants_unread_live_pages_leave_another_tenants_page_served(
        tmp_path: Path) -> None:
    server = await Server(make_config(tmp_path / "state", dashboard_port=0,
                                      clients=json.dumps(CLIENTS)),
                          registry=HandlerRegistry(), sandbox_factory=_no_sandbox).start()
    held: list[Any] = []
    try:
        assert server.dashboard is not None
        port = server.dashboard.port
        statuses = []
        for _ in range(live.MAX_WATCHERS + 6):  # Alice opens pages and never reads them
            status, reader, writer = await _open_live(port, ALICE)
            statuses.append(status)
            held.append(writer)
        assert statuses.count(200) == live.MAX_WATCHERS_PER_IDENTITY
        assert set(statuses) == {200, 503}
        status, reader, writer = await _open_live(port, BOB)
        held.append(writer)
        assert status == 200
        first = await asyncio.wait_for(reader.readuntil(b"\n\n"), 20)
        assert b"event: parts" in first
    finally:
        for w in held:
            w.close()
        await server.stop(0.2)


def test_sessions_are_capped_per_identity_so_one_tenant_evicts_only_its_own() -> None:
    sessions = Sessions(Authenticator("", CLIENTS), "127.0.0.1", secure=False)
    bob = sessions.start(Principal("bob"))
    alice = [sessions.start(Principal("alice")) for _ in range(1030)]

    def who(sid: str) -> Any:
        request = make_mocked_request("GET", "/", headers={"Cookie": f"rollout_dashboard={sid}"})
        return sessions.principal(request)

    assert who(bob) == Principal("bob")
    assert who(alice[-1]) == Principal("alice")
    assert who(alice[0]) is None  # Alice's own oldest went
    assert len(sessions._sessions) == MAX_SESSIONS_PER_IDENTITY + 1


@pytest.mark.parametrize("bound, host, allowed", [
    ("127.0.0.1", "127.0.0.1:8080", True), ("127.0.0.1", "localhost:8080", True),
    ("127.0.0.1", "rebind.evil.example", False), ("10.1.2.3", "10.1.2.3:8080", True),
    ("10.1.2.3", "127.0.0.1:8080", False), ("10.1.2.3", "localhost", False),
    ("0.0.0.0", "192.168.0.7:8080", True), ("0.0.0.0", "rebind.evil.example:8080", False),
    ("::1", "[::1]:8080", True)])
def test_the_host_check_compares_with_what_the_dashboard_is_bound_to(
        bound: str, host: str, allowed: bool) -> None:
    sessions = Sessions(Authenticator(), bound, secure=False)
    assert sessions.host_allowed(make_mocked_request("GET", "/", headers={"Host": host})) \
        is allowed


async def test_an_open_dashboard_on_a_non_loopback_address_is_refused_unless_allowed() -> None:
    scheduler: Any = SimpleNamespace(delivery=SimpleNamespace(observe=None), store=None)
    with pytest.raises(StartupError) as info:
        await Dashboard(scheduler, Authenticator()).start("0.0.0.0", 0)
    assert "dashboard_allow_open" in str(info.value)
    with pytest.raises(StartupError):
        await Dashboard(scheduler, Authenticator()).start("192.0.2.1", 0)
    dash = Dashboard(scheduler, Authenticator("tok-0123456789abcdef"))
    assert dash._authenticator.enabled  # with credentials: allowed (nothing happens here)
    opened = Dashboard(scheduler, Authenticator(), allow_open=True)
    try:
        await opened.start("0.0.0.0", 0)
        assert opened.port
    finally:
        await opened.stop()


async def test_a_stream_nobody_reads_gives_its_slot_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only keep-alives go out (nothing changes), the browser reads nothing, and its slot is
    free again after ``MAX_STREAM_S``, however much the socket's buffers still take."""
    monkeypatch.setattr(live, "KEEPALIVE_S", 0.05)
    monkeypatch.setattr(live, "MAX_STREAM_S", 1.0)
    hub = live.Hub()

    async def render(_: live.Changes) -> live.Update:
        return live.Update([])

    writers = []
    async with live_endpoint(hub, Principal("alice"), render) as port:
        try:
            for _ in range(live.MAX_WATCHERS_PER_IDENTITY):
                writers.append((await open_live(port))[1])  # then never reads
            assert hub.count == live.MAX_WATCHERS_PER_IDENTITY
            assert hub.refusal(live.Watcher(hub, Principal("alice")))
            for _ in range(100):
                if hub.count == 0:
                    break
                await asyncio.sleep(0.1)
            assert hub.count == 0, "unread streams still hold their slots"
            assert not hub.refusal(live.Watcher(hub, Principal("alice")))
        finally:
            for w in writers:
                w.close()
