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
Last, memory cgroups that no live process holds (see ``hardening.sweep_memory_cgroups``) go,
and so do the jobs' host temporary folders (:func:`owned_tempdir`, e.g. a Harbor job's
verifier and tests folders) whose owner died: each holds an flock on its ``lock`` file as a
sandbox does, so a folder of another live server on the same host is never touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
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
    temp_dirs: list[str] = field(default_factory=list)
    """Host temporary folders (:func:`owned_tempdir`) of dead owners that were removed."""


OWNED_TEMP_PREFIXES = ("rollout-harbor-",)
"""Name prefixes of the temporary folders :func:`owned_tempdir` makes and the sweep removes."""
_TEMP_LOCK = "lock"


def owned_tempdir(prefix: str, parent: Path | str | None = None) -> tuple[Path, int]:
    """A host temporary folder a job owns, returned with the fd of the flock it holds on
    ``<folder>/lock`` until the owner closes it (or dies): the next start-up sweep of any
    server on this host removes the folder only once nobody holds that lock, so a SIGKILLed
    server's folders go and a live server's stay. ``prefix`` is one of
    :data:`OWNED_TEMP_PREFIXES`."""
    if prefix not in OWNED_TEMP_PREFIXES:
        raise ValueError(f"{prefix!r} is not swept; add it to OWNED_TEMP_PREFIXES")
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    fd = procs.try_flock(root / _TEMP_LOCK)
    if fd is None:  # a fresh 0700 folder of ours: nobody else can hold its lock
        hostfs.rmtree(root)
        raise OSError(f"could not lock the new temporary folder {root}")
    return root, fd


def reap_stale(root: Path | str, uid_lock_dir: Path | str | None = None,
               temp_root: Path | str | None = None) -> ReapReport:
    """Clean every stale sandbox under ``root`` (``SandboxConfig.sandboxes_dir``): detach its
    mounts, kill what still runs under its uid, remove its directory; then remove the memory
    cgroups nobody uses. Blocking: call it before serving, or through ``asyncio.to_thread``.
    ``uid_lock_dir`` defaults to ``SandboxConfig.uid_lock_dir``; ``temp_root``, where the
    dead owners' :func:`owned_tempdir` folders are looked for, to the system's temp folder.

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
    report.temp_dirs = reap_temp_dirs(temp_root)
    if report.removed or report.mounts or report.cgroups or report.killed_uids:
        log.info("swept what a stopped server left under %s: %d sandboxes, %d mounts, %d "
                 "memory cgroups, %d sandbox uids' processes (%d sandboxes still live)", root,
                 len(report.removed), report.mounts, report.cgroups, len(report.killed_uids),
                 len(report.live))
    if report.temp_dirs:
        log.info("removed %d temporary folders of stopped servers: %s", len(report.temp_dirs),
                 ", ".join(report.temp_dirs))
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
        if not _remove(path):
            log.warning("could not remove the stale sandbox %s: files below it belong to "
                        "another user (a rootless server's subordinate uids need its range in "
                        "/etc/subuid and /etc/subgid to be removed)", path)
            return
        report.removed.append(entry)
    finally:
        os.close(lock_fd)


def reap_temp_dirs(parent: Path | str | None = None) -> list[str]:
    """Remove the :func:`owned_tempdir` folders in ``parent`` (the system's temp folder by
    default) whose lock nobody holds: their owner died. One without a lock file is skipped
    (its owner may be between making it and locking it), and so is one this process's user
    does not own: the temp folder is everyone's, and a look-alike another user made there is
    theirs to keep."""
    where = Path(parent or tempfile.gettempdir())
    removed: list[str] = []
    try:
        entries = sorted(os.listdir(where))
    except OSError:
        return removed
    for entry in entries:
        path = where / entry
        if not entry.startswith(OWNED_TEMP_PREFIXES):
            continue
        try:
            info = path.lstat()
        except OSError:
            continue
        if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid()
                or not os.path.lexists(path / _TEMP_LOCK)):
            continue
        fd = procs.try_flock(path / _TEMP_LOCK)
        if fd is None:
            continue
        try:
            if _remove(path, every_entry=True):
                removed.append(str(path))
            else:
                log.warning("could not remove the stale temporary folder %s: files below it "
                            "belong to another user", path)
        except Exception:
            log.exception("could not remove the stale temporary folder %s", path)
        finally:
            os.close(fd)
    return removed


def _remove(path: Path, *, every_entry: bool = False) -> bool:
    """Remove ``path`` (never following a link), including what a rootless server's
    sandbox left owned by its subordinate uids, in a sandbox's own folders or, with
    ``every_entry``, anywhere in ``path`` (a job's temporary folder, where a Harbor agent or
    verifier of the image's user writes); True when it is gone."""
    hostfs.rmtree(path)
    if os.path.lexists(path):
        _remove_mapped(path, every_entry)
        hostfs.rmtree(path)
    return not os.path.lexists(path)


def _remove_mapped(path: Path, every_entry: bool) -> None:
    """What a rootless server's image sandbox left owned by its subordinate uids (the
    image's users' files: the server cannot remove them from outside), removed from inside a
    fresh user namespace of the same mapping, as teardown removes them."""
    if os.geteuid() == 0:
        return
    from rollout.runtime.sandbox.bwrap import MAPPED_PARTS, remove_mapped
    from rollout.runtime.sandbox.images import subids

    ids = subids.server_subids()
    if ids is not None:
        parts = sorted(os.listdir(path)) if every_entry else MAPPED_PARTS
        remove_mapped(path, ids, parts)


def _meta(path: Path) -> dict[str, object]:
    try:
        data = json.loads((path / "meta.json").read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}
