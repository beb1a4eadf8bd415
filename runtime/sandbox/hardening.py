"""Hard resource bounds for bwrap sandboxes: disk quota, aggregate memory cap, seccomp.

- **Disk quota.** Every sandbox's directory (``workspace/`` = ``/workspace``, ``tmp/`` =
  ``/tmp``, ``ctl/`` = ``/.sandbox``) is a size-limited tmpfs mounted on the host, so a job
  that writes without end gets ENOSPC inside its own mount and the state directory's
  filesystem never fills. It is mounted on the host, not with ``bwrap --size --tmpfs``,
  because every command of a sandbox is a separate bwrap launch that must see the same files,
  and the server reads and writes the workspace from the host (editor, checkout). Mounting
  needs CAP_SYS_ADMIN (the server running as root); rootless servers get no quota and a
  warning. Mounts happen through libc (ctypes), never a forked ``mount``: the gRPC server
  process must not fork.
- **Aggregate memory cap.** A memory cgroup shared by all sandboxes of one state directory,
  joined by every launch before bwrap starts, so the sum of all sandboxes (tmpfs pages their
  processes write included) stays below the cap; RLIMIT_AS only bounds one process. Named by
  a hash of the state dir; every process using it holds a shared flock on its directory, so a
  start-up sweep can remove the groups that killed processes left, and only those.
- **seccomp.** A small allow-by-default filter (built with libseccomp through ``pyseccomp``)
  that answers EPERM to what no agent needs and what widens the attack surface on the host
  kernel: namespaces (``unshare``, ``setns``, ``clone`` with any ``CLONE_NEW*`` flag; ``clone3``
  gets ENOSYS so libc falls back to ``clone``, whose flags the filter can read), mounts,
  kernel modules, kexec, BPF, perf events, keyrings, userfaultfd, handle-based opens.
  ``--disable-userns`` would need ``--unshare-user``, which a root server does not use (see
  ``bwrap.py``), so the filter is what keeps user namespaces out in both modes.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import hashlib
import logging
import os
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2
_UMOUNT_NOFOLLOW = 8
_CLONE_NEW_FLAGS = (0x00000080, 0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000,
                    0x20000000, 0x40000000)
"""CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET."""
_DENIED_SYSCALLS = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen",
    "fsmount", "fsconfig", "fspick", "mount_setattr", "swapon", "swapoff", "reboot",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "bpf",
    "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "open_by_handle_at", "name_to_handle_at", "acct", "quotactl", "syslog", "iopl", "ioperm",
    "lookup_dcookie")


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def can_mount() -> bool:
    return os.geteuid() == 0


BYTES_PER_INODE = 8 << 10
"""A sandbox's tmpfs gets one inode per this many bytes of its size (at least
:data:`MIN_INODES`). Each file of a tmpfs pins ~1 KiB of kernel memory that its ``size`` does
not count; the kernel's default (half the machine's pages: 3.1 million here) let one job pin
~3 GiB with empty files (200,000 made in 2 s on this machine, loaded). With this bound a tmpfs
holds at most ~1/8 of its size more than its size."""
MIN_INODES = 4096


def tmpfs_inodes(size_bytes: int) -> int:
    """The inode bound (``nr_inodes``) of a sandbox tmpfs of ``size_bytes``."""
    return max(MIN_INODES, int(size_bytes) // BYTES_PER_INODE)


def mount_quota(path: Path, size_bytes: int) -> None:
    """Mount a tmpfs of ``size_bytes`` and :func:`tmpfs_inodes` files on ``path`` (mode 0711,
    nosuid, nodev)."""
    opts = f"size={int(size_bytes)},nr_inodes={tmpfs_inodes(size_bytes)},mode=0711".encode()
    if _libc().mount(b"tmpfs", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                     opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot mount the sandbox's {size_bytes}-byte tmpfs on {path}: "
                           f"{os.strerror(err)}")


def mount_overlay(lower: Path, upper: Path, work: Path, target: Path, *,
                  metacopy: bool = False) -> None:
    """Mount an overlay of the read-only ``lower`` (an image's cached root) with the writable
    ``upper`` on ``target`` (nosuid, nodev): one per image sandbox, made on the host so that
    every launch of the sandbox binds the same merged root and sees the others' writes.
    ``metacopy``: a chown copies up the file's metadata only, not its data (tried, and
    dropped where the kernel lacks it)."""
    for p in (lower, upper, work):
        if any(c in str(p) for c in ",:\\"):
            raise OSError(errno.EINVAL, f"an overlay layer path may not hold ',', ':' or "
                                        f"a backslash: {p}")
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
    for extra in ((",metacopy=on", "") if metacopy else ("",)):
        if _libc().mount(b"overlay", os.fsencode(target), b"overlay", _MS_NOSUID | _MS_NODEV,
                         (opts + extra).encode()) == 0:
            return
        err = ctypes.get_errno()
    raise OSError(err, f"cannot mount the image overlay on {target}: {os.strerror(err)}")


def mounts_below(path: Path | str) -> list[str]:
    """Mount points at or below ``path`` in this mount namespace, deepest first.

    Matched against both the given and the resolved form of ``path``: mountinfo lists
    canonical paths, so a state dir named through a symlink (``/tmp`` -> ``/private/tmp``)
    would otherwise match nothing and its mounts would outlive every cleanup."""
    prefixes = {os.path.abspath(path), os.path.realpath(path)}
    points = []
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            for line in f:
                point = _unescape(line.split()[4].decode(errors="surrogateescape"))
                if any(point == p or point.startswith(p.rstrip("/") + "/") for p in prefixes):
                    points.append(point)
    except OSError:
        return []
    return sorted(set(points), key=len, reverse=True)


def unmount_below(path: Path | str) -> int:
    """Detach every mount at or below ``path`` (deepest first); returns how many went.

    ``UMOUNT_NOFOLLOW``: a mount point is named by a path string, and a sandbox that could
    swap a directory on that path for a symlink must not get a host mount detached instead."""
    gone = 0
    for point in mounts_below(path):
        if _libc().umount2(os.fsencode(point), _MNT_DETACH | _UMOUNT_NOFOLLOW) == 0:
            gone += 1
            continue
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # already gone
            log.warning("cannot unmount %s: %s", point, os.strerror(err))
    return gone


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


# ----------------------------------------------------------------------------- memory cgroup


def _memory_root() -> tuple[Path, str] | None:
    """(hierarchy root, "v1" | "v2") of a writable memory controller, or None."""
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").exists() and os.access(v1, os.W_OK):
        return v1, "v1"
    v2 = Path("/sys/fs/cgroup")
    try:
        if "memory" in (v2 / "cgroup.controllers").read_text().split() and os.access(
                v2, os.W_OK):
            return v2, "v2"
    except OSError:
        pass
    return None


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


GROUP_PREFIX = "rollout-sb-"
"""Name prefix of the memory cgroups made by this code. Every process whose sandboxes use a
group holds a shared flock on the group's directory, so whoever takes the exclusive lock knows
that no live process uses it: a server's start-up sweep removes such groups whatever state dir
they served (tests' throw-away dirs included), and never a group a live server still needs."""
LEGACY_GROUP_PREFIX = "rollout-sandboxes-"
"""Groups made before the lock existed: only the sweeping server's own one can be known to be
unused (its state dir is locked by that server), so only that one is swept."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_GROUPS: dict[str, tuple[Path | None, int, int]] = {}
"""state dir -> (cgroup.procs or None, fd holding the group's shared lock, live sandboxes of
this process using it)."""
_GROUPS_LOCK = threading.Lock()
_warned_no_cgroup = False


def _state_hash(state_dir: str) -> str:
    return hashlib.sha256(state_dir.encode()).hexdigest()[:12]


def acquire_memory_cgroup(state_dir: str, limit_bytes: int) -> Path | None:
    """The ``cgroup.procs`` file of the memory cgroup all sandboxes of ``state_dir`` join,
    capped at ``limit_bytes``; None (with one warning) where no writable memory controller
    exists. Pair every call with :func:`release_memory_cgroup`: the group is removed when the
    last sandbox using it is gone, so throw-away state dirs (tests) leave no cgroups behind;
    what a killed process leaves, :func:`sweep_memory_cgroups` removes later."""
    global _warned_no_cgroup
    with _GROUPS_LOCK:
        procs, fd, users = _GROUPS.get(state_dir, (None, -1, 0))
        if users == 0:
            procs, fd = _make_group(state_dir, limit_bytes)
            if procs is None and not _warned_no_cgroup:
                _warned_no_cgroup = True
                log.warning("no writable memory cgroup controller: sandboxes run without an "
                            "aggregate memory cap (only RLIMIT_AS per process)")
        _GROUPS[state_dir] = (procs, fd, users + 1)
        return procs


def release_memory_cgroup(state_dir: str) -> None:
    with _GROUPS_LOCK:
        procs, fd, users = _GROUPS.get(state_dir, (None, -1, 0))
        if users > 1:
            _GROUPS[state_dir] = (procs, fd, users - 1)
            return
        _GROUPS.pop(state_dir, None)
        if procs is not None:
            _evict_thread(procs)
            try:
                procs.parent.rmdir()
            except OSError as e:  # EBUSY: a process outlived its sandbox; swept later
                log.debug("memory cgroup %s kept: %s", procs.parent, e)
        if fd >= 0:
            os.close(fd)


def _make_group(state_dir: str, limit_bytes: int) -> tuple[Path | None, int]:
    found = _memory_root()
    if found is None:
        return None, -1
    root, version = found
    group = root / (GROUP_PREFIX + _state_hash(state_dir))
    fd = -1
    try:
        if version == "v2":
            ctl = root / "cgroup.subtree_control"
            if "memory" not in ctl.read_text().split():
                ctl.write_text("+memory")
        for _ in range(5):
            group.mkdir(exist_ok=True)
            fd = os.open(group, _DIR_FLAGS)
            # Blocking: a sweeper holds the exclusive lock only around one rmdir.
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                if os.stat(group, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # swept between our mkdir and our lock: make it again
            fd = -1
        else:
            raise OSError(errno.EAGAIN, "removed by concurrent sweeps five times in a row")
        if version == "v1":
            (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
        else:
            (group / "memory.max").write_text(str(limit_bytes))
            (group / "memory.swap.max").write_text("0")
    except OSError as e:
        if fd >= 0:
            os.close(fd)
        log.warning("cannot set up the sandboxes' memory cgroup %s (%s): no aggregate memory "
                    "cap", group, e)
        return None, -1
    return group / "cgroup.procs", fd


def sweep_memory_cgroups(state_dir: str | None = None) -> int:
    """Remove the memory cgroups no live process uses (killed servers', crashed tests');
    returns how many went. ``state_dir``: also the pre-lock group of that state dir, which the
    caller vouches for (it holds the state dir). A group that still holds processes stays
    (rmdir answers EBUSY); it goes at a later sweep. Blocking (a directory listing)."""
    found = _memory_root()
    if found is None:
        return 0
    root = found[0]
    try:
        names = [n for n in os.listdir(root) if n.startswith(GROUP_PREFIX)]
    except OSError:
        return 0
    if state_dir is not None:
        names.append(LEGACY_GROUP_PREFIX + _state_hash(state_dir))
    swept = 0
    for name in names:
        try:
            fd = os.open(root / name, _DIR_FLAGS)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rmdir(root / name)
            swept += 1
        except BlockingIOError:
            continue  # a live process's sandboxes use it
        except OSError as e:
            log.debug("memory cgroup %s kept: %s", root / name, e)
        finally:
            os.close(fd)
    return swept


# ----------------------------------------------------------------------------- seccomp


@functools.lru_cache(maxsize=4)
def seccomp_program(directory: str) -> Path | None:
    """Write the compiled filter (cBPF, as ``bwrap --seccomp`` reads it) below ``directory``
    once per process; None (with one warning) where libseccomp or pyseccomp is missing."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as e:  # OSError: the bindings load libseccomp.so.2 on import
        log.warning("seccomp filter disabled: pyseccomp/libseccomp unavailable (%s); install "
                    "`pip install pyseccomp` and the libseccomp2 system package", e)
        return None
    try:
        filt = sc.SyscallFilter(sc.ALLOW)
        for name in _DENIED_SYSCALLS:
            try:
                filt.add_rule(sc.ERRNO(errno.EPERM), name)
            except (RuntimeError, ValueError, OSError):  # unknown on this architecture
                continue
        filt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        for flag in _CLONE_NEW_FLAGS:
            filt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        Path(directory).mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".seccomp-")
        with os.fdopen(fd, "wb") as f:
            filt.export_bpf(f)
        out = Path(directory) / "seccomp.bpf"
        os.replace(tmp, out)
        return out
    except Exception as e:  # a broken libseccomp must not stop sandboxes; say so loudly
        log.warning("seccomp filter disabled: could not build it (%s)", e)
        return None


