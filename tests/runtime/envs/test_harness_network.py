"""A harness job's sandbox reaches its own gateway and nothing else: not the host's loopback
services, not the host's other addresses, not an outside address, not the host's abstract Unix
sockets. The harness here is a user-defined command (a probe program) run as any harness is."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from rollout.runtime.envs.harness.handler import HarnessHandler
from rollout.runtime.types import Limits, TerminationReason
from tests.runtime.envs.conftest import Rollout
from tests.runtime.envs.harness_helpers import PING_REPLY, PingGateway, harness_task

pytestmark = pytest.mark.timeout(120)

PROBE = r'''
import json, os, socket, sys, urllib.request
targets = json.loads(sys.argv[1])
seen = {}
def attempt(name, family, address):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect(address)
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        seen[name] = "connected: " + s.recv(100).decode(errors="replace")
    except OSError as e:
        seen[name] = f"refused: {type(e).__name__} {e}"
    finally:
        s.close()
for name, (host, port) in targets["tcp"].items():
    attempt(name, socket.AF_INET, (host, port))
for name, abstract in targets["abstract"].items():
    attempt(name, socket.AF_UNIX, "\0" + abstract)
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/models",
                             headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
try:
    seen["gateway"] = urllib.request.urlopen(req, timeout=10).read().decode()
except Exception as e:
    seen["gateway"] = f"failed: {e}"
with open("/proc/net/dev") as f:
    seen["interfaces"] = sorted(l.split(":")[0].strip() for l in f.readlines()[2:])
with open("answer.txt", "w") as f:
    f.write("2")
print("PROBE " + json.dumps(seen))
'''
SECRET = b"HOST-SERVICE-" + secrets.token_hex(4).encode()


def host_address() -> str | None:
    """One of the host's non-loopback addresses (no packet is sent to learn it)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: routing only, nothing goes out
        address = s.getsockname()[0]
        return None if address.startswith("127.") else str(address)
    return None


@contextlib.asynccontextmanager
async def host_services() -> AsyncIterator[dict[str, Any]]:
    """A TCP service on the host's loopback, one on every address, and one on an abstract Unix
    socket: each answers SECRET to whoever connects."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SECRET)
        await writer.drain()
        writer.close()

    loopback = await asyncio.start_server(answer, "127.0.0.1", 0)
    anywhere = await asyncio.start_server(answer, "0.0.0.0", 0)
    abstract_name = f"rollout-test-{secrets.token_hex(4)}"
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind("\0" + abstract_name)
    abstract = await asyncio.start_unix_server(answer, sock=unix)
    tcp = {"host_loopback": ["127.0.0.1", loopback.sockets[0].getsockname()[1]],
           "outside": ["1.1.1.1", 80], "outside_dns": ["8.8.8.8", 53]}
    if (address := host_address()) is not None:
        tcp["host_address"] = [address, anywhere.sockets[0].getsockname()[1]]
    try:
        yield {"tcp": tcp, "abstract": {"host_abstract": abstract_name}}
    finally:
        for server in (loopback, anywhere, abstract):
            server.close()


async def test_a_harness_reaches_its_gateway_and_nothing_else(rollout: Rollout) -> None:
    async with host_services() as targets:
        # The services answer the host itself: the probe's refusals are the sandbox's doing.
        r, w = await asyncio.open_connection(*targets["tcp"]["host_loopback"])
        assert await r.read() == SECRET
        w.close()
        harness = {"command": ["python", "{home}/probe.py", json.dumps(targets)],
                   "files": {"{home}/probe.py": PROBE}}
        task = harness_task("math", {"question": "What is 1 + 1?", "answer": "2", "tools": []},
                            harness)
        gateway = PingGateway()
        result = await rollout(HarnessHandler(), task, [], gateway=gateway,
                               limits=Limits(max_turns=4, run_timeout_s=60))
    log = result.outcome.metadata["harness_log"]
    assert "PROBE " in log, log
    seen = json.loads(log.split("PROBE ", 1)[1].splitlines()[0])
    assert json.loads(seen.pop("gateway")) == PING_REPLY
    assert seen.pop("interfaces") == ["lo"]
    assert set(seen) >= {"host_loopback", "outside", "outside_dns", "host_abstract"}
    for name, what in seen.items():
        assert what.startswith("refused:"), (name, what)
        assert SECRET.decode() not in what
    assert gateway.seen and all(h.startswith("Bearer ") for h in gateway.seen)
    # The harness's answer file went to the inner environment's grader unchanged.
    assert result.reward.value == 1.0, result.reward.info
    assert result.outcome.metadata["harness_exit"] == "0"


class LookingHarness(HarnessHandler):
    """Checks, as EVAL starts, that nothing of the harness is still running."""

    late_file: bool | None = None

    async def eval(self, ctx: Any) -> Any:
        await asyncio.sleep(3)  # the harness's background job would have written by now
        workspace = ctx.state["env.sandbox"].workspace
        self.late_file = os.path.exists(os.path.join(str(workspace), "late.txt"))
        return await super().eval(ctx)


async def test_the_gateway_socket_is_bound_for_the_harness_launch_only(
        rollout: Rollout) -> None:
    """Other launches of the job's sandbox never see the socket, and nothing the harness
    started in the background outlives RUN."""
    harness = {"command": ["bash", "-c", "test -S /.rollout-gateway.sock && echo SOCKET-THERE; "
                           "setsid bash -c 'sleep 2; echo late > late.txt' & "
                           "echo 2 > answer.txt"]}
    task = harness_task("math", {"question": "What is 1 + 1?", "answer": "2", "tools": []},
                        harness)
    views: list[str] = []

    async def look(ctx: Any) -> None:
        out = await ctx.state["env.sandbox"].exec(
            "ls -la /.rollout-gateway.sock 2>&1; echo end", timeout=30)
        views.append(out.stdout)

    handler = LookingHarness()
    result = await rollout(handler, task, [], gateway=PingGateway(), inspect=look,
                           limits=Limits(max_turns=2, run_timeout_s=60))
    assert "SOCKET-THERE" in result.outcome.metadata["harness_log"]
    assert "No such file" in views[0]
    assert handler.late_file is False
    assert result.reward.value == 1.0


async def test_a_harness_past_the_deadline_is_killed_and_graded(rollout: Rollout) -> None:
    """RUN's deadline ends the harness (and all it started); the job still gets its reward."""
    harness = {"command": ["bash", "-c", "echo 2 > answer.txt; sleep 600 & sleep 600"]}
    task = harness_task("math", {"question": "What is 1 + 1?", "answer": "2", "tools": []},
                        harness)
    started = asyncio.get_running_loop().time()
    result = await rollout(HarnessHandler(), task, [], gateway=PingGateway(),
                           limits=Limits(max_turns=2, run_timeout_s=6))
    assert asyncio.get_running_loop().time() - started < 60
    assert result.outcome.termination is TerminationReason.DEADLINE
    assert "timed out" in result.outcome.metadata["harness_log"]
    assert result.reward.value == 1.0


