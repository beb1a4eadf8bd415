"""The ``rollout`` command line, driven through ``main([...])`` against a real server."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from rollout.client.sync import RolloutClientSync
from rollout.client.trajectory import from_json
from rollout.entrypoints import cli
from rollout.entrypoints.cli import main, resolve_settings
from rollout.entrypoints.submit import default_client_id
from tests.client.conftest import ThreadedServer, task
from tests.util import assert_eventually

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    for name in ("ROLLOUT_ADDRESS", "ROLLOUT_TOKEN", "ROLLOUT_CLIENT_ID", "ROLLOUT_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def write_jobs(path: Path, *lines: dict) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def read_out(path: Path) -> list:
    return [from_json(json.loads(line)) for line in path.read_text().splitlines()]


def test_submit_writes_trajectories_and_summary(threaded_server: ThreadedServer, tmp_path,
                                                capsys) -> None:
    jobs = write_jobs(tmp_path / "batch.jsonl", task(reward=0.5, turns=2),
                      {**task(reward=1.0), "sampling": {"seed": 3}})
    out = tmp_path / "out.jsonl"
    argv = ["submit", str(jobs), "--out", str(out), "--address", threaded_server.address,
            "--samples", "2"]
    assert main(argv) == 0
    trajs = read_out(out)
    assert sorted(t.job_id for t in trajs) == ["batch-1/0", "batch-1/1", "batch-2/0",
                                               "batch-2/1"]
    assert {t.group_id for t in trajs} == {"batch-1", "batch-2"}
    assert sorted(t.reward for t in trajs) == [0.5, 0.5, 1.0, 1.0]
    text = capsys.readouterr().out
    assert "rollout summary" in text and "scripted" in text
    assert "4 trajectories appended" in text
    row = next(line for line in text.splitlines() if line.split()[:1] == ["scripted"])
    # jobs, ok, deadline, fail, cancel, solved, mean reward
    assert row.split()[1:8] == ["4", "4", "0", "0", "0", "2", "0.75"]
    # the same command again: every job is a duplicate, nothing is written twice
    assert main([*argv, "--no-progress"]) == 0
    assert len(read_out(out)) == 4
    assert "4 finished in an earlier run" in capsys.readouterr().out


def test_rerun_after_crash_writes_only_the_missing(threaded_server: ThreadedServer, tmp_path,
                                                   capsys) -> None:
    jobs = write_jobs(tmp_path / "c.jsonl", task(), task())
    out = tmp_path / "out.jsonl"
    client_id = default_client_id(str(out))
    # a "crashed" run: it submitted both jobs and wrote/acked only the first trajectory
    with RolloutClientSync(threaded_server.address) as client, \
            client.session(client_id) as s:
        s.submit([{"job_id": "c-1", **task()}, {"job_id": "c-2", **task()}])
        events = s.trajectories()
        first = next(events)
        out.write_text(json.dumps({"job_id": first.trajectory.job_id}) + "\n")
        s.ack([first.delivery_id])
        next(events)  # the second arrived but the process "died" before writing it
        # The crash this recreates came after the server had the ack. Leaving the session
        # right after writing the ack frame could cancel the stream before the server reads
        # it, and the re-run would then rightly get c-1 again.
        threaded_server.call(assert_eventually(
            lambda: _server_unacked(threaded_server, client_id) == 1,
            message="the server never recorded the ack of the first trajectory"))
    assert main(["submit", str(jobs), "--out", str(out), "--no-progress",
                 "--address", threaded_server.address]) == 0
    lines = [json.loads(line)["job_id"] for line in out.read_text().splitlines()]
    assert sorted(lines) == ["c-1", "c-2"]
    assert "1 trajectories appended" in capsys.readouterr().out


def _server_unacked(server: ThreadedServer, client_id: str) -> int:
    """Deliveries the server holds unacknowledged for ``client_id`` (acks count once
    committed); read on the server's own loop."""
    assert server.harness.server is not None and server.harness.server.scheduler is not None
    return server.harness.server.scheduler.client_stats(client_id)["unacked"]


