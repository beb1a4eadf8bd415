"""Start-up refuses what would break a running service, with one line that says what to do.

In-process tests use the production ``Server`` (as tests/client/conftest.py does); the
``rollout serve`` tests run the real command in child processes, so the one-line errors, exit
codes and the lock between two processes are what a user sees.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout.server.startup import LOCK_FILE, StartupError
from tests.client.conftest import ServerHarness
from tests.util import scaled

pytestmark = pytest.mark.timeout(90)


async def _serving_async(address: str) -> bool:
    """For a server on this test's own event loop (a blocking call would stall it)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        return resp.status == health_pb2.HealthCheckResponse.SERVING


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        return resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_second_server_on_same_port_fails_and_first_keeps_serving(tmp_path: Path) -> None:
    first = ServerHarness(tmp_path / "a")
    await first.start()
    try:
        second = ServerHarness(tmp_path / "b")
        second.port = first.port
        with pytest.raises(StartupError) as info:
            await second.start()
        assert info.value.reason == "PORT_IN_USE"
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert (f"127.0.0.1:{first.port} is already in use by another rollout server (it "
                "answers health checks there)") in str(info.value)
        assert "--port" in str(info.value)
        assert await _serving_async(first.address)
        # the failed start released its state directory: a server may use it right away
        second.port = 0
        await second.start()
        await second.stop()
    finally:
        await first.stop()


