"""TEST-ONLY: run by test_rootless_images.py as a user with a range in /etc/subuid and
/etc/subgid (no root, no capabilities): the whole way a user runs Harbor tasks, each step a
`rollout` command of its own as that user — `tasks import-harbor`, `serve`, `submit` — on a
Harbor task folder below ``TOP/tasks`` whose image is ``TOP/layout:named`` (User app). Jobs:
the model's (the built-in agent loop, its turns replayed by the scripted backend), the oracle's,
the no-op's, and a harness's (a command that asks the model gateway once over bash's
``/dev/tcp`` and then does the task). Prints what it saw as one JSON line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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
                              text=True, timeout=timeout, cwd=top)

    task = top / "tasks" / "greet"
    for sub in ("solution", "tests"):
        (task / sub).mkdir(parents=True)
    (task / "instruction.md").write_text("Write hello to ~/greeting.txt.\n")
    (task / "solution" / "solve.sh").write_text(SOLVE)
    (task / "tests" / "test.sh").write_text(TEST)
    (task / "task.toml").write_text(
        'version = "1.0"\n[agent]\ntimeout_sec = 120.0\n[verifier]\ntimeout_sec = 120.0\n'
        f'[environment]\ndocker_image = "oci:{top / "layout"}:named"\n')
    seen: dict[str, Any] = {"euid": os.geteuid()}
    jobs = []
    for agent in ("model", "oracle", "noop"):
        out = top / f"{agent}.jsonl"
        res = rollout("tasks", "import-harbor", str(top / "tasks"), "--agent", agent,
                      "--out", str(out))
        assert res.returncode == 0, res.stderr
        line = json.loads(out.read_text().splitlines()[0])
        jobs.append({**line, "job_id": agent})
    harness = {"command": ["bash", "-c", HARNESS]}
    jobs.append({**jobs[0], "job_id": "harness", "environment": "harness",
                 "task": {"environment": "harbor", "task": jobs[0]["task"],
                          "harness": harness}})
    (top / "jobs.jsonl").write_text("".join(json.dumps(j) + "\n" for j in jobs))
    script = top / "script.jsonl"
    script.write_text(json.dumps({"job_id": "model", "messages": MODEL_TURNS}) + "\n"
                      + json.dumps({"job_id": "harness",
                                    "messages": ["hello from the model"]}) + "\n")
    backend = json.dumps([{"kind": "scripted", "file": str(script)}])
    log = (top / "serve.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-c", boot, "serve", "--port", "0", "--state-dir", str(top / "state"),
         "--set", f"llm.backends={backend}",
         "--set", f"server.task_path_roots={json.dumps([str(top / 'tasks')])}",
         "--set", f"sandbox.image_cache={top / 'cache'}", "--set", "server.grace_s=1"],
        stdout=log, stderr=subprocess.STDOUT, cwd=top)
    try:
        deadline = time.monotonic() + 180
        while not (found := re.search(r"listening on 127\.0\.0\.1:(\d+)",
                                      (top / "serve.log").read_text(errors="replace"))):
            assert server.poll() is None, (top / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        res = rollout("submit", str(top / "jobs.jsonl"), "--out", str(top / "out.jsonl"),
                      "--address", f"127.0.0.1:{found.group(1)}", "--no-progress")
        seen["submit"] = [res.returncode, res.stdout[-2000:], res.stderr[-2000:]]
        out = [json.loads(x) for x in (top / "out.jsonl").read_text().splitlines()]
        seen["rewards"] = {t["job_id"]: t.get("reward", 0) for t in out}
        seen["turns"] = {t["job_id"]: len(t.get("turns", [])) for t in out}
        seen["metadata"] = {t["job_id"]: t.get("metadata", {}) for t in out}
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            seen["serve_exit"] = server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            seen["serve_exit"] = "hung"
        log.close()
    sandboxes = top / "state" / "sandboxes"
    seen["sandboxes_left"] = sorted(os.listdir(sandboxes)) if sandboxes.is_dir() else []
    seen["log_tail"] = (top / "serve.log").read_text(errors="replace")[-1500:]
    return seen


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])))
