"""One request's memory is bounded by the tokens the job has room for, not by its bytes: a
chat body just under the 8 MiB cap is refused before it is tokenized, in a real gateway
process whose peak RSS is read from /proc."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from tests.util import patience

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[3]


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def _post(socket_path: str, key: str, body: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_unix_connection(socket_path)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer "
                 + key.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 60)
    writer.close()
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


def _chat(text: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


async def test_an_8_mib_request_adds_under_50_mb_and_is_refused_before_tokenizing() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.server.gateway.serve_one_lease", cwd=ROOT,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), patience(60))).decode().split()
        socket_path, key = line
        status, _ = await _post(socket_path, key, _chat("add 2 and 3"))  # warm every path
        assert status == 200
        before = _peak_rss(proc.pid)
        words = "lorem ipsum dolor sit amet, consectetur adipiscing elit " * 150_000
        body = _chat(words[:8 * 1024 * 1024 - 200])
        assert 8_000_000 < len(body) < 8 * 1024 * 1024
        status, answer = await _post(socket_path, key, body)
        assert status == 400, answer[:300]
        assert json.loads(answer)["error"]["code"] == "context_length_exceeded"
        grown = _peak_rss(proc.pid) - before
        assert grown < 50 * 1024 * 1024, f"peak RSS grew {grown / 2**20:.0f} MiB"
        status, _ = await _post(socket_path, key, _chat("and 4 and 5?"))  # the job goes on
        assert status == 200
    finally:
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 20)
        except TimeoutError:
            proc.kill()
