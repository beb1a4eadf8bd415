"""A multi-node Ray cluster on one machine, for the cluster tests and ``rollout bench scale``.

Every node is its own ``ray start --block`` process in its own session, so killing a node is
killing its process group (raylet, node agent and every worker it started go together, as when
a host dies) and stopping the cluster never touches any other Ray on the machine (no
``ray stop``, which stops every Ray instance of the user). Node death is noticed in about a
second: the head is started with a short health-check period. Ray itself is not imported here;
the server that connects to the cluster imports it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

OBJECT_STORE_BYTES = 80_000_000
HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
          "health_check_initial_delay_ms": 500}


def _ray_bin() -> str:
    here = Path(sys.executable).with_name("ray")
    found = str(here) if here.exists() else shutil.which("ray")
    if not found:
        raise RuntimeError("the `ray` command is missing: pip install 'rollout-service[ray]'")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRayCluster:
    """``with LocalRayCluster() as c: c.add_node(slots=4)`` … ``c.address`` for the server."""

    DRIVER_ENV = {"RAY_AUTH_MODE": "disabled"}
    """What the connecting process's environment needs: Ray 2.60 turns token authentication
    on by default, and this throw-away cluster listens on loopback only, so it runs without."""

    def __init__(self, *, head_cpus: int = 1, env: Mapping[str, str] | None = None) -> None:
        self.head_cpus = head_cpus
        # Short: Ray's Unix socket paths live under it and must stay below ~107 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="rr-", dir="/tmp")
        self.port = _free_port()
        self.env = {**os.environ, **self.DRIVER_ENV, "RAY_USAGE_STATS_ENABLED": "0",
                    **(env or {})}
        self.head: subprocess.Popen[bytes] | None = None
        self.nodes: list[subprocess.Popen[bytes]] = []
        self._started = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _spawn(self, args: list[str]) -> subprocess.Popen[bytes]:
        self._started += 1
        with open(os.path.join(self.temp_dir, f"start-{self._started}.log"), "ab") as log:
            return subprocess.Popen([_ray_bin(), "start", "--block", *args], env=self.env,
                                    stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def start(self, timeout_s: float = 120.0) -> LocalRayCluster:
        self.head = self._spawn([
            "--head", f"--port={self.port}", "--node-ip-address=127.0.0.1",
            f"--num-cpus={self.head_cpus}", f"--object-store-memory={OBJECT_STORE_BYTES}",
            "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={self.temp_dir}",
            f"--system-config={json.dumps(HEALTH)}"])
        deadline = time.monotonic() + timeout_s
        while True:  # the GCS answers on the head's port once the head is up
            if self.head.poll() is not None:
                raise RuntimeError(f"ray head exited with {self.head.returncode}; see "
                                   f"{self.temp_dir}/start-1.log")
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), timeout=1):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"ray head did not come up in {timeout_s:g}s")
            time.sleep(0.2)
        return self

    def add_node(self, slots: int, cpus: int = 1,
                 timeout_s: float = 120.0) -> subprocess.Popen[bytes]:
        """Start a node that offers one node agent with ``slots`` job slots; returns once its
        raylet runs. Nodes start one at a time: two raylets starting at once on one machine
        can wait on each other for minutes."""
        resources = json.dumps({"rollout_node": 1, "rollout_slots": slots})
        proc = self._spawn([f"--address={self.address}", "--node-ip-address=127.0.0.1",
                            f"--num-cpus={cpus}", f"--object-store-memory={OBJECT_STORE_BYTES}",
                            f"--resources={resources}", "--disable-usage-stats"])
        self.nodes.append(proc)
        log = Path(self.temp_dir, f"start-{self._started}.log")
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in log.read_text(errors="replace"):
            if proc.poll() is not None:
                raise RuntimeError(f"ray node exited with {proc.returncode}; see {log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ray node did not start in {timeout_s:g}s; see {log}")
            time.sleep(0.2)
        return proc

    @staticmethod
    def kill(proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL a node's whole process group: the node dies as a crashed host would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def stop(self) -> None:
        procs = [*self.nodes, *([self.head] if self.head is not None else [])]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in procs:  # whatever is left of each group, including detached workers
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