# --------------------------------------------------------------- the spawner thread's group
#
# Joining a cgroup (a write to cgroup.procs) waits for an RCU grace period: about 0.1 ms on an
# idle machine, 2-10 ms on a loaded one, on every launch. A child is born in the cgroup of the
# *thread* that forks it, and cgroup v1 lets one thread join a group alone, so the thread that
# spawns every launch (``procs``' spawner) joins the group once; the launch's prologue then
# sees it is inside already and skips the write. The prologue still checks and joins when not
# (cgroup v2, another group, the thread not moved yet): the cap never depends on this.

_THREAD_GROUP: dict[str, Path | int] = {}
"""The spawner thread's group while it is in one: ``procs`` (its cgroup.procs), ``tid``,
``home`` (the ``tasks`` file of the group it came from)."""


def thread_joined(cgroup_procs: Path) -> bool:
    """Whether the spawner thread is in this group (so launches are born inside it)."""
    return _THREAD_GROUP.get("procs") == cgroup_procs


def join_thread(cgroup_procs: Path) -> bool:
    """Move the calling thread into the (cgroup v1) group of ``cgroup_procs`` when it is in no
    sandbox group yet; True when it is in that group now. Call it from the spawner thread."""
    group = cgroup_procs.parent
    with _GROUPS_LOCK:
        if _THREAD_GROUP:
            return _THREAD_GROUP.get("procs") == cgroup_procs
        root = group.parent
        line = _memory_line("thread-self")
        if line is None or not (group / "tasks").exists() or not (root / "tasks").exists():
            return False  # v2 (no per-thread memory groups) or not ours to move
        home = root / line.split(":", 2)[2].lstrip("/") / "tasks"
        tid = threading.get_native_id()
        try:
            (group / "tasks").write_text(str(tid))
        except OSError as e:
            log.debug("spawner thread stays outside %s: %s", group, e)
            return False
        _THREAD_GROUP.update(procs=cgroup_procs, tid=tid, home=home)
        return True


