"""Image references as a task or a job names them, parsed once into a frozen value.

Four transports, spelled as skopeo and buildah spell them, so a reference a user copies from
their own tooling means the same thing here:

- ``docker://REF``: a registry (``docker://python:3.11-slim``,
  ``docker://ghcr.io/org/img@sha256:...``); short names resolve through the user's
  ``registries.conf`` (its mirrors and insecure registries included), as skopeo resolves them.
- ``oci:DIR[:TAG]``: an OCI image layout on disk (``TAG`` defaults to the layout's only image).
- ``oci-archive:FILE``: an OCI layout in a tar file.
- ``docker-archive:FILE``: a ``docker save`` tar file.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from typing import Literal

from rollout.runtime.sandbox.images.errors import ImageError

Transport = Literal["docker", "oci", "oci-archive", "docker-archive"]
TRANSPORTS: tuple[Transport, ...] = ("docker", "oci", "oci-archive", "docker-archive")
MAX_REF_CHARS = 1024
_DIGEST = re.compile(r"@(sha256:[0-9a-f]{64})$")
# A registry reference: name components, an optional :tag, an optional @digest (the grammar of
# the distribution spec, checked loosely; skopeo has the last word).
_REGISTRY_REF = re.compile(
    r"^[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?(?:@sha256:[0-9a-f]{64})?$")


@dataclass(frozen=True)
class ImageRef:
    """One image reference, checked. ``str(ref)`` is what skopeo is given."""

    transport: Transport
    target: str
    """``docker``: the registry reference without ``//``; the others: an absolute path."""
    tag: str = ""
    """``oci:DIR:TAG`` only: the image's tag inside the layout ('' = its only image)."""

    def __str__(self) -> str:
        if self.transport == "docker":
            return f"docker://{self.target}"
        if self.transport == "oci" and self.tag:
            return f"oci:{self.target}:{self.tag}"
        return f"{self.transport}:{self.target}"

    @property
    def pinned_digest(self) -> str:
        """The manifest digest the reference pins (``...@sha256:...``), or ''."""
        m = _DIGEST.search(self.target)
        return m.group(1) if m else ""

    @property
    def is_remote(self) -> bool:
        return self.transport == "docker"

    @property
    def key(self) -> str:
        """A file-name-safe name of the reference (lock files, the ref -> digest index)."""
        return hashlib.sha256(str(self).encode()).hexdigest()[:32]


def parse_image_ref(text: str) -> ImageRef:
    """Parse ``docker://REF``, ``oci:DIR[:TAG]``, ``oci-archive:FILE`` or
    ``docker-archive:FILE``; :class:`ImageError` (``INVALID_IMAGE_REF``) saying what a valid
    reference looks like otherwise. Local paths must be absolute; whether they exist is
    checked when the image is fetched."""
    if not isinstance(text, str) or not text.strip():
        raise _invalid(str(text), "it is empty")
    text = text.strip()
    if len(text) > MAX_REF_CHARS or any(c.isspace() or ord(c) < 0x20 for c in text):
        raise _invalid(text[:80], f"it has whitespace or is over {MAX_REF_CHARS} characters")
    if text.startswith("docker://"):
        target = text[len("docker://"):]
        if not _REGISTRY_REF.match(target):
            raise _invalid(text, "the part after docker:// is not a registry reference "
                                 "(name[:tag][@sha256:digest], lower-case name)")
        return ImageRef("docker", target)
    transport, sep, rest = text.partition(":")
    if not sep or transport not in TRANSPORTS or transport == "docker":
        raise _invalid(text, "it names no known transport")
    tag = ""
    if transport == "oci":
        # oci:DIR:TAG; a DIR holding ':' is not supported (skopeo splits the same way).
        path, _, tag = rest.partition(":")
        if tag and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", tag):
            raise _invalid(text, f"the tag {tag!r} is not a valid tag")
    else:
        path = rest
    if not path.startswith("/"):
        raise _invalid(text, "a local image's path must be absolute")
    return ImageRef(transport, os.path.normpath(path), tag)


def is_image_ref(text: str) -> bool:
    """Whether ``text`` is spelled as one of the four transports (valid or not): what tells an
    image reference from a plain path where both are accepted."""
    return isinstance(text, str) and (text.startswith("docker://") or any(
        text.startswith(t + ":") for t in TRANSPORTS if t != "docker"))


def with_transport(text: str) -> str:
    """``text`` as a reference: as given when it names a transport, else a registry reference
    (``docker://``), as data sets and Docker spell images (``python:3.11-slim``)."""
    text = text.strip()
    return text if is_image_ref(text) else f"docker://{text}"


def _invalid(text: str, why: str) -> ImageError:
    return ImageError(
        f"image reference {text!r} is invalid: {why}. Use docker://NAME[:TAG] (a registry), "
        "oci:/ABS/DIR[:TAG] (an OCI layout), oci-archive:/ABS/FILE.tar or "
        "docker-archive:/ABS/FILE.tar", "INVALID_IMAGE_REF", ref=text)
