"""The subordinate uid/gid ranges a rootless server maps into its image sandboxes.

A rootless server owns every file of an unpacked image (``umoci raw unpack --rootless`` cannot
chown), so an image user mapped onto the server's own uid could write all of them. With a
range of ``/etc/subuid`` and ``/etc/subgid`` for the server's user and the setuid helpers
``newuidmap``/``newgidmap`` (Debian's ``uidmap``), the sandbox's user namespace maps uid 0 to
the server's user and uids ``1..count`` to its ranges, as rootless Podman does: the image's
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
import subprocess
from dataclasses import dataclass

log = logging.getLogger(__name__)

SUBUID = "/etc/subuid"
SUBGID = "/etc/subgid"


Range = tuple[int, int]
"""(first host id, how many) of one line of ``/etc/subuid`` or ``/etc/subgid``."""


@dataclass(frozen=True)
class SubIds:
    """The server's user's uid ranges and gid ranges, in file order: inside ids ``1..count``
    map onto them one after the other (inside 0 is the server's own user), as rootless
    Podman maps every range a user has; ``count`` is the smaller of the two totals."""

    uid_ranges: tuple[Range, ...]
    gid_ranges: tuple[Range, ...]
    user: str = ""
    """The server's user's name, for the fix a refusal names."""

    @property
    def count(self) -> int:
        return min(sum(n for _, n in self.uid_ranges), sum(n for _, n in self.gid_ranges))

    def covers(self, uid: int, gid: int) -> bool:
        """Whether an image's uid and gid exist inside a sandbox of this mapping."""
        return 0 <= uid <= self.count and 0 <= gid <= self.count

    def uid_map(self, outer_uid: int) -> list[str]:
        return _map(outer_uid, self.uid_ranges, self.count)

    def gid_map(self, outer_gid: int) -> list[str]:
        return _map(outer_gid, self.gid_ranges, self.count)

    def refusal(self, what: str, uid: int, gid: int) -> str:
        """Why ``what`` (an image's user or a file's owner, ``uid``:``gid``) cannot exist in
        a sandbox of this mapping, and the administrator's fix: a mapped-onto-someone-else
        owner would silently give a user files that are not its own."""
        need = max(uid, gid) - self.count
        first = max(s + n for s, n in (*self.uid_ranges, *self.gid_ranges,
                                       *_all_ranges(SUBUID), *_all_ranges(SUBGID)))
        first = -(-first // 65536) * 65536  # past every user's range, rounded
        last = first + -(-need // 65536) * 65536 - 1
        return (f"{what} ({uid}:{gid}) is beyond the server's subordinate id range: its "
                f"image sandboxes have uids and gids 0..{self.count} (the ranges of "
                f"{self.user or 'its user'} in {SUBUID} and {SUBGID}); add a range of at "
                f"least {need} more ids, e.g. `usermod --add-subuids {first}-{last} "
                f"--add-subgids {first}-{last} {self.user or 'USER'}` (a range no other "
                "user's overlaps), and restart the server")


def _all_ranges(path: str) -> list[Range]:
    """Every user's ranges of ``path`` (where a new range does not overlap them)."""
    try:
        with open(path, encoding="utf-8") as f:
            parts = [line.strip().split(":") for line in f]
    except OSError:
        return []
    return [(int(p[1]), int(p[2])) for p in parts
            if len(p) == 3 and p[1].isdigit() and p[2].isdigit()]


def _map(outer: int, ranges: tuple[Range, ...], count: int) -> list[str]:
    """newuidmap's triplets: inside 0 onto ``outer``, then 1..count onto ``ranges`` in turn."""
    out = ["0", str(outer), "1"]
    inside = 1
    for start, n in ranges:
        take = min(n, count - inside + 1)
        if take <= 0:
            break
        out += [str(inside), str(start), str(take)]
        inside += take
    return out


def _ranges(path: str, names: tuple[str, ...]) -> tuple[Range, ...]:
    """Every (start, count) of ``path`` for one of ``names`` (a name or the uid as text, as
    shadow's tools accept either), in file order."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return ()
    out = []
    for line in lines:
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[0] in names and parts[1].isdigit() and parts[2].isdigit():
            if int(parts[2]) > 0:
                out.append((int(parts[1]), int(parts[2])))
    return tuple(out)


def write_maps(pid: int, ids: SubIds, timeout: float) -> list[str]:
    """Map the new user namespace of process ``pid`` (this server's user's, not yet mapped):
    0 onto the server's user, 1..count onto its ranges (the setuid ``newuidmap`` and
    ``newgidmap``, which check the ranges are this user's); what went wrong, if anything."""
    errors = []
    for tool, args in (("newuidmap", ids.uid_map(os.getuid())),
                       ("newgidmap", ids.gid_map(os.getgid()))):
        done = subprocess.run([tool, str(pid), *args], capture_output=True, timeout=timeout,
                              check=False)
        if done.returncode != 0:
            errors.append(f"{tool}: {done.stderr.decode(errors='replace').strip()[-300:]}")
    return errors


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
    uids, gids = _ranges(SUBUID, names), _ranges(SUBGID, names)
    if not uids or not gids:
        where = " and ".join(p for p, r in ((SUBUID, uids), (SUBGID, gids)) if not r)
        return None, (f"the server's user {name} has no range in {where} (add one, e.g. "
                      f"`usermod --add-subuids 100000-165535 --add-subgids 100000-165535 "
                      f"{name}`)")
    return SubIds(uids, gids, name), ""


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
