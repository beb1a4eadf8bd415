"""Outcomes never hidden: a job whose agent ran out of RUN time is counted apart from clean
successes by ``rollout submit``'s summary, ``rollout status``, the status RPC and Prometheus.

The server is the real one with the real ``math`` environment (``"tools": []``, so no sandbox)
and the real agent loop; only the model is the scripted testing policy, slowed down so that a
job with a short RUN timeout has its turn cut by the deadline. That job still *succeeds* (EVAL
scores the partial turn, which holds the right boxed answer), which is exactly the case a
summary by state alone reports as a clean success.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout.entrypoints.cli import main
from rollout.entrypoints.summary import JobOutcome, RunStats
from rollout.runtime.envs.math.handler import MathHandler
from rollout.runtime.handler import HandlerRegistry
from rollout.server.app import Server
from rollout.server.llm.scripted import ScriptedEngine
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from rollout.v1 import trajectory_pb2 as tpb
from tests.client.conftest import make_config
from tests.runtime.chat_families import chatml_tokenizer
from tests.runtime.doubles import EngineClient

pytestmark = pytest.mark.timeout(60)

LATENCY_S = 1.5
"""Every scripted turn takes this long; the late job's whole RUN budget is shorter."""

REPLIES = {
    "clean": '<tool_call>{"name": "submit", "arguments": {"answer": "42"}}</tool_call>',
    "wrong": '<tool_call>{"name": "submit", "arguments": {"answer": "41"}}</tool_call>',
    # Cut at the deadline, the engine returns the first half: the boxed answer, no more.
    "late": "The answer is \\boxed{42}." + " I am still checking this result" * 6,
    "starved": "never generated: its RUN time is gone before the first turn",
}


def job(job_id: str, run_timeout: str = "60s") -> dict[str, Any]:
    return {"job_id": job_id, "environment": "math",
            "task": {"question": "What is 6 * 7?", "answer": "42", "tools": []},
            "limits": {"max_turns": 2, "run_timeout": run_timeout}}


class MathServer:
    """A real server on its own event-loop thread (the command line runs ``asyncio.run``)."""

    def __init__(self, state_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        engine = ScriptedEngine(chatml_tokenizer(), lambda sid, turn: REPLIES[sid],
                                latency_s=LATENCY_S)
        registry = HandlerRegistry()
        registry.register("math", MathHandler())
        self.server = Server(make_config(state_dir), registry=registry,
                             llm=EngineClient(engine))
        self._call(self.server.start())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def metric(self, name: str, labels: dict[str, str]) -> float | None:
        assert self.server.scheduler is not None
        return self.server.scheduler.metrics_registry.get_sample_value(name, labels)

    def stop(self) -> None:
        self._call(self.server.stop(0.1))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.fixture
def math_server(tmp_path: Path) -> Iterator[MathServer]:
    srv = MathServer(tmp_path / "state")
    yield srv
    srv.stop()


def rows(text: str, first: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines() if line.split()[:1] == [first]]


def test_deadline_hit_job_is_reported_apart(math_server: MathServer, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    # RUN timeout 2.5 s: the loop's own deadline (2 s earlier) cuts the 1.5 s turn at 0.5 s.
    jobs = [job("clean"), job("late", run_timeout="2.5s"), job("wrong")]
    path = tmp_path / "jobs.jsonl"
    path.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    out = tmp_path / "out.jsonl"
    assert main(["submit", str(path), "--out", str(out), "--no-progress",
                 "--address", math_server.address]) == 0
    text = capsys.readouterr().out

    # Independently of the summary: what the trajectories themselves say.
    trajs = {t["job_id"]: t for t in map(json.loads, out.read_text().splitlines())}
    assert trajs["late"]["termination_reason"] == "TERMINATION_REASON_DEADLINE"
    assert trajs["late"]["state"] == "STATE_SUCCEEDED" and trajs["late"]["reward"] == 1.0
    assert trajs["clean"]["termination_reason"] == "TERMINATION_REASON_SUBMITTED"

    # jobs, ok, deadline, fail, cancel, solved: the late success is not among the ok ones
    summary, endings = rows(text, "math")
    assert summary[1:7] == ["3", "2", "1", "0", "0", "2"], text
    assert " ".join(endings).endswith("2 submitted, 1 deadline"), text  # how runs ended
    assert ("math: 1 of 3 jobs earned 0: 1 submitted an answer the grader scored 0"
            in text), text

    assert main(["status", "--address", math_server.address]) == 0
    status = capsys.readouterr().out
    assert "runs ended by: submitted=2, deadline=1" in status, status
    assert math_server.metric("rollout_jobs_terminated_total",
                              {"reason": "deadline", "state": "succeeded"}) == 1.0
    assert math_server.metric("rollout_jobs_terminated_total",
                              {"reason": "submitted", "state": "succeeded"}) == 2.0


def test_a_deadline_passed_with_nothing_generated_says_so_in_one_line(
        math_server: MathServer, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    # 1 s of RUN time is less than the loop's margin: the deadline has passed before turn 1.
    # The late job generated half a turn before its cut: it is not among the starved ones.
    jobs = [job("starved", run_timeout="1s"), job("late", run_timeout="2.5s"), job("clean")]
    path = tmp_path / "jobs.jsonl"
    path.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    assert main(["submit", str(path), "--out", str(tmp_path / "out.jsonl"), "--no-progress",
                 "--address", math_server.address]) == 0
    text = capsys.readouterr().out
    starved = [line for line in text.splitlines() if "before the model generated" in line]
    assert starved == ["math: 1 of 3 jobs reached the RUN deadline before the model generated a "
                       "token (a slow or busy machine): raise limits.run_timeout_s, run fewer "
                       "jobs at once, or use a faster backend"], text


def _traj(job_id: str, termination: int, tools: int) -> tpb.Trajectory:
    t = tpb.Trajectory(job_id=job_id, termination_reason=termination)
    for _ in range(tools):
        t.turns.add(tool_calls=["python"], output_ids=[1, 2])
    return t


def test_outcome_columns_partition_the_finished_jobs() -> None:
    """Every finished job lands in exactly one of ok / deadline / fail / cancel, whichever
    order its trajectory and its JobFinished frame arrive in."""
    S, T = job_pb2.Job, tpb.TerminationReason
    specs = [job_pb2.JobSpec(job_id=f"j{i}", environment="e") for i in range(5)]
    stats = RunStats(specs)
    cases = [  # (termination, state, reward, outcome)
        (T.TERMINATION_REASON_SUBMITTED, S.STATE_SUCCEEDED, 1.0, "ok"),
        (T.TERMINATION_REASON_DEADLINE, S.STATE_SUCCEEDED, 1.0, "deadline"),
        (T.TERMINATION_REASON_DEADLINE, S.STATE_FAILED, 0.0, "deadline"),
        (T.TERMINATION_REASON_ERROR, S.STATE_FAILED, 0.0, "fail"),
        (T.TERMINATION_REASON_CANCELLED, S.STATE_CANCELLED, 0.0, "cancel"),
    ]
    for i, (term, state, reward, _) in enumerate(cases):
        finished = pb.JobFinished(state=state, reward=reward)
        if i % 2:  # JobFinished first
            stats.finished(f"j{i}", finished)
            stats.trajectory(_traj(f"j{i}", term, tools=i))
        else:
            stats.trajectory(_traj(f"j{i}", term, tools=i))
            stats.finished(f"j{i}", finished)
    assert [stats.jobs[f"j{i}"].outcome for i in range(5)] == [c[3] for c in cases]
    assert JobOutcome("e").outcome == "-"  # nothing arrived yet: not counted anywhere
