"""The separate verifier's artifact copier (``in_sandbox/harbor_artifacts.py``) run as a plain
process on a scratch tree: what it copies, what it skips, and where it stops. The sandboxed
runs are in ``test_harbor_env.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rollout.runtime.envs.harbor.handler import ARTIFACTS_SOURCE


def run(*args: str) -> tuple[int, dict[str, object]]:
    res = subprocess.run([sys.executable, "-I", "-c", ARTIFACTS_SOURCE.read_text(), *args],
                         capture_output=True, text=True, timeout=60)
    return res.returncode, json.loads(res.stdout.strip().splitlines()[-1])


def test_regular_files_and_folders_go_links_and_fifos_do_not(tmp_path: Path) -> None:
    agent, store, verifier = tmp_path / "agent", tmp_path / "store", tmp_path / "verifier"
    (agent / "app" / "report").mkdir(parents=True)
    store.mkdir()
    verifier.mkdir()
    (agent / "app" / "answer.txt").write_text("42\n")
    (agent / "app" / "answer.txt").chmod(0o4755)  # setuid never travels
    (agent / "app" / "report" / "summary.txt").write_text("by hand\n")
    (agent / "app" / "report" / "etc").symlink_to("/etc")
    (agent / "app" / "report" / "passwd").symlink_to("/etc/passwd")
    os.mkfifo(agent / "app" / "report" / "pipe")
    (agent / "app" / "link.txt").symlink_to(agent / "app" / "answer.txt")
    code, out = run("collect", str(store), "100000", "100", str(agent / "app" / "answer.txt"),
                    str(agent / "app" / "report"), str(agent / "app" / "link.txt"),
                    str(agent / "app" / "missing"))
    assert code == 0 and out["files"] == 2, out
    assert sorted(Path(p).name for p in out["skipped"]) == ["etc", "link.txt", "passwd", "pipe"]
    copied = store / str(agent).lstrip("/") / "app"
    assert (copied / "answer.txt").stat().st_mode & 0o7777 == 0o755
    assert sorted(p.name for p in (copied / "report").iterdir()) == ["summary.txt"]
    code, out = run("restore", str(store), str(verifier))
    assert code == 0 and out["files"] == 2
    assert (verifier / str(agent).lstrip("/") / "app" / "answer.txt").read_text() == "42\n"


def test_the_copy_stops_at_its_budgets(tmp_path: Path) -> None:
    agent, store = tmp_path / "agent", tmp_path / "store"
    store.mkdir()
    (agent / "big").mkdir(parents=True)
    (agent / "big" / "zeros").write_bytes(bytes(5000))
    code, out = run("collect", str(store), "4096", "100", str(agent / "big"))
    assert code == 3 and "over the size" in str(out["error"])
    many = agent / "many"
    many.mkdir()
    for i in range(20):
        (many / str(i)).write_text("x")
    code, out = run("collect", str(store), "100000", "10", str(many))
    assert code == 3 and "more files" in str(out["error"])
    deep = agent / "deep"
    path = deep
    for _ in range(70):
        path = path / "d"
    path.mkdir(parents=True)
    code, out = run("collect", str(store), "100000", "1000", str(deep))
    assert code == 3 and "deeper than 64" in str(out["error"])
