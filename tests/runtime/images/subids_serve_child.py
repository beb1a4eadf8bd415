"""TEST-ONLY: run by test_rootless_images.py as a user with a range in /etc/subuid and
/etc/subgid (no root, no capabilities): the whole way a user runs Harbor tasks, each step a
`rollout` command of its own as that user — `tasks import-harbor`, `serve`, `submit` — on a
Harbor task folder below ``TOP/tasks`` whose image is ``TOP/layout:named`` (User app). Jobs:
the model's (the built-in agent loop, its turns replayed by the scripted backend), the oracle's,
the no-op's, and a harness's (a command that asks the model gateway once over bash's
``/dev/tcp`` and then does the task). Then a crash: the server SIGKILLed while a harness
job's agent has written into its Harbor folder, and restarted (see :func:`crash`). Prints what
it saw as one JSON line."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.util import patience

SOLVE = "#!/bin/sh\necho hello > \"$HOME/greeting.txt\"\n"
TEST = ("#!/bin/sh\nif [ \"$(cat /home/app/greeting.txt 2>/dev/null)\" = hello ]; "
        "then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")
# The harness: one chat request through the job's relay, then the task. HTTP/1.0, so the
# gateway closes the connection after its answer and `cat` ends.
HARNESS = r"""
set -e
port=${OPENAI_BASE_URL#http://127.0.0.1:}; port=${port%/v1}
body='{"model":"policy","messages":[{"role":"user","content":"Greet."}],"max_tokens":16}'
exec 3<>/dev/tcp/127.0.0.1/$port
head='POST /v1/chat/completions HTTP/1.0\r\nHost: 127.0.0.1\r\n'
head="${head}Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
printf "${head}Content-Length: %d\r\n\r\n%s" "$OPENAI_API_KEY" ${#body} "$body" >&3
cat <&3 > "$HOME/reply.txt"
grep -q 'hello from the model' "$HOME/reply.txt"
echo hello > "$HOME/greeting.txt"
"""
SOLVE_TOOL = ("#!/bin/sh\nmkdir -p /usr/local/bin && printf '#!/bin/sh\\necho hi\\n' "
              "> /usr/local/bin/greet && chmod 755 /usr/local/bin/greet\n")
TEST_TOOL = ("#!/bin/sh\nif [ \"$(PATH=/usr/local/bin:$PATH greet 2>/dev/null)\" = hi ]; "
             "then echo '{\"reward\": 0.75, \"greets\": 1}' > /logs/verifier/reward.json; "
             "else echo '{\"reward\": 0, \"greets\": 0}' > /logs/verifier/reward.json; fi\n")
MODEL_TURNS = [
    '<tool_call>\n{"name": "bash", "arguments": {"command": "echo hello > $HOME/greeting.txt"}}'
    "\n</tool_call>",
    '<tool_call>\n{"name": "submit", "arguments": {"answer": "done"}}\n</tool_call>',
]


def main(top: Path, site: str, repo: str) -> dict[str, Any]:
    boot = (f"import site, sys; site.addsitedir({site!r}); sys.path.insert(0, {repo!r}); "
            "from rollout.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))")

    def rollout(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", boot, *args], capture_output=True,
                              text=True, timeout=patience(timeout), cwd=top)

    _task(top / "tasks" / "greet", "Write hello to ~/greeting.txt.\n", SOLVE, TEST,
          f"oci:{top / 'layout'}:named")
    # A program the agent must install in a system path (the image's root may), and a reward
    # that is not 0 or 1, with a named component.
    _task(top / "tasks" / "tool", "Install a `greet` command that prints hi.\n", SOLVE_TOOL,
          TEST_TOOL, f"oci:{top / 'layout'}:root")
    seen: dict[str, Any] = {"euid": os.geteuid()}
    jobs = []
    for agent in ("model", "oracle", "noop"):
        out = top / f"{agent}.jsonl"
        res = rollout("tasks", "import-harbor", str(top / "tasks"), "--agent", agent,
                      "--out", str(out))
        assert res.returncode == 0, res.stderr
        for line in map(json.loads, out.read_text().splitlines()):
            name = line["task"]["name"]
            if agent != "model" or name == "greet":
                jobs.append({**line, "job_id": agent if name == "greet" else f"{agent}-{name}"})
    harness = {"command": ["bash", "-c", HARNESS]}
    jobs.append({**jobs[0], "job_id": "harness", "environment": "harness",
                 "task": {"environment": "harbor", "task": jobs[0]["task"],
                          "harness": harness}})
    (top / "jobs.jsonl").write_text("".join(json.dumps(j) + "\n" for j in jobs))
    script = top / "script.jsonl"
    script.write_text(json.dumps({"job_id": "model", "messages": MODEL_TURNS}) + "\n"
                      + json.dumps({"job_id": "harness",
                                    "messages": ["hello from the model"]}) + "\n")
    server = Server(top, script, boot)
    try:
        address = server.start()
        res = rollout("submit", str(top / "jobs.jsonl"), "--out", str(top / "out.jsonl"),
                      "--address", address, "--no-progress")
        seen["submit"] = [res.returncode, res.stdout[-2000:], res.stderr[-2000:]]
        out = [json.loads(x) for x in (top / "out.jsonl").read_text().splitlines()]
        seen["rewards"] = {t["job_id"]: t.get("reward", 0) for t in out}
        seen["components"] = {t["job_id"]: t.get("reward_components", {}) for t in out}
        seen["turns"] = {t["job_id"]: len(t.get("turns", [])) for t in out}
        seen["metadata"] = {t["job_id"]: t.get("metadata", {}) for t in out}
    finally:
        seen["serve_exit"] = server.stop()
    seen["sandboxes_left"] = _listing(top / "state" / "sandboxes")
    seen["crash"] = crash(top, rollout, boot, jobs[0])
    seen["log_tail"] = server.log_text()[-1500:]
    return seen


def _task(folder: Path, instruction: str, solve: str, test: str, image: str) -> None:
    for sub in ("solution", "tests"):
        (folder / sub).mkdir(parents=True)
    (folder / "instruction.md").write_text(instruction)
    (folder / "solution" / "solve.sh").write_text(solve)
    (folder / "tests" / "test.sh").write_text(test)
    (folder / "task.toml").write_text(
        'version = "1.0"\n[agent]\ntimeout_sec = 120.0\n[verifier]\ntimeout_sec = 120.0\n'
        f'[environment]\ndocker_image = "{image}"\n')


def _listing(folder: Path, prefix: str = "") -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith(prefix)) if folder.is_dir() else []


def _foreign_files(folder: Path) -> list[str]:
    """Files below ``folder`` that belong to a uid other than this process's (the image's
    user: a subordinate uid on the host)."""
    found = []
    for d, dirs, files in os.walk(folder):
        for n in dirs + files:
            with contextlib.suppress(OSError):
                if os.lstat(os.path.join(d, n)).st_uid != os.geteuid():
                    found.append(os.path.relpath(os.path.join(d, n), folder))
    return sorted(found)


def crash(top: Path, rollout: Any, boot: str, model_job: dict[str, Any]) -> dict[str, Any]:
    """SIGKILL the server while a harness job's agent, as the image's user, has written into
    the job's Harbor folder (a subordinate uid's file on the host); the restarted server's
    start-up sweep removes that folder and the dead sandbox; the job is recovered, and once
    it is cancelled and the server stopped nothing of it is left."""
    seen: dict[str, Any] = {}
    tmp, sandboxes = top / "tmp", top / "state" / "sandboxes"
    sleeper = {"command": ["bash", "-c", "echo x > /logs/verifier/agent-was-here && sleep 600"]}
    job = {**model_job, "job_id": "crash", "environment": "harness",
           "task": {"environment": "harbor", "task": model_job["task"], "harness": sleeper}}
    (top / "crash.jsonl").write_text(json.dumps(job) + "\n")
    script = top / "crash-script.jsonl"
    script.write_text("")
    server = Server(top, script, boot)
    address = server.start()
    submit = subprocess.Popen(
        [sys.executable, "-c", boot, "submit", str(top / "crash.jsonl"), "--out",
         str(top / "crash.out.jsonl"), "--address", address, "--no-progress",
         "--on-interrupt", "keep"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=top)
    try:
        deadline = time.monotonic() + 300
        while not _foreign_files(tmp):
            assert time.monotonic() < deadline, ("the agent never wrote its file",
                                                 server.log_text()[-3000:])
            time.sleep(0.5)
        seen["before"] = {"harbor": _listing(tmp, "rollout-harbor-"),
                          "foreign": _foreign_files(tmp), "sandboxes": _listing(sandboxes)}
        server.kill()
    finally:
        submit.kill()
        submit.wait(60)
    seen["after_kill"] = {"harbor": _listing(tmp, "rollout-harbor-"),
                          "sandboxes": _listing(sandboxes)}
    address = server.start()
    seen["after_restart"] = {"harbor": _listing(tmp, "rollout-harbor-"),
                             "sandboxes": _listing(sandboxes)}
    res = rollout("jobs", "cancel", "crash", "--address", address)
    seen["cancel"] = [res.returncode, res.stderr[-1000:]]
    deadline = time.monotonic() + 120
    while True:
        res = rollout("jobs", "show", "crash", "--address", address)
        if "CANCELLED" in res.stdout.upper() or time.monotonic() > deadline:
            break
        time.sleep(1)
    seen["state"] = res.stdout[-1500:]
    seen["log_sweep"] = [x for x in server.log_text().splitlines()
                         if "swept" in x or "temporary" in x or "stale" in x]
    seen["serve_exit"] = server.stop()
    seen["left"] = {"harbor": _listing(tmp, "rollout-harbor-"), "sandboxes": _listing(sandboxes),
                    "tmp_foreign": _foreign_files(tmp)}
    return seen


class Server:
    """`rollout serve` as this user, on ``TOP/state``, with its temporary folders in
    ``TOP/tmp`` (so that the sweep's view of them is this test's alone)."""

    def __init__(self, top: Path, script: Path, boot: str) -> None:
        self.top, self.log = top, top / "serve.log"
        (top / "tmp").mkdir(exist_ok=True)
        backend = json.dumps([{"kind": "scripted", "file": str(script)}])
        self.argv = [
            sys.executable, "-c", boot, "serve", "--port", "0", "--state-dir",
            str(top / "state"), "--set", f"llm.backends={backend}",
            "--set", f"server.task_path_roots={json.dumps([str(top / 'tasks')])}",
            "--set", f"sandbox.image_cache={top / 'cache'}", "--set", "server.grace_s=1"]
        self.proc: subprocess.Popen[bytes] | None = None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def start(self) -> str:
        offset = len(self.log_text())
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.top,
                                         env={**os.environ, "TMPDIR": str(self.top / "tmp")})
        # Stretched by the machine's load: at load 13 on 2 cores the start (imports, the
        # start-up sweep) took longer than a fixed 180 s (a loaded test run, 2026-11-29).
        limit = patience(180)
        deadline = time.monotonic() + limit
        while not (found := re.search(r"listening on 127\.0\.0\.1:(\d+)",
                                      self.log_text()[offset:])):
            assert self.proc.poll() is None, self.log_text()[-3000:]
            assert time.monotonic() < deadline, (
                f"the server did not start within {limit:.0f} s (load "
                f"{os.getloadavg()[0]:.1f}); its log ends:\n{self.log_text()[-3000:]}")
            time.sleep(0.2)
        return f"127.0.0.1:{found.group(1)}"

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(60)

    def stop(self) -> int | str:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return "hung"


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])))
