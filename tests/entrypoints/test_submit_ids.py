"""``rollout submit``: how job ids are made, and what a re-submit of used ids tells the user."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from rollout.client.sync import RolloutClientSync
from rollout.entrypoints.cli import CliError, main
from rollout.entrypoints.submit import load_specs
from tests.client.conftest import ThreadedServer, task
from tests.entrypoints.test_cli import read_out, write_jobs
from tests.util import scaled

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    for name in ("ROLLOUT_ADDRESS", "ROLLOUT_TOKEN", "ROLLOUT_CLIENT_ID", "ROLLOUT_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def _submit(server: ThreadedServer, jobs: Path, out: Path, *flags: str) -> int:
    return main(["submit", str(jobs), "--out", str(out), "--no-progress",
                 "--address", server.address, *flags])


def test_second_submit_reports_earlier_jobs_and_fresh_runs_them_again(
        threaded_server: ThreadedServer, tmp_path: Path, capsys) -> None:
    jobs = write_jobs(tmp_path / "batch.jsonl", task(reward=0.5), task(reward=1.0),
                      task(reward=0.25))
    assert _submit(threaded_server, jobs, tmp_path / "first.jsonl") == 0
    first = read_out(tmp_path / "first.jsonl")
    assert sorted(t.job_id for t in first) == ["batch-1", "batch-2", "batch-3"]
    capsys.readouterr()

    # the same file, another --out (so another session): nothing runs, and it says so
    second_out = tmp_path / "second.jsonl"
    assert _submit(threaded_server, jobs, second_out) == 0
    text = capsys.readouterr().out
    assert second_out.read_text() == ""
    assert ("3 of 3 jobs already ran under the same ids before this submit, so they did not "
            "run again (job ids are <file-stem>-<line>, here batch-<line>; e.g. batch-1)."
            in text)
    assert ("3 belong to another submit (another --out or --client-id): their trajectories "
            "went, or will go, to its --out.") in text
    assert "rejected batch-" not in text and "0 rejected" in text  # not errors of this run
    assert "rollout jobs get batch-1 --trajectory" in text and "--fresh" in text

    # the hint works as printed
    assert main(["jobs", "get", "batch-1", "--trajectory",
                 "--address", threaded_server.address]) == 0
    assert json.loads(capsys.readouterr().out)["trajectory"]["reward"] == 0.5

    # --fresh: new ids, every job runs again, the prefix is printed for resuming
    assert _submit(threaded_server, jobs, second_out, "--fresh") == 0
    text = capsys.readouterr().out
    prefix = re.search(r"--job-prefix (batch-\d{8}T\d{6}-[0-9a-f]{4})", text)
    assert prefix, text
    again = read_out(second_out)
    assert sorted(t.job_id for t in again) == [f"{prefix[1]}-{i}" for i in (1, 2, 3)]
    assert sorted(t.reward for t in again) == sorted(t.reward for t in first)
    assert "already ran" not in text

    # the printed prefix resumes that run: all known, nothing runs a third time
    assert _submit(threaded_server, jobs, tmp_path / "third.jsonl",
                   "--job-prefix", prefix[1]) == 0
    text = capsys.readouterr().out
    assert "3 of 3 jobs already ran" in text and f"job ids are {prefix[1]}-<line>" in text


def _wait_acked(server: ThreadedServer, client_id: str, delivery_id: int) -> None:
    assert server.harness.server is not None and server.harness.server.scheduler is not None
    store = server.harness.server.scheduler.store
    deadline = time.monotonic() + scaled(10)
    while server.call(store.acked_through(client_id)) < delivery_id:
        assert time.monotonic() < deadline, "the ack never became durable"
        time.sleep(0.02)


def test_same_out_resume_says_what_was_written_now(threaded_server: ThreadedServer,
                                                    tmp_path: Path, capsys) -> None:
    """A crash-resume: one trajectory was saved by the first process, one was not."""
    from rollout.entrypoints.submit import default_client_id

    jobs = write_jobs(tmp_path / "c.jsonl", task(), task())
    out = tmp_path / "out.jsonl"
    with RolloutClientSync(threaded_server.address) as client, \
            client.session(default_client_id(str(out))) as s:
        s.submit([{"job_id": "c-1", **task()}, {"job_id": "c-2", **task()}])
        events = s.trajectories()
        saved = next(events)
        s.ack([saved.delivery_id])
        # The first process saved it and its ack is durable; only then does it die.
        _wait_acked(threaded_server, default_client_id(str(out)), saved.delivery_id)
        next(events)  # arrived, never saved
    assert _submit(threaded_server, jobs, out) == 0
    text = capsys.readouterr().out
    assert "2 of 2 jobs already ran" in text
    assert ("2 had finished: 1 written to " + str(out) + " now (the earlier run had not saved "
            "them); 1 delivered before") in text
    assert len(read_out(out)) == 1


def test_job_running_for_another_submit_is_reported(threaded_server: ThreadedServer,
                                                    tmp_path: Path, capsys) -> None:
    jobs = write_jobs(tmp_path / "g.jsonl", task(), task())
    with RolloutClientSync(threaded_server.address) as client, \
            client.session("someone-else") as s:
        s.submit({"job_id": "g-2", **task(gate=["run"])})
        try:
            assert _submit(threaded_server, jobs, tmp_path / "out.jsonl") == 0
        finally:
            threaded_server.open_gate("g-2", "run")
    text = capsys.readouterr().out
    assert "1 of 2 jobs already ran under the same ids" in text and "e.g. g-2" in text
    assert "1 belong to another submit" in text
    assert [t.job_id for t in read_out(tmp_path / "out.jsonl")] == ["g-1"]


def test_first_submit_reports_nothing(
        threaded_server: ThreadedServer, tmp_path: Path, capsys) -> None:
    jobs = write_jobs(tmp_path / "n.jsonl", task(), task(), task())
    out = tmp_path / "out.jsonl"
    assert _submit(threaded_server, jobs, out) == 0
    assert "already ran" not in capsys.readouterr().out
    assert len(read_out(out)) == 3


def test_load_specs_prefixes(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "my file.jsonl", task(), {"job_id": "mine", **task()},
                      {**task(), "group": {"group_id": "grp", "size": 1}})
    assert [s.job_id for s in load_specs(str(jobs))] == ["my_file-1", "mine", "my_file-3"]
    specs = load_specs(str(jobs), job_prefix="p2")
    assert [s.job_id for s in specs] == ["p2-1", "p2-mine", "p2-3"]
    assert specs[2].group.group_id == "p2-grp"
    grouped = load_specs(str(jobs), samples=2, job_prefix="p2")
    assert [s.job_id for s in grouped][:2] == ["p2-1/0", "p2-1/1"]
    assert {s.group.group_id for s in grouped} == {"p2-1", "p2-mine", "p2-grp"}
    with pytest.raises(CliError, match="--job-prefix must be"):
        load_specs(str(jobs), job_prefix="has space")


def test_fresh_and_job_prefix_exclude_each_other_and_help_explains_ids(tmp_path: Path,
                                                                       capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["submit", "f.jsonl", "--out", "o", "--fresh", "--job-prefix", "x"])
    assert info.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["submit", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "<file-stem>-<line number>" in text and "--fresh" in text
    assert "rollout jobs get ID --trajectory" in text
