"""Ctrl-C in ``rollout submit`` says what keeps running and cancels it when asked; ``rollout jobs
cancel --all-mine`` cancels a client's unfinished jobs in one command; the "waiting on" line
names the slow tail."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout.client.sync import RolloutClientSync
from rollout.entrypoints.cli import main
from rollout.entrypoints.submit import _Waiting, default_client_id
from rollout.v1 import job_pb2
from tests.client.conftest import ThreadedServer, task

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("COLUMNS", "200")
    for name in ("ROLLOUT_ADDRESS", "ROLLOUT_TOKEN", "ROLLOUT_CLIENT_ID", "ROLLOUT_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    # As in a fresh `rollout` process: asyncio.run turns SIGINT into a cancel only while
    # Python's default handler is installed, and an earlier test in this process may have left
    # another one (a server's signal handling).
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def _states(address: str, *job_ids: str) -> list[str]:
    with RolloutClientSync(address) as client:
        return [job_pb2.Job.State.Name(client.get_job(j).job.state) for j in job_ids]


def _interrupt_once_running(address: str, *job_ids: str) -> threading.Thread:
    """SIGINT this process (as Ctrl-C does) once every job is running on the server."""
    def watch() -> None:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            try:
                if set(_states(address, *job_ids)) == {"STATE_RUNNING"}:
                    break
            except Exception:  # not accepted yet
                pass
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _held_jobs(tmp_path: Path) -> Path:
    path = tmp_path / "held.jsonl"
    path.write_text("".join(json.dumps({**task(gate=["run"]), "job_id": j}) + "\n"
                            for j in ("held-a", "held-b")))
    return path


def test_ctrl_c_with_cancel_cancels_what_this_run_left_unfinished(
        threaded_server: ThreadedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    watcher = _interrupt_once_running(threaded_server.address, "held-a", "held-b")
    code = main(["submit", str(_held_jobs(tmp_path)), "--out", str(tmp_path / "o.jsonl"),
                 "--address", threaded_server.address, "--no-progress",
                 "--on-interrupt", "cancel"])
    watcher.join(5)
    assert code == 130
    assert "cancelled 2 unfinished job(s) of this run" in capsys.readouterr().out
    assert _states(threaded_server.address, "held-a", "held-b") == ["STATE_CANCELLED"] * 2


def test_ctrl_c_without_a_terminal_keeps_the_jobs_and_says_how_to_cancel_them(
        threaded_server: ThreadedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o.jsonl"
    with RolloutClientSync(threaded_server.address) as client, \
            client.session("someone-else") as other:
        other.submit([{**task(gate=["run"]), "job_id": "not-mine"}])
        watcher = _interrupt_once_running(threaded_server.address, "held-a", "held-b")
        code = main(["submit", str(_held_jobs(tmp_path)), "--out", str(out),
                     "--address", threaded_server.address, "--no-progress"])
        watcher.join(5)
        assert code == 130
        text = capsys.readouterr().out
        client_id = default_client_id(str(out))
        assert "2 job(s) of this run keep running" in text
        command = f"rollout jobs cancel --all-mine --client-id {client_id}"
        assert command in " ".join(text.split())
        assert _states(threaded_server.address, "held-a", "held-b") == ["STATE_RUNNING"] * 2
        # The printed command, as printed, cancels exactly this run's jobs.
        assert main([*command.split()[1:], "--address", threaded_server.address]) == 0
        assert "cancelled 2 job(s)" in capsys.readouterr().out
        assert _states(threaded_server.address, "held-a", "held-b", "not-mine") == [
            "STATE_CANCELLED", "STATE_CANCELLED", "STATE_RUNNING"]
        threaded_server.open_gate("not-mine", "run")


def test_all_mine_needs_a_client_id(threaded_server: ThreadedServer,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["jobs", "cancel", "--all-mine", "--address", threaded_server.address]) == 2
    assert "--all-mine needs --client-id" in capsys.readouterr().err


def test_the_waiting_line_names_the_quietest_unfinished_jobs() -> None:
    specs = [job_pb2.JobSpec(job_id=j) for j in ("a", "b", "c", "d", "e")]
    waiting = _Waiting(specs)
    for j in ("a", "b", "c", "d"):
        waiting.done(j) if j in ("a", "b") else waiting.heard(j, job_pb2.STAGE_RUN, 2)
    line = waiting.line()
    # e was never heard of since submission: it leads; the finished ones are gone.
    assert line.startswith("waiting on e (queued, 0 turns")
    assert "c (RUN, 2 turns" in line and "d (RUN, 2 turns" in line
    assert "a (" not in line and "b (" not in line and "more" not in line
    for j in ("c", "d", "e"):
        waiting.done(j)
    assert waiting.line() == ""
