"""The serve / submit / jobs / status blocks of the README and of docs/getting-started.md, and
the guide's example job line, run as a user types them.

Each block runs from a directory laid out like the repository root after ``scripts/setup.sh``
(``.venv/bin/rollout``, ``runtime/envs/data``), through bash, word for word. What the test
changes is only what a shell's environment can: ``ROLLOUT_SERVER__PORT=0`` (a free port, read
from the line the server prints, so parallel runs and a real server on 50051 are no matter),
``ROLLOUT_ADDRESS`` (that port for the client commands) and ``ROLLOUT_LLM__BACKENDS`` (the
scripted testing policy, answering every task correctly, instead of loading SmolLM2). The server
is the real one: its own process, gRPC on loopback, SQLite, bubblewrap sandboxes.

``.venv/bin/rollout`` there runs ``python -m rollout.entrypoints.cli`` with this interpreter:
the code under test, whichever venv the suite runs in.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout.entrypoints.quickstart import MIX
from rollout.runtime.tasksets.shipped import load_tasks
from tests.docs import block
from tests.entrypoints.test_quickstart import check_quickstart_run
from tests.runtime.envs.conftest import call
from tests.util import scaled

ROOT = Path(__file__).resolve().parents[1]
ROLLOUT = ".venv/bin/rollout"
LISTENING = re.compile(r"rollout service listening on (127\.0\.0\.1:\d+)  \(state: (.*)\)")


def commands(tag: str) -> list[str]:
    lines = [line for line in block(tag).splitlines() if line.strip()]
    assert lines and all(line.startswith(ROLLOUT + " ") for line in lines), (
        f"every command of ```{tag}``` calls {ROLLOUT}, as pasted from the repository root")
    return lines


def subcommand(line: str) -> str:
    return shlex.split(line, comments=True)[1]


class UserShell:
    """A directory laid out like the repository root after set-up, and the environment of a
    shell in it (no ROLLOUT_* settings of the machine running the tests leak in)."""

    def __init__(self, root: Path, script_rows: list[dict[str, object]] | None) -> None:
        """``script_rows``: the scripted policy's answers; None keeps the embedded SmolLM2."""
        self.cwd = root
        (root / ".venv" / "bin").mkdir(parents=True)
        shim = root / ROLLOUT
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m '
                        'rollout.entrypoints.cli "$@"\n')
        shim.chmod(0o755)
        (root / "runtime").symlink_to(ROOT / "runtime")
        keep = {"ROLLOUT_TIMEOUT_SCALE", "ROLLOUT_CACHE_DIR"}
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith("ROLLOUT_") or k in keep}
        self.env.update(COLUMNS="120", ROLLOUT_SERVER__PORT="0", ROLLOUT_SERVER__GRACE_S="1")
        if script_rows is not None:
            script = root / "script.jsonl"
            script.write_text("".join(json.dumps(row) + "\n" for row in script_rows))
            self.env["ROLLOUT_LLM__BACKENDS"] = json.dumps([{"kind": "scripted",
                                                             "file": str(script)}])
        self.server: subprocess.Popen[bytes] | None = None
        self.log = root / "serve.log"
        self.stderr = ""
        """What the last :meth:`run` wrote to its standard error."""

    def serve(self, line: str) -> tuple[str, Path]:
        """Start the server command of a block (the terminal it would hold is a log file);
        returns the address and state directory it printed."""
        assert subcommand(line) == "serve", line
        with self.log.open("wb") as log:
            self.server = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=self.cwd,
                                           env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + scaled(90)
        while not (found := LISTENING.search(self.log.read_text())):
            assert self.server.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, f"no 'listening on' line: {self.log.read_text()}"
            time.sleep(0.1)
        self.env["ROLLOUT_ADDRESS"] = found.group(1)
        return found.group(1), Path(found.group(2))

    def run(self, line: str, timeout: float = 120) -> str:
        res = subprocess.run(["bash", "-c", line], cwd=self.cwd, env=self.env,
                             capture_output=True, text=True, timeout=scaled(timeout))
        assert res.returncode == 0, f"{line}\n{res.stdout}{res.stderr}"
        self.stderr = res.stderr
        return res.stdout

    def ctrl_c(self) -> int:
        assert self.server is not None
        self.server.send_signal(signal.SIGINT)
        code = self.server.wait(scaled(30))
        self.server = None
        return code

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.kill()
            self.server.wait(scaled(30))


@pytest.fixture
def shell_factory(tmp_path: Path) -> Iterator[object]:
    made: list[UserShell] = []

    def make(rows: list[dict[str, object]] | None) -> UserShell:
        made.append(UserShell(tmp_path, rows))
        return made[-1]

    yield make
    for shell in made:
        shell.close()


