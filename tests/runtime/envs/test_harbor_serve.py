"""Harbor task folders through a real `rollout serve` (a separate process) and `rollout submit`:
job lines from `rollout tasks import-harbor`, images from the loopback registry through the
server's registries.conf mirror, Dockerfiles built by the server on first use. The oracle
earns 1 and the no-op 0 on every task; the scripted model earns a non-binary reward with named
components, and 1 on the task whose test needs its files in system paths."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.images import Registry
from tests.runtime.envs.conftest import call
from tests.runtime.envs.harbor_helpers import FIXTURES
from tests.test_e2e_serve import ROLLOUT, Serve

pytestmark = pytest.mark.slow
TASKS = ("hello-file", "partial-credit", "system-command")
DONE = call("submit", answer="done")


def import_lines(*args: str) -> list[str]:
    res = subprocess.run([*ROLLOUT, "tasks", "import-harbor", *args], capture_output=True,
                         text=True, timeout=120, check=True)
    return res.stdout.splitlines()


@pytest.mark.timeout(900)
def test_oracle_noop_and_model_through_rollout_serve(tmp_path: Path, image_registry: Registry,
                                                    shared_image_cache: Path) -> None:
    dirs = [str(FIXTURES / name) for name in TASKS]
    lines = [*import_lines(*dirs, "--agent", "oracle"), *import_lines(*dirs, "--agent", "noop"),
             *import_lines(str(FIXTURES / "partial-credit"), str(FIXTURES / "system-command")),
             *import_lines(str(FIXTURES / "multi-step"))]
    jobs = tmp_path / "harbor.jsonl"
    jobs.write_text("".join(line + "\n" for line in lines))
    # `rollout submit` names the jobs harbor-<line>: lines 7, 8 and 9 are the model's. The
    # scripted engine starts its script again in each conversation, so the multi-step task's
    # one command does each step's part (the others fail harmlessly where a file is missing).
    every_step = ("printf '#!/bin/sh\\nwc -l < \"$1\" | tr -d \" \"\\n' > /app/count.sh; "
                  "chmod +x /app/count.sh; /app/count.sh /app/words.txt > /app/answer.txt; "
                  "echo 'Run /app/count.sh FILE' > /app/NOTES.md")
    install = ("printf '#!/bin/sh\\necho \"$*!\" | tr a-z A-Z\\n' > /usr/local/bin/shout && "
               "chmod +x /usr/local/bin/shout && echo version=1.0 > /etc/shout.conf")
    script = tmp_path / "script.jsonl"
    script.write_text("".join(json.dumps(row) + "\n" for row in (
        {"job_id": "harbor-7", "messages": [
            call("bash", command="cd /app && echo 27 > sum.txt && echo 99 > max.txt && "
                                 "echo 4 > count.txt"), DONE]},
        {"job_id": "harbor-8", "messages": [call("bash", command=install), DONE]},
        {"job_id": "harbor-9", "messages": [call("bash", command=every_step), DONE]})))
    server = Serve(tmp_path, script)
    # What an operator sets: the folders tasks may name, the image cache and the mirror.
    server.args += ["--set", f"server.task_path_roots={json.dumps([str(FIXTURES)])}",
                    "--set", f"sandbox.image_cache={shared_image_cache}",
                    "--set", f"sandbox.image_registries_conf={image_registry.registries_conf}"]
    server.start()
    try:
        out = tmp_path / "out.jsonl"
        res = subprocess.run([*ROLLOUT, "submit", str(jobs), "--out", str(out), "--address",
                              server.address, "--no-progress"], capture_output=True, text=True,
                             timeout=840)
        assert res.returncode == 0, res.stdout + res.stderr
    finally:
        server.stop()
    trajs = {t["job_id"]: t for t in map(json.loads, out.read_text().splitlines())}
    rewards = {job: t["reward"] for job, t in trajs.items()}
    assert len(trajs) == 9, res.stdout
    assert rewards == {"harbor-1": 1, "harbor-2": 1, "harbor-3": 1,    # oracle
                       "harbor-4": 0, "harbor-5": 0, "harbor-6": 0,    # no-op
                       "harbor-7": pytest.approx(0.6667), "harbor-8": 1,
                       "harbor-9": 1}, {
        job: t.get("error") or t.get("reward_info") or t.get("metadata")
        for job, t in trajs.items()}  # a failed job's error says why (stage, code, message)
    partial = trajs["harbor-7"]
    components: Any = partial.get("reward_components")
    assert components == {"reward": pytest.approx(0.6667), "sum": 1, "max": 0, "count": 1}

    # The multi-step job: one trajectory, a segment per step, each a well-formed sequence.
    from rollout.client.trajectory import flatten_segments, from_json

    steps = from_json(trajs["harbor-9"])
    assert [s.first_turn for s in steps.segments] == [0, 2, 4]
    assert len(flatten_segments(steps)) == 3
    assert steps.reward_components["step:configure"] == 1