async def test_a_launch_bind_lands_only_on_a_new_top_level_name(sandbox_factory: Any,
                                                              tmp_path: Any) -> None:
    """Launch binds go on the launch's own root tmpfs: never under a directory the sandbox can
    write (where a planted link could steer the mount), never over a host path."""
    from rollout.runtime.sandbox.base import SandboxError

    source = tmp_path / "file"
    source.write_text("x")
    sandbox = await sandbox_factory(binds=[(str(tmp_path), "/.data", False)])
    try:
        for inside in ("/tmp/sock", "/workspace/sock", "/usr/sock", "relative", "/tmp", "/",
                       "/usr", "/bin", "/workspace", "/.sandbox", "/.data"):
            with pytest.raises(SandboxError, match="top-level"):
                sandbox.command_argv(["true"], file_binds=[(str(source), inside)])
        with pytest.raises(SandboxError, match="not an existing file"):
            sandbox.command_argv(["true"], file_binds=[(str(tmp_path), "/.x")])
        shown = await sandbox.exec(["cat", "/.x"], file_binds=[(str(source), "/.x")],
                                   timeout=30)
        assert shown.stdout == "x"
        write = await sandbox.exec(["bash", "-c", "echo y > /.x"],
                                   file_binds=[(str(source), "/.x")], timeout=30)
        assert write.exit_code != 0 and source.read_text() == "x"
    finally:
        await sandbox.destroy()


BURST = r'''
import os, socket, sys, urllib.request
n = int(sys.argv[1])
key = os.environ["OPENAI_API_KEY"]
request = ("GET /v1/models HTTP/1.1\r\nHost: relay\r\nAuthorization: Bearer " + key
           + "\r\nConnection: close\r\n\r\n").encode()
socks = []
for _ in range(n):  # all open at once: more than the sandbox's thread limit could relay
    s = socket.create_connection(("127.0.0.1", 4000), timeout=20)
    s.sendall(request)
    socks.append(s)
answered = 0
for s in socks:
    body = b""
    try:
        while chunk := s.recv(65536):
            body += chunk
    except OSError as e:
        print("BURST-STALLED", answered, e)
        break
    finally:
        s.close()
    answered += b"relay-ok" in body
print("BURST-ANSWERED", answered)
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/models",
                             headers={"Authorization": "Bearer " + key})
print("AFTER", urllib.request.urlopen(req, timeout=20).read().decode())
'''


async def test_the_relay_survives_a_burst_of_connections(rollout: Rollout) -> None:
    """Several hundred connections open at once (a harness's parallel tool calls, an SDK's
    pool): each is answered, and a request after the burst still is."""
    n = 400
    harness = {"command": ["python", "{home}/burst.py", str(n)],
               "files": {"{home}/burst.py": BURST}}
    task = harness_task("math", {"question": "What is 1 + 1?", "answer": "2", "tools": []},
                        harness)
    gateway = PingGateway()
    result = await rollout(HarnessHandler(), task, [], gateway=gateway,
                           limits=Limits(max_turns=4, run_timeout_s=100))
    log = result.outcome.metadata["harness_log"]
    assert f"BURST-ANSWERED {n}" in log, log
    assert "AFTER " in log and json.loads(log.split("AFTER ", 1)[1].splitlines()[0]) \
        == PING_REPLY, log
    assert len(gateway.seen) == n + 1
