"""Start-up cleanup of what a crashed server left behind in ``<state_dir>/sandboxes``.

A live sandbox holds an flock on ``<dir>/lock``; locks vanish with their process, so a dir whose
lock we can take belongs to nobody. Its processes normally died with the server (bwrap's
``--die-with-parent`` and PID namespaces), but as a backstop every process still running under
the dead sandbox's uid is killed — unless that uid has already been handed to a new, live
sandbox. Apptainer instances recorded in the dir are stopped. Then the quota tmpfs mounted on
the dir is detached and the dir removed: a server killed with SIGKILL cannot unmount anything
itself, and a mount left there keeps the state dir busy ("Device or resource busy") for good.
A rootless server's image sandbox holds files of the image's users, owned by its subordinate
uids: they are removed from inside a fresh user namespace of the same mapping.
Last, memory cgroups that no live process holds (see ``hardening.sweep_memory_cgroups``) go.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from rollout.runtime.sandbox import hardening, hostfs, procs
from rollout.runtime.sandbox.base import SandboxConfig

log = logging.getLogger(__name__)


@dataclass
class ReapReport:
    removed: list[str] = field(default_factory=list)
    """Ids of stale sandboxes that were cleaned up."""
    live: list[str] = field(default_factory=list)
    """Ids skipped because a running server still holds them."""
    killed_uids: list[int] = field(default_factory=list)
    mounts: int = 0
    """Stale quota mounts detached (a SIGKILLed server cannot unmount its sandboxes')."""
    cgroups: int = 0
    """Memory cgroups removed that no live process used."""


def reap_stale(root: Path | str, uid_lock_dir: Path | str | None = None) -> ReapReport:
    """Clean every stale sandbox under ``root`` (``SandboxConfig.sandboxes_dir``): detach its
    mounts, kill what still runs under its uid, remove its directory; then remove the memory
    cgroups nobody uses. Blocking: call it before serving, or through ``asyncio.to_thread``.
    ``uid_lock_dir`` defaults to ``SandboxConfig.uid_lock_dir``.

    Only below ``root``, and never through a link: a ``root`` that is a symlink is refused
    (its target may be anything), entries that are symlinks are skipped, and removal never
    follows one."""
    root = Path(os.path.abspath(root))
    locks = Path(uid_lock_dir) if uid_lock_dir else SandboxConfig.uid_lock_dir
    report = ReapReport()
    if root.is_symlink():
        log.warning("not sweeping %s: it is a symlink (to %s), and a sweep follows no link",
                    root, os.readlink(root))
        return report
    if root.is_dir():
        for entry in sorted(os.listdir(root)):
            path = root / entry
            if entry.startswith(".") or path.is_symlink() or not path.is_dir():
                continue
            try:
                _reap_one(path, entry, locks, report)
            except Exception:  # one broken entry must not stop the sweep of the others
                log.exception("could not clean the stale sandbox %s", path)
        # A mount whose directory the loop did not clean (an entry it skipped, one that
        # failed half-way) is detached all the same, unless its sandbox is alive.
        prefixes = {str(root) + "/", os.path.realpath(root) + "/"}
        for point in hardening.mounts_below(root):
            below = next((point[len(p):] for p in prefixes if point.startswith(p)), "")
            owner = below.split("/", 1)[0]
            if owner and owner not in report.live:
                report.mounts += hardening.unmount_below(point)
    report.cgroups = hardening.sweep_memory_cgroups(str(root.parent))
    if report.removed or report.mounts or report.cgroups or report.killed_uids:
        log.info("swept what a stopped server left under %s: %d sandboxes, %d mounts, %d "
                 "memory cgroups, %d sandbox uids' processes (%d sandboxes still live)", root,
                 len(report.removed), report.mounts, report.cgroups, len(report.killed_uids),
                 len(report.live))
    return report


def _reap_one(path: Path, entry: str, locks: Path, report: ReapReport) -> None:
    lock_fd = procs.try_flock(path / "lock")
    if lock_fd is None:
        report.live.append(entry)
        return
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
        # A rootless image sandbox's holder carries the sandbox's launch tag (it ends by
        # itself when its server dies; this is the backstop).
        procs.sweep(b"\0ROLLOUT_LAUNCH\0" + entry.encode() + b".")
        instance = meta.get("instance")
        exe = shutil.which("apptainer") or shutil.which("singularity")
        if isinstance(instance, str) and exe:
            with contextlib.suppress(Exception):
                subprocess.run([exe, "instance", "stop", instance], capture_output=True,
                               timeout=30, check=False)
        report.mounts += hardening.unmount_below(path)
        hostfs.rmtree(path)
        if os.path.lexists(path):
            _remove_mapped(path)
            hostfs.rmtree(path)
        if os.path.lexists(path):
            log.warning("could not remove the stale sandbox %s: files below it belong to "
                        "another user (a rootless server's subordinate uids need its range in "
                        "/etc/subuid and /etc/subgid to be removed)", path)
            return
        report.removed.append(entry)
    finally:
        os.close(lock_fd)


def _remove_mapped(path: Path) -> None:
    """What a rootless server's image sandbox left owned by its subordinate uids (the
    image's users' files: the server cannot remove them from outside), removed from inside a
    fresh user namespace of the same mapping, as teardown removes them."""
    if os.geteuid() == 0:
        return
    from rollout.runtime.sandbox.bwrap import remove_mapped
    from rollout.runtime.sandbox.images import subids

    ids = subids.server_subids()
    if ids is not None:
        remove_mapped(path, ids)


def _meta(path: Path) -> dict[str, object]:
    try:
        data = json.loads((path / "meta.json").read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}
