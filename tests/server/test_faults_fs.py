"""A full filesystem under the state directory: nothing announced that is not on disk, nothing
lost once space comes back, no delivery id used twice.

The repro of the issue: with the state directory on a full filesystem, 12 of 20 trajectories
were sent (and acked) but never written; after a restart those jobs ran again and were delivered
under re-issued ids. Here the child process (this module run as a script) runs inside its own
user and mount namespace (``unshare -rm``) on a 3 MiB tmpfs, so the kernel's own ENOSPC reaches
SQLite; the parent only reads the child's verdict. Skipped where user namespaces are not
available.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.server.pipeline.subscription import JobFinished, TrajectoryReady
from rollout.server.store import StoreWriteFailed
from tests.server.handlers import running_scheduler, spec
from tests.util import assert_eventually

ROOT = Path(__file__).resolve().parents[2]
JOBS = [f"f{i}" for i in range(20)]


def _fill(path: Path) -> int:
    """Write zeros until the filesystem refuses (ENOSPC); returns the bytes written."""
    n = 0
    with open(path, "wb", buffering=0) as f:
        chunk = b"\0" * 65536
        while True:
            try:
                n += f.write(chunk)
            except OSError:
                for size in (4096, 512, 1):  # take the last crumbs too
                    try:
                        while True:
                            n += f.write(b"\0" * size)
                    except OSError:
                        pass
                return n


async def _child(state: str) -> dict:
    db = Path(state) / "jobs.db"
    filler = Path(state) / "filler"
    out: dict = {}
    # Many turns make each trajectory a few tens of KB, so finishes must grow the WAL.
    specs = [spec(j, gate=["eval"], turns=1500) for j in JOBS]
    async with running_scheduler(db, finish_retry_s=(0.02, 0.1), init_workers=20,
                                 run_workers=20, eval_workers=20) as (sched, handler):
        sub = await sched.attach("t", progress=False)
        await sched.submit(specs, "t")
        await assert_eventually(lambda: all(handler.started(j, "eval") for j in JOBS),
                                timeout=30)
        out["filled"] = _fill(filler)
        for j in JOBS:
            handler.open(j, "eval")
        await assert_eventually(lambda: sched.finish_failures >= 5 or sched.status().pending == 0,
                                timeout=30)
        out["failures_while_full"] = sched.finish_failures
        try:
            await sched.submit([spec("late")], "t")
            out["submit_while_full"] = "accepted"
        except StoreWriteFailed as exc:
            out["submit_while_full"] = exc.reason
        announced = {}
        for ev in sub.drain():
            if isinstance(ev, TrajectoryReady):
                announced[ev.job_id] = ev.delivery_id
        # Every delivery announced while the disk was full is really in the database.
        conn = sqlite3.connect(db)
        stored = dict(conn.execute("SELECT job_id, delivery_id FROM deliveries").fetchall())
        conn.close()
        out["announced_not_stored"] = sorted(j for j, d in announced.items()
                                             if stored.get(j) != d)
        out["announced_while_full"] = len(announced)
        filler.unlink()
        delivered = dict(announced)
        async with asyncio.timeout(30):
            async for ev in sub:
                if isinstance(ev, TrajectoryReady):
                    assert ev.job_id not in delivered, "delivered twice"
                    delivered[ev.job_id] = ev.delivery_id
                elif isinstance(ev, JobFinished) and len(delivered) >= len(JOBS):
                    break
        out["delivered"] = delivered
        out["runs"] = sum(1 for _, s, e in handler.events if s == "init" and e == "start")
    async with running_scheduler(db) as (sched, handler):
        sub = await sched.attach("t", progress=False)
        replay = {}
        async with asyncio.timeout(30):
            async for ev in sub:
                if isinstance(ev, TrajectoryReady):
                    replay[ev.job_id] = ev.delivery_id
                elif isinstance(ev, JobFinished) and len(replay) >= len(JOBS):
                    break
        out["replay"] = replay
        out["reruns"] = sum(1 for _, s, e in handler.events if s == "init")
    return out


@pytest.mark.timeout(120)
def test_full_filesystem_loses_nothing_and_announces_nothing_unwritten(tmp_path):
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare(1) is not installed")
    state = tmp_path / "state"
    state.mkdir()
    script = ('mount -t tmpfs -o size=3m tmpfs "$1" || exit 77; '
              'exec "$2" -m tests.server.test_faults_fs "$1"')
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([unshare, "-rm", "sh", "-c", script, "sh", str(state), sys.executable],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    if proc.returncode == 77 or "Operation not permitted" in proc.stderr[:500]:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["failures_while_full"] > 0, f"the full disk failed no finish: {out}"
    assert out["announced_not_stored"] == [], "announced before it was durable"
    assert out["submit_while_full"] == "STORE_WRITE_FAILED"
    assert sorted(out["delivered"]) == sorted(JOBS), "a job was lost"
    assert sorted(out["delivered"].values()) == list(range(1, len(JOBS) + 1))
    assert out["runs"] == len(JOBS), "a job ran twice"
    assert out["replay"] == out["delivered"], "restart changed a job's delivery id"
    assert out["reruns"] == 0


if __name__ == "__main__":
    print(json.dumps(asyncio.run(_child(sys.argv[1]))), flush=True)
