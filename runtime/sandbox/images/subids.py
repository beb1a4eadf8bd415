"""The subordinate uid/gid ranges a rootless server maps into its image sandboxes.

A rootless server owns every file of an unpacked image (``umoci unpack --rootless`` cannot
chown), so an image user mapped onto the server's own uid could write all of them. With a
range of ``/etc/subuid`` and ``/etc/subgid`` for the server's user and the setuid helpers
``newuidmap``/``newgidmap`` (Debian's ``uidmap``), the sandbox's user namespace maps uid 0 to
the server's user and uids ``1..count`` to the range, as rootless Podman does: the image's
uids exist inside as themselves, the files the image gave a user are chowned to it in the
job's upper layer, and a user other than root cannot write root's files.

Without a range or the helpers the server keeps the single-uid mapping and says so once.
"""

from __future__ import annotations

import functools
import logging
import os
import pwd
import shutil
from dataclasses import dataclass

log = logging.getLogger(__name__)

SUBUID = "/etc/subuid"
SUBGID = "/etc/subgid"


@dataclass(frozen=True)
class SubIds:
    """One uid range and one gid range of the server's user: inside ids ``1..count`` map
    onto ``uid_start..`` and ``gid_start..`` (inside 0 is the server's own user)."""

    uid_start: int
    gid_start: int
    count: int

    def covers(self, uid: int, gid: int) -> bool:
        """Whether an image's uid and gid exist inside a sandbox of this mapping."""
        return 0 <= uid <= self.count and 0 <= gid <= self.count

    def uid_map(self, outer_uid: int) -> list[str]:
        return ["0", str(outer_uid), "1", "1", str(self.uid_start), str(self.count)]

    def gid_map(self, outer_gid: int) -> list[str]:
        return ["0", str(outer_gid), "1", "1", str(self.gid_start), str(self.count)]


def _range(path: str, names: tuple[str, ...]) -> tuple[int, int] | None:
    """(start, count) of the first entry of ``path`` for one of ``names`` (a name or the
    uid as text, as shadow's tools accept either)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[0] in names and parts[1].isdigit() and parts[2].isdigit():
            if int(parts[2]) > 0:
                return int(parts[1]), int(parts[2])
    return None


def lookup(uid: int) -> tuple[SubIds | None, str]:
    """(the mapping of user ``uid``, or None and why not)."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    names = (name, str(uid))
    missing = [tool for tool in ("newuidmap", "newgidmap") if shutil.which(tool) is None]
    if missing:
        return None, (f"{' and '.join(missing)} is missing (Debian/Ubuntu: apt-get install "
                      "uidmap)")
    uids, gids = _range(SUBUID, names), _range(SUBGID, names)
    if uids is None or gids is None:
        where = " and ".join(p for p, r in ((SUBUID, uids), (SUBGID, gids)) if r is None)
        return None, (f"the server's user {name} has no range in {where} (add one, e.g. "
                      f"`usermod --add-subuids 100000-165535 --add-subgids 100000-165535 "
                      f"{name}`)")
    return SubIds(uids[0], gids[0], min(uids[1], gids[1])), ""


@functools.lru_cache(maxsize=1)
def server_subids() -> SubIds | None:
    """This rootless server's mapping, looked up once; when there is none, one warning says
    what image sandboxes lose and how to get it."""
    ids, why = lookup(os.geteuid())
    if ids is None:
        log.warning("image sandboxes: %s, so an image user maps onto the server's own user and "
                    "can write every file of the image, root's included (docs/images.md, "
                    "'Image file owners')", why)
    return ids
