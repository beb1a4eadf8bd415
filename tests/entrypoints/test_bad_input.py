"""Each bad input a new user hit gets one line that says what to fix (issue 22's list): nothing
passes silently, nothing is repeated once per job, nothing prints a bare transport error."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rollout.entrypoints.cli import main
from tests.client.conftest import ThreadedServer, task
from tests.entrypoints.test_cli import read_out, write_jobs


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def _closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_jobs_list_with_a_negative_limit_is_refused(capsys) -> None:
    assert main(["jobs", "list", "--limit", "-1", "--address", f"127.0.0.1:{_closed_port()}"]) == 2
    line = _one_line(capsys)
    assert line == "error: INVALID_ARGUMENT INVALID_FLAG: --limit must be at least 1, got -1"


def test_finish_after_below_zero_fails_once_as_a_flag(tmp_path: Path, capsys) -> None:
    jobs = write_jobs(tmp_path / "f.jsonl", task(), task(), task())
    rc = main(["submit", str(jobs), "--out", str(tmp_path / "o.jsonl"), "--samples", "2",
               "--finish-after", "-2", "--address", f"127.0.0.1:{_closed_port()}"])
    assert rc == 2
    # before any connection: the flag's error, not the unreachable server's
    assert "--finish-after must be at least 0, got -2" in _one_line(capsys)
    assert not (tmp_path / "o.jsonl").exists() or read_out(tmp_path / "o.jsonl") == []


def test_submit_to_a_server_that_is_not_running_says_start_one(tmp_path: Path,
                                                               capsys) -> None:
    jobs = write_jobs(tmp_path / "u.jsonl", task())
    address = f"127.0.0.1:{_closed_port()}"
    assert main(["submit", str(jobs), "--out", str(tmp_path / "o.jsonl"), "--no-progress",
                 "--address", address]) == 2
    line = _one_line(capsys)
    assert line.startswith("error: UNAVAILABLE SERVER_UNREACHABLE: no rollout server answers "
                           f"at {address}; start one with `rollout serve`")


def test_a_missing_token_names_the_flag(tmp_path: Path, capsys) -> None:
    server = ThreadedServer(tmp_path / "state", auth_token="s3cret")
    try:
        assert main(["status", "--address", server.address]) == 2
        missing = _one_line(capsys)
        assert "MISSING_TOKEN" in missing and "pass --token TOKEN" in missing
        assert main(["jobs", "list", "--address", server.address, "--token", "wrong"]) == 2
        wrong = _one_line(capsys)
        assert "BAD_TOKEN" in wrong and "the one given was refused" in wrong
        jobs = write_jobs(tmp_path / "t.jsonl", task())
        assert main(["submit", str(jobs), "--out", str(tmp_path / "o.jsonl"), "--no-progress",
                     "--address", server.address]) == 2
        assert "pass --token TOKEN" in _one_line(capsys)
    finally:
        server.stop()


def test_an_absurd_max_tokens_per_turn_is_rejected_naming_the_field(
        threaded_server: ThreadedServer, tmp_path: Path, capsys) -> None:
    line = {**task(), "sampling": {"max_tokens_per_turn": 100_000_000}}
    jobs = write_jobs(tmp_path / "m.jsonl", line)
    rc = main(["submit", str(jobs), "--out", str(tmp_path / "o.jsonl"), "--no-progress",
               "--address", threaded_server.address])
    out = capsys.readouterr().out
    assert rc == 1
    rejected = [x for x in out.splitlines() if x.startswith("rejected")]
    assert len(rejected) == 1, out
    assert "INVALID_SAMPLING_PARAMS" in rejected[0]
    # The console wraps long lines at its width, which differs between terminals.
    assert ("max_tokens_per_turn (100000000) must not exceed sampling.total_token_budget"
            in " ".join(out.split()))


def test_a_state_dir_that_is_a_file_says_so(tmp_path: Path, capsys) -> None:
    path = tmp_path / "state"
    path.write_text("not a directory\n")
    assert main(["serve", "--state-dir", str(path), "--port", "0"]) == 2
    line = _one_line(capsys)
    assert f"the state directory {path} is a file, not a directory" in line
    assert "writable" not in line and "--state-dir" in line
    assert path.read_text() == "not a directory\n"
    assert main(["serve", "--state-dir", str(path / "below"), "--port", "0"]) == 2
    assert f"{path} is a file" in _one_line(capsys)
