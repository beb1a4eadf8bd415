"""The user an image's processes run as: its config's ``User``, resolved inside the image.

``User`` is ``""`` (root), a name or a number, optionally with ``:group`` (a name or a
number). Names resolve through the image's own ``/etc/passwd`` and ``/etc/group``, read
beneath the image's root (links never leave it), never the host's: a uid means what the
image says it means. A name the image does not know is the image's fault (``IMAGE_REJECTED``,
as ``docker run`` refuses it), found when the sandbox is made, never during RUN.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rollout.runtime.sandbox import hostfs
from rollout.runtime.sandbox.images.errors import ImageError


@dataclass(frozen=True)
class ImageUser:
    uid: int
    gid: int
    name: str
    """The passwd name, or the number as text when the image has no entry for it."""
    home: str
    """The passwd home directory; ``""`` when the image gives none."""

    @property
    def is_root(self) -> bool:
        return self.uid == 0


ROOT = ImageUser(0, 0, "root", "/root")


@dataclass(frozen=True)
class UserRequest:
    """A user a caller asks an image sandbox to run as instead of its config's ``User`` (a
    Harbor task's ``[agent].user``): the same spellings, resolved in the image the same way;
    ``named_by`` says in a refusal where the name came from, so the task's author can fix it."""

    spec: str
    named_by: str = "the sandbox's user option"


def _table(rootfs: Path, name: str) -> list[list[str]]:
    try:
        text = hostfs.read_beneath(rootfs, f"etc/{name}", 4 << 20).decode("utf-8", "replace")
    except (OSError, ValueError):
        return []
    return [line.split(":") for line in text.splitlines()
            if line and not line.startswith("#") and line.count(":") >= 2]


def _number(text: str) -> int | None:
    return int(text) if text.isdigit() and int(text) < 2**32 - 1 else None


def resolve_user(rootfs: Path, spec: str, *, image: str = "",
                 named_by: str = "its config's User") -> ImageUser:
    """``spec`` (an image config's ``User``, or a user a task asks for, which ``named_by``
    names in the messages) as numbers and a home, from the image's files."""
    spec = spec.strip()
    if not spec:
        return ROOT
    user, _, group = spec.partition(":")
    passwd = _table(rootfs, "passwd")
    entry = next((f for f in passwd if len(f) >= 4 and (f[0] == user or (
        _number(user) is not None and f[2] == user))), None)
    uid = _number(user)
    if uid is None:
        if entry is None or _number(entry[2]) is None:
            raise ImageError(
                f"image {image}: {named_by} {spec!r} names a user that is not in the "
                "image's /etc/passwd; name a user the image creates (useradd) or a number",
                "IMAGE_REJECTED", ref=image)
        uid = int(entry[2])
    if group:
        gid = _number(group)
        if gid is None:
            found = next((f for f in _table(rootfs, "group")
                          if f[0] == group and _number(f[2]) is not None), None)
            if found is None:
                raise ImageError(
                    f"image {image}: {named_by} {spec!r} names a group that is not in "
                    "the image's /etc/group", "IMAGE_REJECTED", ref=image)
            gid = int(found[2])
    else:
        # A uid the image has no entry for gets group 0, as Docker gives it.
        gid = int(entry[3]) if entry is not None and _number(entry[3]) is not None else 0
    name = entry[0] if entry is not None else str(uid)
    home = entry[5] if entry is not None and len(entry) >= 6 else ""
    return ImageUser(uid, gid, name, home)
