"""The gateway bounds connections, not only requests: a harness that floods its own socket
with thousands of half-sent requests, or a local process that floods the TCP port without a
key, leaves other jobs' gateway calls answered, the process's descriptors free for the rest
of the server, and the log quiet."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
from pathlib import Path

import pytest

from tests.util import assert_eventually, patience

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[3]
NOFILE = 1024
FLOOD = 3000


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _chat(socket_path: str, key: str, text: str) -> int:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(socket_path), 10)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer "
                 + key.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    return int(data.split(b" ", 2)[1])


def _flood(family: int, address: object, count: int, first_bytes: bytes) -> list[socket.socket]:
    """Open ``count`` connections that send ``first_bytes`` (half a request) and wait."""
    held = []
    for _ in range(count):
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.connect(address)
            if first_bytes:
                s.send(first_bytes)
        except OSError:
            s.close()
            continue
        held.append(s)
    return held


async def test_a_connection_flood_leaves_other_jobs_answered_and_the_log_quiet(
        tmp_path: Path) -> None:
    log = (tmp_path / "gateway.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.server.gateway.serve_one_lease", "2", str(NOFILE), "1",
        cwd=ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log)
    assert proc.stdout is not None and proc.stdin is not None
    held: list[socket.socket] = []
    try:
        leases = [(await asyncio.wait_for(proc.stdout.readline(), patience(60))).decode().split()
                  for _ in range(2)]
        tcp_port = int(await asyncio.wait_for(proc.stdout.readline(), patience(10)))
        (hostile, hostile_key), (good, good_key) = leases
        assert await _chat(good, good_key, "hello") == 200
        # Requests whose body the client cuts off: no traceback each.
        cut = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer " \
            + hostile_key.encode() + b"\r\nContent-Length: 999\r\n\r\n{\"messages\": "
        for s in await asyncio.to_thread(_flood, socket.AF_UNIX, hostile, 6, cut):
            await asyncio.sleep(0.2)  # its handler is reading the body when the client goes
            s.close()
        base = _fds(proc.pid)
        half = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 99"
        held += await asyncio.to_thread(_flood, socket.AF_UNIX, hostile, FLOOD, half)
        held += await asyncio.to_thread(_flood, socket.AF_INET, ("127.0.0.1", tcp_port),
                                        FLOOD // 3, b"")
        # Another job's calls are answered while the flood is held open ...
        for i in range(5):
            assert await _chat(good, good_key, f"turn {i}") == 200
        # ... and the flood holds a bounded number of the server's descriptors.
        assert _fds(proc.pid) - base <= 32 + 256 + 16
        # Half-sent requests and key-less TCP connections are dropped after their deadlines.
        await assert_eventually(lambda: _fds(proc.pid) - base <= 8, timeout=60)
        assert await _chat(good, good_key, "still there?") == 200
    finally:
        for s in held:
            with contextlib.suppress(OSError):
                s.close()
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 20)
        except TimeoutError:
            proc.kill()
        log.close()
    lines = (tmp_path / "gateway.log").read_text().splitlines()
    assert len(lines) < 40, "\n".join(lines[:40])
    assert not any("Traceback" in line for line in lines), "\n".join(lines[:40])


async def test_failed_accepts_are_logged_once_per_interval_with_a_count(
        caplog: pytest.LogCaptureFixture) -> None:
    from rollout.server.gateway import connections

    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    seen: list[str] = []
    loop.set_exception_handler(lambda lp, ctx: seen.append(str(ctx.get("message"))))
    try:
        connections.quiet_accept_errors(loop)
        caplog.set_level(logging.WARNING, logger="rollout.server.gateway.connections")
        for _ in range(1000):
            loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                         "exception": OSError(24, "Too many open files")})
        loop.call_exception_handler({"message": "something else"})
    finally:
        loop.set_exception_handler(previous)
    lines = [r.getMessage() for r in caplog.records if "accept" in r.getMessage()]
    assert len(lines) <= 1
    assert seen == ["something else"]  # every other report still goes where it went
