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
