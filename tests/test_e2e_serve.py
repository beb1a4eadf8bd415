"""`rollout serve` as a user runs it (a separate process, configured by flags), driven by
`rollout submit` and by a raw session: the shipped task files, and a SIGKILL mid-run.

The model is the scripted testing policy (configured with ``llm.backends``), replaying a
correct solution for each task, so every reward must be 1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from rollout.runtime.tasksets.shipped import load_tasks, task_file
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from rollout.v1 import rollout_service_pb2_grpc as pb_grpc
from tests.runtime.envs.conftest import call
from tests.util import patience

ROLLOUT = [sys.executable, "-m", "rollout.entrypoints.cli"]
DONE = call("submit", answer="done")


def correct_script(env: str, task: dict[str, Any]) -> list[str]:
    if env == "math":
        return [call("submit", answer=task["answer"])]
    if env == "code":
        return [call("editor", command="create", path="/workspace/solution.py",
                     file_text=task["solution"]), DONE]
    return [call("bash", command=f"git apply <<'EOF'\n{task['patch']}EOF\n"), DONE]


class Serve:
    """One `rollout serve` process on a state directory (restartable).

    Each start lets the server pick a free port (``--port 0``) and reads it from the line the
    server prints: a port found free beforehand and handed over later could be taken in
    between by any connection on the machine (its source ports come from the same range),
    and a process start on a loaded machine takes seconds."""

    def __init__(self, tmp: Path, script: Path, latency_s: float = 0.0) -> None:
        self.port = 0
        self.state = tmp / "state"
        backend = {"kind": "scripted", "file": str(script), "latency_s": latency_s}
        self.args = [*ROLLOUT, "serve", "--port", "0", "--state-dir",
                     str(self.state), "--set", f"llm.backends={json.dumps([backend])}",
                     "--set", "pipeline.run_workers=4", "--set", "server.grace_s=1"]
        self.log = tmp / "serve.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the server and wait for its address; a server that does not come up is
        stopped before the failure is raised (it would outlive the test otherwise: callers
        stop it in a ``finally`` that starts after this returns)."""
        offset = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        # A hang guard, stretched with the load: three suites on two cores took 100 s.
        deadline = time.monotonic() + patience(90)
        try:
            while not (found := re.search(rb"listening on 127\.0\.0\.1:(\d+)",
                                          self.log.read_bytes()[offset:])):
                assert self.proc.poll() is None, self.log.read_text()
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        self.port = int(found.group(1))
        assert self.port > 0

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None


@pytest.fixture
def serve_factory(tmp_path: Path) -> Iterator[Any]:
    made: list[Serve] = []

    def make(script_rows: list[dict[str, Any]], latency_s: float = 0.0) -> Serve:
        script = tmp_path / "script.jsonl"
        script.write_text("".join(json.dumps(r) + "\n" for r in script_rows))
        s = Serve(tmp_path, script, latency_s)
        made.append(s)
        s.start()
        return s

    yield make
    for s in made:
        s.stop()


@pytest.mark.timeout(300)
def test_rollout_submit_runs_the_shipped_task_files(serve_factory: Any, tmp_path: Path) -> None:
    rows, files = [], []
    for env in ("math", "code", "swe"):
        path = task_file(env)
        files.append(path)
        # `rollout submit` names jobs <file stem>-<line number>.
        for lineno, task in enumerate(load_tasks(env), 1):
            rows.append({"job_id": f"{path.stem}-{lineno}",
                         "messages": correct_script(env, task)})
    server = serve_factory(rows)
    total = 0
    for path in files:
        out = tmp_path / f"{path.stem}.out.jsonl"
        res = subprocess.run([*ROLLOUT, "submit", str(path), "--out", str(out),
                              "--address", server.address, "--no-progress"],
                             capture_output=True, text=True, timeout=240)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "rollout summary" in res.stdout
        trajs = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(trajs) == len(load_tasks(path.stem))
        assert all(t["reward"] == 1 for t in trajs), [
            (t["job_id"], t.get("metadata")) for t in trajs if t["reward"] != 1]
        total += len(trajs)
    assert total >= 35


@pytest.mark.timeout(300)
def test_sigkill_mid_run_loses_nothing(serve_factory: Any) -> None:
    """Jobs queued, running and finished-but-unacked when the server is SIGKILLed: after a
    restart every job completes and every trajectory is delivered."""
    tasks = load_tasks("math")[:12]
    rows = [{"job_id": f"crash-{i}", "messages": correct_script("math", t)}
            for i, t in enumerate(tasks)]
    server = serve_factory(rows, latency_s=0.4)
    specs = [json_format.ParseDict({"job_id": f"crash-{i}", "environment": "math", "task": t},
                                   job_pb2.JobSpec()) for i, t in enumerate(tasks)]

    def session(first: list[pb.StreamRolloutsRequest], until: Any) -> list[Any]:
        frames: list[Any] = []
        with grpc.insecure_channel(server.address) as ch:
            call_ = pb_grpc.RolloutServiceStub(ch).StreamRollouts(iter(first), timeout=120)
            try:
                for f in call_:
                    frames.append(f)
                    if until(frames):
                        call_.cancel()
                        break
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.CANCELLED:
                    raise
        return frames

    open_ = pb.StreamRolloutsRequest(open=pb.OpenSession(client_id="crasher"))
    submit = pb.StreamRolloutsRequest(submit=pb.SubmitJobs(jobs=specs))

    def delivered(frames: list[Any]) -> set[str]:
        return {f.job_id for f in frames if f.WhichOneof("kind") == "trajectory"}

    # Wait for a few deliveries (never acked), then SIGKILL with the rest queued or running.
    before = session([open_, submit], lambda fr: len(delivered(fr)) >= 3)
    assert 3 <= len(delivered(before)) < len(specs)
    server.kill()
    server.start()
    after = session([open_], lambda fr: len(delivered(fr)) == len(specs))
    rewards = {f.job_id: f.trajectory.trajectory.reward for f in after
               if f.WhichOneof("kind") == "trajectory"}
    assert set(rewards) == {s.job_id for s in specs}
    assert all(r == 1.0 for r in rewards.values()), rewards
    assert delivered(before) <= set(rewards), "unacked deliveries are replayed"
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.RolloutServiceStub(ch)
        attempts = [stub.GetJob(pb.GetJobRequest(job_id=s.job_id)).job.attempts for s in specs]
    assert max(attempts) >= 2, "jobs interrupted by the kill ran again"
    assert os.path.isdir(server.state)


def test_a_server_that_does_not_come_up_is_stopped(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # The helper's own guard: a server slower than the (load-stretched) deadline fails the
    # test and is stopped, never left running beside the rest of the suite.
    import tests.test_e2e_serve as here

    monkeypatch.setattr(here, "patience", lambda seconds: 0.5)
    server = Serve(tmp_path, tmp_path / "script.jsonl")
    server.args = [sys.executable, "-c", "import time; time.sleep(600)"]
    with pytest.raises(AssertionError, match="server did not start"):
        server.start()
    assert server.proc is None