def _evict_thread(cgroup_procs: Path) -> None:
    """Before the group goes: move the spawner thread back where it came from (called with
    ``_GROUPS_LOCK`` held), else the rmdir fails with EBUSY."""
    if _THREAD_GROUP.get("procs") != cgroup_procs:
        return
    tid, home = _THREAD_GROUP["tid"], _THREAD_GROUP["home"]
    _THREAD_GROUP.clear()
    if not os.path.exists(f"/proc/self/task/{tid}"):
        return  # the thread has ended (interpreter exit): it is in no group any more
    for target in (home, cgroup_procs.parent.parent / "tasks"):
        try:
            Path(str(target)).write_text(str(tid))
            return
        except OSError:
            continue
    log.warning("could not move the sandbox spawner thread out of %s", cgroup_procs.parent)


def _memory_line(which: str) -> str | None:
    """The memory controller's line of ``/proc/<which>/cgroup`` (``ID:memory:/path``)."""
    try:
        with open(f"/proc/{which}/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3 and "memory" in parts[1].split(","):
                    return line.rstrip("\n")
    except OSError:
        return None
    return None


def _inside_test(cgroup_procs: Path) -> str:
    """A ``sh`` test (builtins only: no exec) that is true when the launch's process is in
    the group already: its ``/proc/self/cgroup`` memory line names exactly that group."""
    line = _memory_line("self")
    if line is None:
        return "false"
    hierarchy, controllers = line.split(":", 2)[:2]
    want = f"{hierarchy}:{controllers}:/{cgroup_procs.parent.name}"
    return ('in=; while IFS= read -r l; do [ "$l" = ' + _sh_quote(want)
            + ' ] && in=1; done < /proc/self/cgroup; [ -n "$in" ]')


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def launch_wrapper(cgroup_procs: Path | None, seccomp_file: Path | None,
                   ulimits: str = "") -> list[str]:
    """A ``sh`` prologue that joins the memory cgroup (before anything is forked, so every
    process of the launch is in it) unless it was born inside (see :func:`join_thread`),
    sets the rlimits with builtins (``ulimits``: :meth:`SandboxLimits.ulimit_script`; one
    exec of ``prlimit`` less per launch) and opens the seccomp program on fd 9 for
    ``bwrap --seccomp 9``; it then execs the rest of the line (same pid, so killing the
    launch still works). Fails closed: a launch that cannot join the cgroup or set a limit
    does not run."""
    if cgroup_procs is None and seccomp_file is None and not ulimits:
        return []
    script = []
    if cgroup_procs is not None:
        script.append(f'{_inside_test(cgroup_procs)} || {{ echo $$ > "$1" || exit 125; }}')
    if ulimits:
        script.append(ulimits)
    if seccomp_file is not None:
        script.append('exec 9< "$2" || exit 125')
    script.append('shift 2; exec "$@"')
    # dash, not whatever ``sh`` is: the ulimit flags above are dash's (bash's -p differs).
    return ["dash" if ulimits else "sh", "-c", "; ".join(script), "sh",
            str(cgroup_procs or "-"), str(seccomp_file or "-")]


SECCOMP_FD = "9"
