"""Host-side file access to a sandbox's directories that a hostile sandbox cannot redirect.

The server (often root) reads and writes workspace files on the host. A sandboxed process can
plant a symlink ``workspace/x -> /etc/passwd``; a naive ``open(workspace / "x", "w")`` would
then overwrite a host file. Every path here is walked one component at a time with
``O_NOFOLLOW`` relative to the workspace's directory fd, and ``..`` is refused.

Only regular files are read or written. A sandbox can ``mkfifo`` a name the server then opens:
a plain ``open()`` of a FIFO waits for a writer forever, holding a worker thread, and a few
such jobs exhaust the thread pool every sandbox shares. Files are therefore opened with
``O_NONBLOCK`` (a FIFO opens at once) and checked with ``fstat`` before a byte moves; a write
truncates only after that check. Reads are capped: a sparse file can claim terabytes while
occupying no space in the sandbox's quota.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
MAX_READ_BYTES = 64 << 20
"""Default cap of :func:`read_beneath`; larger files raise :class:`FileTooLarge`."""


class SpecialFileError(PermissionError):
    """The path names a FIFO, socket or device: never opened for reading or writing."""


class FileTooLarge(PermissionError):
    """The file is larger than the caller's read cap."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _open_regular(dfd: int, name: str, rel_path: str, flags: int, mode: int = 0o644) -> int:
    """Open ``name`` below ``dfd`` without following a link or blocking on a special file;
    the fd is guaranteed to be a regular file (directories raise IsADirectoryError)."""
    try:
        fd = os.open(name, flags | _FILE_FLAGS, mode, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PermissionError(f"{rel_path!r} is a symlink; not followed") from e
        if e.errno == errno.ENXIO:  # a FIFO opened for writing with no reader
            raise SpecialFileError(f"{rel_path!r} is a FIFO; only regular files are "
                                   "read or written") from e
        raise
    try:
        st_mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(st_mode):
            raise IsADirectoryError(rel_path)
        if not stat.S_ISREG(st_mode):
            raise SpecialFileError(f"{rel_path!r} is {_kind(st_mode)}; only regular files "
                                   "are read or written")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _components(rel_path: str) -> list[str]:
    parts = [p for p in rel_path.split("/") if p not in ("", ".")]
    if not parts:
        raise IsADirectoryError(f"{rel_path!r} names the workspace itself, not a file")
    if ".." in parts:
        raise PermissionError(f"{rel_path!r} leaves the workspace ('..' is not allowed)")
    if rel_path.startswith("/"):
        raise PermissionError(f"{rel_path!r} is outside the workspace")
    return parts


def _open_parent(root: Path, parts: list[str], create: bool,
                 owner: tuple[int, int] | None) -> int:
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                if owner is not None:
                    os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:  # ELOOP: a symlink where a directory was expected
                raise PermissionError(f"{'/'.join(parts)!r}: {part!r} is not a plain "
                                      f"directory ({e.strerror})") from e
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_beneath(root: Path, rel_path: str, max_bytes: int = MAX_READ_BYTES) -> bytes:
    parts = _components(rel_path)
    dfd = _open_parent(root, parts, create=False, owner=None)
    try:
        fd = _open_regular(dfd, parts[-1], rel_path, os.O_RDONLY)
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise FileTooLarge(f"{rel_path!r} is {size} bytes; at most {max_bytes} are read")
            data = f.read(max_bytes + 1)  # the file may grow between fstat and read
            if len(data) > max_bytes:
                raise FileTooLarge(f"{rel_path!r} is over {max_bytes} bytes")
            return data
    finally:
        os.close(dfd)


def kind_beneath(root: Path, rel_path: str) -> str | None:
    """``"dir"``, ``"file"`` (regular), ``"link"``, ``"other"`` or None (missing) for a path
    below ``root``, without following any link on the way."""
    parts = [p for p in rel_path.split("/") if p not in ("", ".")]
    if not parts:
        return "dir"
    try:
        dfd = _open_parent(root, _components(rel_path), create=False, owner=None)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        st_mode = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    finally:
        os.close(dfd)
    if stat.S_ISLNK(st_mode):
        return "link"
    if stat.S_ISDIR(st_mode):
        return "dir"
    return "file" if stat.S_ISREG(st_mode) else "other"


def write_beneath(root: Path, rel_path: str, data: bytes, mode: int = 0o644,
                  owner: tuple[int, int] | None = None) -> None:
    parts = _components(rel_path)
    dfd = _open_parent(root, parts, create=True, owner=owner)
    try:
        # No O_TRUNC: truncate only once fstat has shown a regular file.
        fd = _open_regular(dfd, parts[-1], rel_path, os.O_WRONLY | os.O_CREAT, mode)
        with os.fdopen(fd, "wb") as f:
            os.ftruncate(f.fileno(), 0)
            f.write(data)
            if owner is not None:
                os.fchown(f.fileno(), *owner)
    finally:
        os.close(dfd)


def unlink_beneath(root: Path, rel_path: str) -> None:
    parts = _components(rel_path)
    dfd = _open_parent(root, parts, create=False, owner=None)
    try:
        os.unlink(parts[-1], dir_fd=dfd)
    finally:
        os.close(dfd)


def rmtree(path: Path) -> None:
    """Remove a sandbox directory even if the sandbox chmod-ed parts of it to 000, after
    detaching the quota tmpfs mounted on it (else only its contents would go)."""
    from rollout.runtime.sandbox.hardening import unmount_below

    unmount_below(path)
    def fix(func: object, p: str, exc: object) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)
    if os.path.lexists(path):
        shutil.rmtree(path, onerror=fix)
        if os.path.lexists(path):
            shutil.rmtree(path, ignore_errors=True)


