"""The owners an image's layers gave its files, which the rootless unpack keeps only as an xattr.

``umoci raw unpack --rootless`` cannot chown, so every unpacked file belongs to the server's user;
the owner the layer's tar header named (``COPY --chown=app``, a file made by a ``RUN`` after
``USER app``) is kept in the ``user.rootlesscontainers`` extended attribute of that file, in
the format of rootlesscontainers.com (a protobuf ``Resource``: field 1 the uid, field 2 the
gid, both varints; absent = 0; ``0xFFFFFFFF`` = unchanged). Files of root carry none.

A root server hands these owners back where its sandboxes can tell them apart: the files of
the sandbox's image user (and of its group) are chowned, in the job's upper layer, to the
sandbox's own uid, which is that user inside (``bwrap.py``); every other file stays root's.
A rootless server with a subordinate id range (:mod:`.subids`) chowns every recorded owner
inside the sandbox's mapped user namespace; without one it maps the image's user onto its
own, which owns the whole unpacked image, so there the user may write every file
(docs/images.md says so).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator

from rollout.runtime.sandbox.images.user import ImageUser

XATTR = "user.rootlesscontainers"
_UNCHANGED = 0xFFFFFFFF
MAX_OWNED = 1_000_000
"""More recorded owners than this and the rest are ignored (an image is checked for entry
counts well below it)."""


def decode(raw: bytes) -> tuple[int, int] | None:
    """(uid, gid) of one ``user.rootlesscontainers`` value; None when it is not one."""
    fields = {1: 0, 2: 0}
    i = 0
    try:
        while i < len(raw):
            key = raw[i]
            i += 1
            if key & 7 != 0 or key >> 3 not in fields:
                return None
            value, shift = 0, 0
            while True:
                byte = raw[i]
                i += 1
                value |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    break
                if shift > 35:
                    return None
            fields[key >> 3] = value
    except IndexError:
        return None
    uid, gid = (0 if v == _UNCHANGED else v for v in (fields[1], fields[2]))
    return uid, gid


def _walk(rootfs: str) -> Iterator[tuple[str, int, int]]:
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            entries = list(os.scandir(os.path.join(rootfs, rel) if rel else rootfs))
        except OSError:
            continue
        for entry in entries:
            if entry.is_symlink():  # Linux keeps no user.* xattr on a link
                continue
            path = f"{rel}/{entry.name}" if rel else entry.name
            try:
                raw = os.getxattr(entry.path, XATTR, follow_symlinks=False)
            except OSError:
                raw = b""
            owner = decode(raw) if raw else None
            if owner is not None and owner != (0, 0):
                yield path, *owner
            if entry.is_dir(follow_symlinks=False):
                stack.append(path)


@functools.lru_cache(maxsize=64)
def image_owners(rootfs: str) -> tuple[tuple[str, int, int], ...]:
    """(path below the root, uid, gid) of every file the image's layers gave an owner other
    than root. An unpacked image never changes (its directory is named by its digest), so
    this is read once per process; blocking."""
    owned = []
    for item in _walk(rootfs):
        owned.append(item)
        if len(owned) >= MAX_OWNED:
            break
    return tuple(sorted(owned))


def owned_by(rootfs: str, user: ImageUser) -> tuple[tuple[str, bool, bool], ...]:
    """(path, whether its owner is ``user``, whether its group is the user's group) of the
    image's files that are the user's or its group's."""
    return tuple((path, uid == user.uid, gid == user.gid) for path, uid, gid in
                 image_owners(rootfs) if uid == user.uid or gid == user.gid)