def math_scripts() -> list[dict[str, object]]:
    # `rollout submit` names a line's job <file stem>-<line number>: math-1 ...
    return [{"job_id": f"math-{n}", "messages": [call("submit", answer=task["answer"])]}
            for n, task in enumerate(load_tasks("math"), 1)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("doc", ["readme", "guide"])
def test_serve_then_submit_jobs_status(doc: str, shell_factory) -> None:
    shell = shell_factory(math_scripts())
    (serve,) = commands(f"bash {doc}-serve")
    address, state = shell.serve(serve)
    assert address.startswith("127.0.0.1:") and state == shell.cwd / ".rollout", (
        "the block's comment: 127.0.0.1, state in ./.rollout")
    client = commands(f"bash {doc}-submit")
    assert [subcommand(line) for line in client] == ["submit", "jobs", "status"], (
        "this test checks each command's output: teach it the block's new commands")
    submit, jobs, status = client
    ids = {f"math-{n}" for n in range(1, len(load_tasks("math")) + 1)}

    said = shell.run(submit)
    out = shell.cwd / "math-trajectories.jsonl"
    trajectories = [json.loads(line) for line in out.read_text().splitlines()]
    assert {t["job_id"] for t in trajectories} == ids
    assert all(t["state"] == "STATE_SUCCEEDED" and t["reward"] == 1 for t in trajectories)
    assert f"{len(ids)} trajectories appended to math-trajectories.jsonl" in said, said

    listed = shell.run(jobs)
    assert set(re.findall(r"\bmath-\d+\b", listed)) == ids, listed
    assert listed.count("SUCCEEDED") == len(ids), listed

    told = shell.run(status)
    assert f"jobs: SUCCEEDED={len(ids)}" in told, told
    assert re.search(r"^environments: .*\bmath\b", told, re.M), told

    # The guide's promise about the same command run again: nothing runs or is written twice.
    again = shell.run(submit)
    assert len(out.read_text().splitlines()) == len(ids)
    assert f"{len(ids)} of {len(ids)} jobs already ran" in again, again

    assert shell.ctrl_c() == 0, shell.log.read_text()  # "Ctrl-C drains and stops"


@pytest.mark.timeout(180)
def test_the_example_job_line_runs(shell_factory) -> None:
    example = json.loads(block("json job-line"))
    shell = shell_factory([{"job_id": example["job_id"],
                            "messages": [call("submit", answer=example["task"]["answer"])]}])
    shell.serve(commands("bash guide-serve")[0])
    (shell.cwd / "job.jsonl").write_text(json.dumps(example) + "\n")
    shell.run(f"{ROLLOUT} submit job.jsonl --out job-out.jsonl --no-progress")
    (trajectory,) = [json.loads(line)
                     for line in (shell.cwd / "job-out.jsonl").read_text().splitlines()]
    assert trajectory["job_id"] == example["job_id"]
    assert trajectory["state"] == "STATE_SUCCEEDED" and trajectory["reward"] == 1, trajectory
    assert trajectory["group_id"] == example["group"]["group_id"]
    assert trajectory["labels"] == example["metadata"]
    assert int(trajectory["seed"]) == example["sampling"]["seed"]


def quickstart_command(tag: str) -> str:
    """The block's command after the set-up it starts with (the set-up being what the test
    environment already is: apt and pip are not for a test to run)."""
    steps = [step.split("#")[0].strip() for line in block(tag).splitlines()
             for step in line.split("&&")]
    steps = [step for step in steps if step]
    assert steps[0] == "bash scripts/setup.sh" and (ROOT / "scripts" / "setup.sh").exists()
    (command,) = steps[1:]
    assert command.startswith(ROLLOUT + " quickstart"), command
    return command


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_the_quickstart_command_as_documented(shell_factory) -> None:
    """All 14 jobs on the embedded SmolLM2, as the README and the guide show it (one command
    for both; run once). Its own RUN limit (600 s) bounds it on a loaded machine: jobs past it
    end in the summary's deadline column, not in a killed test."""
    command = quickstart_command("bash readme-quickstart")
    assert quickstart_command("bash guide-quickstart") == command
    shell = shell_factory(None)
    said = shell.run(command, timeout=900)
    out = shell.cwd / "quickstart-out"
    check_quickstart_run(said, shell.stderr, out, MIX)
    assert MIX == {"math": 8, "code": 4, "swe": 2}, "the 14 jobs the README names"
    # Each run writes a fresh file, and says so (it once said "appended" while replacing it).
    assert "14 trajectories written to" in " ".join(said.split()), said[-2000:]
    assert not (shell.cwd / ".rollout").exists(), "a rollout serve beside it keeps ./.rollout"
