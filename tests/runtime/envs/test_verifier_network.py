"""The verifier network's host side without a sandbox: the proxy's Unix socket is where the
launch's bind would take it from, answers there, goes away afterwards, and a folder whose path
is too long for a socket address gets a short one of its own. (The relay inside a real
sandbox, the allow-list and the agent's lack of a network: test_harbor_env.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollout.runtime.envs.grading import network


class _Sandbox:
    """Records the launch; its 'command' asks the proxy for a host off the list."""

    def __init__(self) -> None:
        self.binds: list[tuple[str, str]] = []
        self.spec: dict[str, Any] = {}
        self.answer = b""
        self.handed: list[Path] = []

    def hand_over(self, paths: list[Path], user: Any = None) -> None:
        self.handed += paths

    async def exec(self, argv: list[str], **kw: Any) -> Any:
        import asyncio

        self.binds = list(kw["file_binds"])
        self.spec = json.loads(kw["stdin"])
        reader, writer = await asyncio.open_unix_connection(self.binds[0][0])
        writer.write(b"CONNECT elsewhere.test:443 HTTP/1.1\r\nHost: elsewhere.test:443\r\n\r\n")
        self.answer = await reader.read()
        writer.close()
        return "ran"


async def test_the_proxy_socket_answers_then_goes(tmp_path: Path) -> None:
    sandbox = _Sandbox()
    done = await network.exec_networked(sandbox, ["/tests/test.sh"], hosts=("pypi.org",),
                                        folder=tmp_path, timeout=10, env={"A": "1"})
    host, inside = sandbox.binds[0]
    assert Path(host).parent == tmp_path and not Path(host).exists()
    assert inside.startswith("/.rollout-proxy-") and sandbox.handed == [Path(host)]
    assert sandbox.spec["argv"] == ["/tests/test.sh"] and sandbox.spec["socket"] == inside
    assert sandbox.spec["env"]["A"] == "1"
    assert sandbox.spec["env"]["HTTPS_PROXY"] == f"http://127.0.0.1:{network.PORT}"
    assert sandbox.answer.startswith(b"HTTP/1.1 403") and b"elsewhere.test:443" in sandbox.answer
    assert b"sandbox.verifier_hosts" in sandbox.answer
    assert (done.run, done.refused) == ("ran", ("elsewhere.test:443",))


async def test_a_folder_too_long_for_a_socket_gets_a_short_one(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    sandbox = _Sandbox()
    await network.exec_networked(sandbox, ["true"], hosts=(), folder=deep, timeout=10, env={})
    host = Path(sandbox.binds[0][0])
    assert len(str(host)) <= network.MAX_SOCKET_PATH and host.parent.parent == Path("/tmp")
    assert not host.parent.exists()  # removed with its socket
    assert sandbox.answer.startswith(b"HTTP/1.1 403") and b"lists none" in sandbox.answer
    assert not any(p.name.startswith("proxy-") for p in deep.iterdir())


async def test_a_flood_of_connections_is_bounded_and_close_ends_the_rest(
        tmp_path: Path) -> None:
    # What a process of the verifier's launch could do by connecting to the bound socket
    # itself (past the relay's own bound): the proxy serves max_connections at once, closes
    # the rest unanswered, and close() ends the ones left hanging.
    import asyncio

    from rollout.runtime.sandbox.images.egress import AllowList, AllowListProxy

    proxy = AllowListProxy(AllowList(()), "test", "none", max_connections=5)
    path = tmp_path / "p.sock"
    server = await asyncio.start_unix_server(proxy.handle, path=str(path))
    conns = [await asyncio.open_unix_connection(str(path)) for _ in range(8)]
    await asyncio.sleep(0.2)

    async def ended(reader: asyncio.StreamReader) -> bool:
        try:
            return await asyncio.wait_for(reader.read(), 2) == b""
        except TimeoutError:
            return False

    assert [await ended(r) for r, _ in conns[5:]] == [True] * 3
    assert not await ended(conns[0][0])
    proxy.close()
    assert [await ended(r) for r, _ in conns[:5]] == [True] * 5
    for _, w in conns:
        w.close()
    server.close()


async def test_an_upstream_that_never_closes_is_cut_when_the_command_ends(
        tmp_path: Path) -> None:
    import asyncio

    held: list[asyncio.StreamReader] = []
    accepted = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(reader)
        accepted.set()
        await asyncio.sleep(3600)  # never answers, never closes

    upstream = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = upstream.sockets[0].getsockname()[1]
    kept: list[Any] = []

    class Tunnel(_Sandbox):
        async def exec(self, argv: list[str], **kw: Any) -> Any:
            reader, writer = await asyncio.open_unix_connection(kw["file_binds"][0][0])
            writer.write(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
            await asyncio.wait_for(accepted.wait(), 10)
            kept.append(writer)  # the command 'ends' with its tunnel still open
            return "ran"

    await network.exec_networked(Tunnel(), ["x"], hosts=(f"127.0.0.1:{port}",),
                                 folder=tmp_path, timeout=10, env={})
    # The proxy's side of the tunnel is gone: the upstream reads its end.
    assert await asyncio.wait_for(held[0].read(), 5) == b""
    upstream.close()
