"""The TypeScript client, generated at test time from proto/rollout/v1 with buf.gen.ts.yaml
(protobuf-es + Connect over gRPC, local plugin from interop/ts/node_modules), drives a session
against a live server under Node: open, submit a group, read trajectories, ack, abrupt drop
and resume, ack confirmation, half-close, reconnect, re-submit with REPLAY, error reasons.
The driver (interop/ts/session_driver.mjs) is written from docs/PROTOCOL.md alone."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import grpc
import pytest

from rollout.client.aio import RolloutClient
from rollout.v1 import job_pb2
from tests.client.conftest import ServerHarness
from tests.util import patience

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
TS = ROOT / "interop" / "ts"
S = job_pb2.Job


def _tool(name: str) -> str:
    for candidate in (ROOT / ".venv" / "bin" / name, Path(sys.executable).parent / name):
        if candidate.exists():
            return str(candidate)
    found = shutil.which(name)
    assert found, f"{name} is missing: run scripts/setup_test.sh"
    return found


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    assert (TS / "node_modules" / ".bin" / "protoc-gen-es").exists(), (
        "the TypeScript toolchain is missing: run scripts/setup_test.sh (npm ci in interop/ts)")
    out = tmp_path_factory.mktemp("ts")
    subprocess_run([_tool("buf"), "generate", "--template", "buf.gen.ts.yaml", "-o", str(out)])
    gen = out / "interop" / "ts" / "gen"
    assert (gen / "rollout" / "v1" / "rollout_service_pb.js").exists()
    # Node resolves @bufbuild/protobuf from the generated files' folder upwards.
    (out / "node_modules").symlink_to(TS / "node_modules")
    return gen


def subprocess_run(argv: list[str]) -> None:
    import subprocess

    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr + done.stdout


@pytest.fixture
async def harness(tmp_path: Path):  # type: ignore[no-untyped-def]
    h = ServerHarness(tmp_path / "state")
    await h.start()
    yield h
    await h.stop()


async def test_generated_ts_client_runs_a_resumable_session(
        harness: ServerHarness, generated: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        "node", str(TS / "session_driver.mjs"), harness.address, str(generated), "ts-trainer",
        cwd=TS, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "NODE_OPTIONS": ""})
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, err.decode() + out.decode()
    report = json.loads(out.decode().strip().splitlines()[-1])
    first, second, third = report["sessions"]

    # session 1: three accepted, three deliveries 1..3 each followed by its `finished`
    assert sorted(a[0] for a in first["accepted"]) == ["ts-group/0", "ts-group/1", "ts-group/2"]
    assert sorted(t[1] for t in first["trajectories"]) == [1, 2, 3]
    rewards = {t[0]: t[2] for t in first["trajectories"]}
    assert rewards == {"ts-group/0": 0.25, "ts-group/1": 0.5, "ts-group/2": 0.75}
    assert all(ok for _, ok in first["finished"]) and len(first["finished"]) == 3
    assert first["acked"] == [1, 2] and first["confirmed"] == 2
    assert first["endedWith"] == "aborted"
    unacked_job = next(t[0] for t in first["trajectories"] if t[1] == 3)

    # session 2: exactly the unacknowledged one replayed, then a clean half-close
    assert second["opened"]["replaying"] == 1 and second["opened"]["ackedThrough"] == 2
    assert second["opened"]["storeId"] == first["opened"]["storeId"]
    assert not second["opened"]["storeChanged"]
    assert second["trajectories"] == [[unacked_job, 3]]
    assert second["finished"] == [unacked_job]
    assert second["halfClosedAt"] == 3 and second["endedWith"] == "ok"

    # session 3: nothing replayed; the REPLAY re-submit gets a new delivery id 4
    assert third["opened"]["replaying"] == 0
    assert third["accepted"] == [["ts-group/0", True, "SUCCEEDED"]]
    assert third["trajectories"] == [["ts-group/0", 4, True]]
    assert third["rejected"] == [[grpc.StatusCode.NOT_FOUND.value[0], "GROUP_NOT_FOUND"]]
    assert report["unaryError"]["code"] == "InvalidArgument"
    assert "job_id" in report["unaryError"]["message"]

    # The server agrees, checked through the Python client: every job ran once and every
    # delivery is acknowledged (a reconnect replays nothing).
    async with RolloutClient(harness.address) as client:
        jobs = [j async for j in client.list_jobs(client_id="ts-trainer")]
        assert sorted((j.job_id, j.state) for j in jobs) == [
            (f"ts-group/{i}", S.STATE_SUCCEEDED) for i in range(3)]
        async with client.session("ts-trainer") as s:
            assert s.opened.replaying == 0 and s.opened.acked_through == 4
    assert sorted(e[0] for e in harness.handler.events if e[1:] == ("init", "start")) == [
        f"ts-group/{i}" for i in range(3)]


async def _start_child(state: Path, port: int = 0) -> tuple[asyncio.subprocess.Process, int]:
    """The server child and the port it serves on (``port`` 0: one it picked)."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.interop.server_child", str(state), str(port), cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=asyncio.subprocess.PIPE)
    assert child.stdout is not None
    line = await asyncio.wait_for(child.stdout.readline(), patience(60))
    ready, _, served = line.strip().partition(b" ")
    assert ready == b"READY" and int(served) > 0 and port in (0, int(served)), line
    return child, int(served)


async def test_generated_ts_client_survives_a_sigkilled_server(
        tmp_path: Path, generated: Path) -> None:
    state = tmp_path / "state"
    # The restart must come back on the same port (the client reconnects to one address);
    # the first start lets the server pick it, so only the restart's own gap remains.
    server, port = await _start_child(state)
    node = await asyncio.create_subprocess_exec(
        "node", str(TS / "sigkill_driver.mjs"), f"127.0.0.1:{port}", str(generated), "ts-kill",
        cwd=TS, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert node.stdout is not None and node.stderr is not None
    try:
        line = await asyncio.wait_for(node.stdout.readline(), patience(60))
        assert line.strip() == b"KILL-ME", line + await node.stderr.read()
        server.send_signal(signal.SIGKILL)  # with kill/1 running and kill/0 acknowledged
        await server.wait()
        server, _ = await _start_child(state, port)
        out, err = await asyncio.wait_for(node.communicate(), 90)
        assert node.returncode == 0, err.decode() + out.decode()
    finally:
        if node.returncode is None:
            node.kill()
        server.send_signal(signal.SIGKILL)
        await server.wait()
    report = json.loads(out.decode().strip().splitlines()[-1])
    # the killed stream ended with a resumable code, then the session resumed and ended OK
    assert report["endings"][0] in ("Canceled", "Unavailable")
    assert set(report["endings"][:-1]) <= {"Canceled", "Unavailable"}
    assert report["endings"][-1] == "OK"
    # each job delivered once: kill/0 before the kill, kill/1 (run again) after it
    assert [d[:2] for d in report["deliveries"]] == [["kill/0", 1], ["kill/1", 2]]
    assert report["deliveries"][0][2] == 1 and report["deliveries"][1][2] > 1
    assert not report["opened"]["storeChanged"]
