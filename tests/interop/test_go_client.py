"""The Go client, generated at test time from proto/rollout/v1 with buf.gen.go.yaml and built
offline against Debian's Go packages (GOPATH mode; the Go module proxy is unreachable here),
drives a session against a live server: open, submit a group, acknowledge, abrupt drop,
resume with acked_through, ack confirmation in heartbeats, half-close."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.client.aio import RolloutClient
from tests.client.conftest import ServerHarness

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
GOCODE = Path("/usr/share/gocode")
"""Where Debian's golang-*-dev packages put their sources (scripts/setup_test.sh installs them)."""


def _buf() -> str:
    for candidate in (ROOT / ".venv" / "bin" / "buf", Path(sys.executable).parent / "buf"):
        if candidate.exists():
            return str(candidate)
    found = shutil.which("buf")
    assert found, "buf is missing: run scripts/setup_test.sh"
    return found


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> None:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{argv}\n{done.stderr}{done.stdout}"


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("go") is None or not (GOCODE / "src/google.golang.org/grpc").exists():
        pytest.skip("Go and Debian's golang-google-grpc-dev are not installed "
                    "(scripts/setup_test.sh installs them; ROLLOUT_SKIP_GO=1 skips)")
    work = tmp_path_factory.mktemp("go")
    gopath = work / "gopath"
    module = gopath / "src" / "rollout-service"
    module.mkdir(parents=True)
    env = {**os.environ, "GO111MODULE": "off", "GOFLAGS": "",
           "GOPATH": f"{gopath}:{GOCODE}", "PATH": f"{work}:{os.environ['PATH']}"}
    # protoc-gen-go from Debian's sources (the packaged protoc-gen-go is the old APIv1 one)
    _run(["go", "build", "-o", str(work / "protoc-gen-go"),
          "google.golang.org/protobuf/cmd/protoc-gen-go"], env, work)
    _run([_buf(), "generate", "--template", "buf.gen.go.yaml", "--path", "proto/rollout",
          "-o", str(module)], env, ROOT)
    assert (module / "gen/go/rollout/v1/rollout_service_grpc.pb.go").exists()
    shutil.copytree(ROOT / "interop/go/sessiondriver", module / "interop/go/sessiondriver")
    exe = work / "sessiondriver"
    _run(["go", "build", "-o", str(exe), "."], env, module / "interop/go/sessiondriver")
    return exe


@pytest.fixture
async def harness(tmp_path: Path):  # type: ignore[no-untyped-def]
    h = ServerHarness(tmp_path / "state")
    await h.start()
    yield h
    await h.stop()


async def test_generated_go_client_runs_a_resumable_session(
        harness: ServerHarness, driver: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        str(driver), harness.address, "go-trainer",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, err.decode() + out.decode()
    first, second = json.loads(out.decode().strip().splitlines()[-1])["sessions"]
    assert sorted(first["accepted"]) == ["go-group/0", "go-group/1"]
    assert sorted(d["delivery_id"] for d in first["deliveries"]) == [1, 2]
    assert {d["job_id"]: d["reward"] for d in first["deliveries"]} == {
        "go-group/0": 0.5, "go-group/1": 1.0}
    assert len(first["finished"]) == 2 and first["acked_through"] == 1
    assert "Canceled" in first["ended_with"]
    unacked = next(d for d in first["deliveries"] if d["delivery_id"] == 2)
    # resumed: exactly the unacknowledged delivery, then a clean half-close
    assert second["replaying"] == 1
    assert second["deliveries"] == [unacked]
    assert second["finished"] == [unacked["job_id"]]
    assert second["acked_through"] == 2 and second["ended_with"] == "ok"
    async with RolloutClient(harness.address) as client, \
            client.session("go-trainer") as s:
        assert s.opened.replaying == 0 and s.opened.acked_through == 2
