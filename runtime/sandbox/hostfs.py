"""Host-side file access to a sandbox's directories that a hostile sandbox cannot redirect.

The server (often root) reads and writes workspace files on the host. A sandboxed process can
plant a symlink ``workspace/x -> /etc/passwd``; a naive ``open(workspace / "x", "w")`` would
then overwrite a host file. Every path here is walked one component at a time with
``O_NOFOLLOW`` relative to the workspace's directory fd, and ``..`` is refused.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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


def read_beneath(root: Path, rel_path: str) -> bytes:
    parts = _components(rel_path)
    dfd = _open_parent(root, parts, create=False, owner=None)
    try:
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except OSError as e:
            if e.errno == 40:  # ELOOP
                raise PermissionError(f"{rel_path!r} is a symlink; not followed") from e
            raise
        with os.fdopen(fd, "rb") as f:
            if stat.S_ISDIR(os.fstat(f.fileno()).st_mode):
                raise IsADirectoryError(rel_path)
            return f.read()
    finally:
        os.close(dfd)


def write_beneath(root: Path, rel_path: str, data: bytes, mode: int = 0o644,
                  owner: tuple[int, int] | None = None) -> None:
    parts = _components(rel_path)
    dfd = _open_parent(root, parts, create=True, owner=owner)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(parts[-1], flags, mode, dir_fd=dfd)
        except OSError as e:
            if e.errno == 40:
                raise PermissionError(f"{rel_path!r} is a symlink; not followed") from e
            raise
        with os.fdopen(fd, "wb") as f:
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


def exists_beneath(root: Path, rel_path: str) -> bool:
    try:
        read_beneath(root, rel_path)
        return True
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return False


def rmtree(path: Path) -> None:
    """Remove a sandbox directory even if the sandbox chmod-ed parts of it to 000."""
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