def chown_tree(path: Path | str, uid: int, gid: int) -> int:
    """Give ``path`` and, when it is a directory, everything below it to ``uid``:``gid``
    (links themselves, never their targets; directories opened relative to their parent's fd
    without following links, so a link swapped in for a directory cannot lead the walk out);
    returns how many entries could not be changed."""
    failed = 0
    try:
        os.chown(path, uid, gid, follow_symlinks=False)
    except OSError:
        failed += 1
    if not os.path.isdir(path) or os.path.islink(path):
        return failed
    for _, dirs, files, dfd in os.fwalk(path, follow_symlinks=False):
        for name in dirs + files:
            try:
                os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                failed += 1
    return failed


class TreeTooLarge(OSError):
    """A copied tree exceeds the byte or entry budget the caller gave."""


def copy_tree(src: Path, dst: Path, *, owner: tuple[int, int] | None = None,
              skip: frozenset[str] = frozenset(), max_bytes: int = 1 << 30,
              max_entries: int = 200_000) -> int:
    """Copy a directory a sandbox wrote into the existing empty directory ``dst``; returns the
    bytes copied.

    Only regular files, directories and symlinks (as links, never followed) are copied;
    FIFOs, sockets and devices are dropped, since a FIFO would block a reader. Entries are
    opened with ``O_NOFOLLOW`` relative to their parent's fd, so a link planted where a
    directory was expected cannot send the copy elsewhere on the host. ``skip`` names
    top-level entries to leave out (``.git``). Call it only when no process of the sandbox
    runs any more, so the tree cannot change under the walk.
    """
    budget = {"bytes": max_bytes, "entries": max_entries}
    src_fd = os.open(src, _DIR_FLAGS)
    dst_fd = os.open(dst, _DIR_FLAGS)
    try:
        return _copy_dir(src_fd, dst_fd, owner, skip, budget)
    finally:
        os.close(src_fd)
        os.close(dst_fd)


def _copy_dir(src_fd: int, dst_fd: int, owner: tuple[int, int] | None,
              skip: frozenset[str], budget: dict[str, int]) -> int:
    copied = 0
    for name in sorted(os.listdir(src_fd)):
        if name in skip:
            continue
        budget["entries"] -= 1
        if budget["entries"] < 0:
            raise TreeTooLarge("the workspace has too many files to grade")
        st = os.stat(name, dir_fd=src_fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(name, dir_fd=src_fd), name, dir_fd=dst_fd)
            if owner is not None:
                os.chown(name, *owner, dir_fd=dst_fd, follow_symlinks=False)
        elif stat.S_ISDIR(st.st_mode):
            os.mkdir(name, 0o755, dir_fd=dst_fd)
            if owner is not None:
                os.chown(name, *owner, dir_fd=dst_fd, follow_symlinks=False)
            sub_src = os.open(name, _DIR_FLAGS, dir_fd=src_fd)
            try:
                sub_dst = os.open(name, _DIR_FLAGS, dir_fd=dst_fd)
                try:
                    copied += _copy_dir(sub_src, sub_dst, owner, frozenset(), budget)
                finally:
                    os.close(sub_dst)
            finally:
                os.close(sub_src)
        elif stat.S_ISREG(st.st_mode):
            budget["bytes"] -= st.st_size
            if budget["bytes"] < 0:
                raise TreeTooLarge("the workspace is too large to grade")
            # Checked again on the fd: a FIFO swapped in after the stat must not block us.
            fd_in = _open_regular(src_fd, name, name, os.O_RDONLY)
            try:
                mode = 0o755 if st.st_mode & 0o111 else 0o644
                fd_out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, mode, dir_fd=dst_fd)
                try:
                    while chunk := os.read(fd_in, 1 << 20):
                        view = memoryview(chunk)
                        while view:
                            view = view[os.write(fd_out, view):]
                        copied += len(chunk)
                    if owner is not None:
                        os.fchown(fd_out, *owner)
                finally:
                    os.close(fd_out)
            finally:
                os.close(fd_in)
    return copied
