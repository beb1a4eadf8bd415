"""``rollout serve --dashboard-port``: bound like the gRPC port (port 0 named in the start-up
line, a taken port refused in one line before anything starts)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.util import scaled


def test_port_0_is_named_in_the_start_up_line_and_serves(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout.entrypoints.cli", "serve", "--state-dir",
         str(tmp_path / "state"), "--set", "llm.backends=[]", "--port", "0",
         "--dashboard-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line and "; dashboard http://127.0.0.1:" in line, (
            line + (proc.stderr.read() if proc.stderr else ""))
        url = line.split("dashboard ")[1].split(")")[0]
        assert int(url.rsplit(":", 1)[1].strip("/")) > 0
        with urllib.request.urlopen(url + "jobs", timeout=scaled(10)) as r:  # no credentials
            assert r.status == 200 and b"<h1>Jobs</h1>" in r.read()
            assert "script-src 'self'" in r.headers["Content-Security-Policy"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(scaled(30))
    assert proc.returncode == 0


def test_a_taken_dashboard_port_is_refused_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run(
            [sys.executable, "-m", "rollout.entrypoints.cli", "serve", "--state-dir",
             str(tmp_path / "state"), "--set", "llm.backends=[]", "--port", "0",
             "--dashboard-port", str(port)], capture_output=True, text=True,
            timeout=scaled(60))
    assert res.returncode == 2
    assert res.stderr.startswith("error: FAILED_PRECONDITION PORT_IN_USE: "), res.stderr
    assert f"127.0.0.1:{port} (the dashboard) is already in use" in res.stderr
    assert "--dashboard-port N" in res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "rollout.entrypoints.cli", "serve", "--state-dir",
         str(tmp_path / "state"), "--dashboard-port", "70000"], capture_output=True,
        text=True, timeout=scaled(60))
    assert res.returncode == 2 and "BAD_PORT" in res.stderr and "--dashboard-port" in res.stderr