def test_submit_reports_rejections(threaded_server: ThreadedServer, tmp_path, capsys) -> None:
    jobs = write_jobs(tmp_path / "r.jsonl", task(),
                      {**task(), "sampling": {"temperature": 99}},
                      {"environment": "nope", "task": {}})
    out = tmp_path / "out.jsonl"
    assert main(["submit", str(jobs), "--out", str(out), "--no-progress",
                 "--address", threaded_server.address]) == 1
    assert len(read_out(out)) == 1
    text = capsys.readouterr().out
    assert "r-2: INVALID_ARGUMENT INVALID_SAMPLING_PARAMS" in text
    assert "r-3: NOT_FOUND UNKNOWN_ENVIRONMENT" in text


def test_bad_input_file_is_one_clean_line(tmp_path, capsys) -> None:
    jobs = tmp_path / "bad.jsonl"
    jobs.write_text(json.dumps(task()) + "\n{not json\n")
    assert main(["submit", str(jobs), "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: INVALID_ARGUMENT BAD_INPUT: ") and "bad.jsonl:2" in err
    assert "Traceback" not in err
    assert main(["submit", str(tmp_path / "missing.jsonl"), "--out", "o"]) == 2
    assert capsys.readouterr().err.startswith("error: NOT_FOUND")


def test_unreachable_server(tmp_path, capsys) -> None:
    assert main(["status", "--address", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: UNAVAILABLE ") and "\n" == err[-1] and err.count("\n") == 1


def test_jobs_and_status(threaded_server: ThreadedServer, tmp_path, capsys) -> None:
    addr = ["--address", threaded_server.address]
    with RolloutClientSync(threaded_server.address) as client:
        for _ in client.submit_rollout({"job_id": "done-1", **task(reward=0.5)}):
            pass
        with client.session("holder") as s:
            s.submit({"job_id": "held", **task(gate=["run"])})
            # submit() returns once the frame is written; the listing below goes over another
            # connection, so wait for the server's answer (sent after the job is stored).
            answer = next(f for f in s.events() if f.job_id == "held"
                          and f.WhichOneof("kind") in ("accepted", "rejected"))
            assert answer.WhichOneof("kind") == "accepted", answer
            capsys.readouterr()
            assert main(["jobs", "list", *addr]) == 0
            listing = capsys.readouterr().out
            assert "done-1" in listing and "held" in listing and "SUCCEEDED" in listing
            assert main(["jobs", "list", "--state", "succeeded", *addr]) == 0
            listing = capsys.readouterr().out
            assert "done-1" in listing and "held" not in listing
            assert main(["jobs", "get", "done-1", "--trajectory", *addr]) == 0
            got = json.loads(capsys.readouterr().out)
            assert got["job"]["state"] == "STATE_SUCCEEDED"
            assert got["trajectory"]["reward"] == 0.5
            assert main(["status", *addr]) == 0
            status = capsys.readouterr().out
            for word in ("INIT", "RUN", "EVAL", "SUCCEEDED=1", "scripted"):
                assert word in status
            assert main(["jobs", "cancel", "held", *addr]) == 0
            assert "cancelled 1 job(s): held" in capsys.readouterr().out
            assert main(["jobs", "cancel", "held", *addr]) == 2
            assert capsys.readouterr().err.startswith(
                "error: FAILED_PRECONDITION JOB_ALREADY_FINISHED: ")
            assert main(["jobs", "get", "nope", *addr]) == 2
            assert "error: NOT_FOUND JOB_NOT_FOUND" in capsys.readouterr().err


def test_settings_precedence(tmp_path) -> None:
    cfg = tmp_path / "rollout.toml"
    cfg.write_text('[client]\naddress = "file:1"\ntoken = "file-token"\nclient_id = "file-id"\n'
                   '[server]\nport = 9\n')
    ns = argparse.Namespace(config=str(cfg), address=None, token=None, client_id=None)
    assert resolve_settings(ns, {}) == cli.ClientSettings("file:1", "file-token", "file-id")
    env = {"ROLLOUT_ADDRESS": "env:2", "ROLLOUT_TOKEN": "env-token"}
    assert resolve_settings(ns, env) == cli.ClientSettings("env:2", "env-token", "file-id")
    ns.address, ns.client_id = "flag:3", "flag-id"
    assert resolve_settings(ns, env) == cli.ClientSettings("flag:3", "env-token", "flag-id")
    # $ROLLOUT_CONFIG names the file when --config is absent
    ns2 = argparse.Namespace(config=None, address=None, token=None, client_id=None)
    assert resolve_settings(ns2, {"ROLLOUT_CONFIG": str(cfg)}).address == "file:1"
    assert resolve_settings(ns2, {}) == cli.ClientSettings()
    bad = tmp_path / "bad.toml"
    bad.write_text('[client]\nadress = "typo"\n')
    with pytest.raises(cli.CliError, match="adress"):
        resolve_settings(argparse.Namespace(config=str(bad)), {})


def test_settings_precedence_end_to_end(threaded_server: ThreadedServer, tmp_path,
                                        monkeypatch, capsys) -> None:
    cfg = tmp_path / "rollout.toml"
    cfg.write_text('[client]\naddress = "127.0.0.1:1"\n')
    monkeypatch.setenv("ROLLOUT_CONFIG", str(cfg))
    assert main(["status"]) == 2  # the file's (dead) address is used
    capsys.readouterr()
    monkeypatch.setenv("ROLLOUT_ADDRESS", threaded_server.address)
    assert main(["status"]) == 0  # env beats file
    monkeypatch.setenv("ROLLOUT_ADDRESS", "127.0.0.1:1")
    assert main(["status", "--address", threaded_server.address]) == 0  # flag beats env


def test_serve_flags_become_overrides(monkeypatch, tmp_path) -> None:
    import rollout.server.app

    seen = {}

    async def fake_serve(cfg):
        seen["cfg"] = cfg

    monkeypatch.setattr(rollout.server.app, "serve", fake_serve)
    conf = tmp_path / "s.toml"
    conf.write_text("[server]\nport = 1111\nhost = \"0.0.0.0\"\n[pipeline]\nrun_workers = 3\n"
                    "[client]\naddress = \"x:1\"\n")
    monkeypatch.setenv("ROLLOUT_SERVER__PORT", "2222")
    monkeypatch.setenv("ROLLOUT_PIPELINE__RUN_WORKERS", "5")
    assert main(["serve", "--config", str(conf), "--port", "3333", "--token", "t",
                 "--state-dir", str(tmp_path / "st"), "--set", "pipeline.eval_workers=7"]) == 0
    cfg = seen["cfg"]
    assert cfg.server.port == 3333 and cfg.server.host == "0.0.0.0"
    assert cfg.pipeline.run_workers == 5 and cfg.pipeline.eval_workers == 7
    assert cfg.server.auth_token == "t" and cfg.server.state_dir == str(tmp_path / "st")
    assert main(["serve", "--set", "nope.key=1"]) == 2


def test_lazy_delegates(monkeypatch) -> None:
    import sys
    import types

    calls = []
    for name in ("rollout.entrypoints.quickstart", "rollout.benchmarks.tools"):
        mod = types.ModuleType(name)
        mod.main = lambda argv, name=name: calls.append((name, argv)) or 0  # type: ignore
        monkeypatch.setitem(sys.modules, name, mod)
    assert main(["quickstart", "--fast"]) == 0
    assert main(["bench", "tools", "--n", "3"]) == 0
    assert calls == [("rollout.entrypoints.quickstart", ["--fast"]),
                     ("rollout.benchmarks.tools", ["--n", "3"])]
