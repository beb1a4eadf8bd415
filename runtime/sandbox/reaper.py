"""Start-up cleanup of what a crashed server left behind in ``<state_dir>/sandboxes``.

A live sandbox holds an flock on ``<dir>/lock``; locks vanish with their process, so a dir whose
lock we can take belongs to nobody. Its processes normally died with the server (bwrap's
``--die-with-parent`` and PID namespaces), but as a backstop every process still running under
the dead sandbox's uid is killed — unless that uid has already been handed to a new, live
sandbox. Apptainer instances recorded in the dir are stopped. Then the dir is removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from rollout.runtime.sandbox import hostfs, procs
from rollout.runtime.sandbox.base import SandboxConfig


@dataclass
class ReapReport:
    removed: list[str] = field(default_factory=list)
    """Ids of stale sandboxes that were cleaned up."""
    live: list[str] = field(default_factory=list)
    """Ids skipped because a running server still holds them."""
    killed_uids: list[int] = field(default_factory=list)


def reap_stale(root: Path | str, uid_lock_dir: Path | str | None = None) -> ReapReport:
    """Clean every stale sandbox under ``root`` (``SandboxConfig.sandboxes_dir``). Blocking:
    call it before serving, or through ``asyncio.to_thread``. ``uid_lock_dir`` defaults to
    ``SandboxConfig.uid_lock_dir``."""
    root = Path(root)
    locks = Path(uid_lock_dir) if uid_lock_dir else SandboxConfig.uid_lock_dir
    report = ReapReport()
    if not root.is_dir():
        return report
    for entry in sorted(os.listdir(root)):
        path = root / entry
        if entry.startswith(".") or not path.is_dir() or path.is_symlink():
            continue
        lock_fd = procs.try_flock(path / "lock")
        if lock_fd is None:
            report.live.append(entry)
            continue
        try:
            meta = _meta(path)
            uid = meta.get("uid")
            if isinstance(uid, int):
                lease = procs.UidLease.try_claim(locks, uid)
                if lease is not None:
                    try:
                        if procs.uid_has_processes(uid):
                            procs.kill_uid(uid)
                            report.killed_uids.append(uid)
                    finally:
                        lease.release()
            procs.sweep(str(path / "workspace").encode() + b"\0")
            instance = meta.get("instance")
            exe = shutil.which("singularity")
            if isinstance(instance, str) and exe:
                with contextlib.suppress(Exception):
                    subprocess.run([exe, "instance", "stop", instance], capture_output=True,
                                   timeout=30, check=False)
            hostfs.rmtree(path)
            report.removed.append(entry)
        finally:
            os.close(lock_fd)
    return report


def _meta(path: Path) -> dict[str, object]:
    try:
        data = json.loads((path / "meta.json").read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}