async def test_grpc_bind_itself_refuses_a_shared_port(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The early probe skipped (as if the port were taken just after it looked): gRPC's own
    bind must fail too, which it does only with SO_REUSEPORT off on both servers."""
    import rollout.server.app

    monkeypatch.setattr(rollout.server.app, "check_port_free", lambda *a, **k: None)
    first = ServerHarness(tmp_path / "a")
    await first.start()
    try:
        second = ServerHarness(tmp_path / "b")
        second.port = first.port
        with pytest.raises(StartupError) as info:
            await second.start()
        assert info.value.reason == "PORT_IN_USE"
        assert await _serving_async(first.address)
    finally:
        await first.stop()


async def test_port_taken_by_another_grpc_server(tmp_path: Path) -> None:
    other = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    port = other.add_insecure_port("127.0.0.1:0")
    await other.start()
    try:
        h = ServerHarness(tmp_path / "s")
        h.port = port
        with pytest.raises(StartupError) as info:
            await h.start()
        assert "in use by another gRPC server (not a rollout server)" in str(info.value)
    finally:
        await other.stop(0)


async def test_port_taken_by_another_program(tmp_path: Path) -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        h = ServerHarness(tmp_path / "s")
        h.port = other.getsockname()[1]
        with pytest.raises(StartupError) as info:
            await h.start()
        assert info.value.reason == "PORT_IN_USE"
        assert "already in use by another program;" in str(info.value)
        # a listener that asked for SO_REUSEPORT itself (as gRPC does by default) is no
        # exception: with ours off, the kernel refuses to share the port
    with socket.socket() as sharer:
        sharer.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sharer.bind(("127.0.0.1", 0))
        sharer.listen()
        h = ServerHarness(tmp_path / "s")
        h.port = sharer.getsockname()[1]
        with pytest.raises(StartupError) as info:
            await h.start()
        assert info.value.reason == "PORT_IN_USE"


async def test_second_server_on_same_state_dir_names_the_holder(tmp_path: Path) -> None:
    first = ServerHarness(tmp_path / "state")
    await first.start()
    try:
        holder = json.loads((tmp_path / "state" / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["address"] == first.address
        second = ServerHarness(tmp_path / "state")
        with pytest.raises(StartupError) as info:
            await second.start()
        msg = str(info.value)
        assert info.value.reason == "STATE_DIR_LOCKED"
        assert f"pid {os.getpid()}, listening on {first.address}" in msg
        assert str((tmp_path / "state").resolve()) in msg and "--state-dir" in msg
        assert await _serving_async(first.address)
    finally:
        await first.stop()
    # released on stop: the next server takes the directory over (and recovers its jobs)
    again = ServerHarness(tmp_path / "state")
    await again.start()
    await again.stop()


@pytest.mark.parametrize("port", [99999, 65536, -1])
async def test_bad_port_is_rejected_before_anything_is_created(tmp_path: Path,
                                                               port: int) -> None:
    h = ServerHarness(tmp_path / "state")
    h.port = port
    with pytest.raises(StartupError) as info:
        await h.start()
    assert info.value.reason == "BAD_PORT"
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"got {port}" in str(info.value) and "0 and 65535" in str(info.value)
    assert not (tmp_path / "state").exists()


async def test_unwritable_state_dir_names_the_path(tmp_path: Path) -> None:
    # sysfs refuses new directories even to root (file modes would not stop a root test run)
    state = Path("/sys/rollout-test-state")
    h = ServerHarness(state)
    with pytest.raises(StartupError) as info:
        await h.start()
    assert info.value.reason == "STATE_DIR_NOT_WRITABLE"
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert str(state) in str(info.value)


async def test_state_dir_inside_a_file_is_a_configuration_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    h = ServerHarness(blocker / "state")  # a directory cannot be made inside a file
    with pytest.raises(StartupError) as info:
        await h.start()
    assert info.value.reason == "BAD_CONFIG"
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"cannot be created: {blocker} is a file" in str(info.value)


# ------------------------------------------------------------------ `rollout serve`, for real


def _serve(state: Path, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "rollout.entrypoints.cli", "serve", "--state-dir", str(state),
         "--set", "llm.backends=[]", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run_serve(state: Path, *flags: str, wrap: tuple[str, ...] = ()) -> tuple[int, str]:
    res = subprocess.run(
        [*wrap, sys.executable, "-m", "rollout.entrypoints.cli", "serve", "--state-dir", str(state),
         "--set", "llm.backends=[]", *flags],
        capture_output=True, text=True, timeout=scaled(60))
    return res.returncode, res.stderr


def _one_line(err: str, code_reason: str) -> str:
    assert err.count("\n") == 1 and err.endswith("\n"), err  # gRPC's own logs included
    assert err.startswith(f"error: {code_reason}: "), err
    assert "Traceback" not in err
    return err


@pytest.fixture
def running_serve(tmp_path: Path):
    """A real `rollout serve` on a free port; yields (process, address, state dir)."""
    state = tmp_path / "state"
    proc = _serve(state, "--port", "0")
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "rollout service listening on HOST:PORT  (state: …)"
    assert "listening on" in line, line + (proc.stderr.read() if proc.stderr else "")
    address = line.split("listening on ")[1].split()[0]
    try:
        yield proc, address, state
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(scaled(30))


def test_serve_twice_on_one_port_and_one_state_dir(running_serve, tmp_path: Path) -> None:
    proc, address, state = running_serve
    port = address.rsplit(":", 1)[1]
    code, err = _run_serve(tmp_path / "other", "--port", port)
    assert code == 2
    assert f"{address} is already in use by another rollout server" in \
        _one_line(err, "FAILED_PRECONDITION PORT_IN_USE")
    code, err = _run_serve(state, "--port", "0")
    assert code == 2
    line = _one_line(err, "FAILED_PRECONDITION STATE_DIR_LOCKED")
    assert f"pid {proc.pid}, listening on {address}" in line
    assert proc.poll() is None and _serving(address)


def test_lock_of_a_killed_server_does_not_linger(tmp_path: Path) -> None:
    state = tmp_path / "state"
    proc = _serve(state, "--port", "0")
    assert proc.stdout is not None and "listening on" in proc.stdout.readline()
    proc.kill()  # SIGKILL: no clean-up ran; the kernel drops the flock with the process
    proc.wait()
    nxt = _serve(state, "--port", "0")
    try:
        assert nxt.stdout is not None and "listening on" in nxt.stdout.readline()
    finally:
        nxt.send_signal(signal.SIGTERM)
        nxt.wait(scaled(30))


def test_serve_bad_port_is_one_line(tmp_path: Path) -> None:
    code, err = _run_serve(tmp_path / "s", "--port", "99999")
    assert code == 2
    assert "got 99999" in _one_line(err, "INVALID_ARGUMENT BAD_PORT")


def test_serve_read_only_state_dir_names_the_path(tmp_path: Path) -> None:
    """A real read-only file system (a bubblewrap read-only bind), since root, who runs the
    tests here, may write to any directory whatever its mode bits."""
    ro = tmp_path / "ro"
    (ro / "state").mkdir(parents=True)
    wrap = ("bwrap", "--dev-bind", "/", "/", "--ro-bind", str(ro), str(ro))
    for state in (ro / "state", ro / "new"):  # an existing directory, and one to create
        code, err = _run_serve(state, "--port", "0", wrap=wrap)
        assert code == 2
        line = _one_line(err, "PERMISSION_DENIED STATE_DIR_NOT_WRITABLE")
        assert f"{state} (Read-only file system)" in line


def test_metrics_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        code, err = _run_serve(tmp_path / "s", "--port", "0", "--metrics-port", str(port))
    assert code == 2, err
    line = _one_line(err, "FAILED_PRECONDITION PORT_IN_USE")
    assert f"127.0.0.1:{port} (the metrics endpoint)" in line and "--metrics-port" in line


@pytest.mark.parametrize("host", ["no-such-host.invalid", "10.254.254.254"])
async def test_bad_host_is_named(tmp_path: Path, host: str) -> None:
    """Checked also for port 0, where gRPC's own failure would only say "Failed to bind"."""
    h = ServerHarness(tmp_path / "state", host=host)
    with pytest.raises(StartupError) as info:
        await h.start()
    assert info.value.reason == "BAD_HOST" and repr(host) in str(info.value)
    again = ServerHarness(tmp_path / "state")  # the failed start let the directory go
    await again.start()
    await again.stop()
