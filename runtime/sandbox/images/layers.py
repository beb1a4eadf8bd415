"""The check every layer passes before ``umoci`` unpacks it: one verdict per image.

umoci extracts safely (it resolves every path inside the root), but "safely clamped" is not
"what the image meant": a layer that names ``../../etc/passwd``, writes through a symlink it
planted, carries a device node or a hard link into another layer, or expands to terabytes is
a broken or hostile task, and it gets a clear refusal naming the entry instead of a rootfs that
silently differs. The check reads only tar headers (data is streamed past, never written), so
a tar bomb is stopped at the budget before a byte of it lands on disk.

What is accepted: absolute symlink targets (``/etc/alternatives/...`` links are in every Debian
image; inside the sandbox they resolve inside the image's root, and host code never follows a
link of a rootfs); FIFOs; setuid/setgid bits, which ``setuid="strip"`` (the default) removes
after the unpack and ``setuid="refuse"`` refuses (the sandbox's root is mounted ``nosuid``
either way, so the bits never grant anything).
"""

from __future__ import annotations

import json
import stat
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from rollout.runtime.sandbox.images.errors import ImageError

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass(frozen=True)
class LayerPolicy:
    max_image_bytes: int = 8 << 30
    """Largest unpacked size of one image (the sum of its layers' file sizes)."""
    max_entries: int = 2_000_000
    """Most tar entries over all layers (a bomb of empty files)."""
    setuid: Literal["strip", "refuse"] = "strip"


@dataclass(frozen=True)
class LayerVerdict:
    """What the check found in an image that passed: its unpacked size and the files whose
    setuid/setgid bits are to be stripped."""

    size_bytes: int
    entries: int
    setuid_paths: tuple[str, ...] = field(default=())


def _parts(name: str) -> list[str]:
    return [p for p in name.split("/") if p not in ("", ".")]


def _escapes(parent: list[str], target: str) -> bool:
    """Whether a relative symlink target, taken from directory ``parent``, climbs above /."""
    depth = len(parent)
    for part in target.split("/"):
        if part in ("", "."):
            continue
        depth = depth - 1 if part == ".." else depth + 1
        if depth < 0:
            return True
    return False


def _members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The members of a streamed layer; a layer that ends without the two zero blocks of a
    tar's end (``umoci insert`` writes such layers, and umoci and Go read them) ends there."""
    while True:
        try:
            ti = tar.next()
        except tarfile.ReadError as e:
            if "unexpected end of data" in str(e):
                return
            raise
        if ti is None:
            return
        yield ti


def _reject(ref: str, layer: int, entry: str, why: str) -> ImageError:
    return ImageError(f"image {ref} is refused: layer {layer + 1}, entry {entry!r}: {why}",
                      "IMAGE_REJECTED", ref=ref)


def check_layers(ref: str, layers: Iterable[IO[bytes]], policy: LayerPolicy) -> LayerVerdict:
    """Check ``layers`` (open tar streams, compressed or not, bottom layer first); raise
    :class:`ImageError` (``IMAGE_REJECTED``) at the first entry that breaks a rule."""
    links: set[str] = set()  # symlink paths of the layers so far
    size = entries = 0
    setuid: list[str] = []
    for index, stream in enumerate(layers):
        head = stream.peek(4)[:4] if hasattr(stream, "peek") else b""
        if head == _ZSTD_MAGIC:
            # zstd layers a manifest declares are recompressed before this check (see
            # ImageCache._to_gzip); one that says gzip and is zstd is a broken image.
            raise ImageError(f"image {ref}: layer {index + 1} is zstd-compressed where its "
                             "manifest promised gzip or plain tar",
                             "IMAGE_REJECTED", ref=ref)
        regular: set[str] = set()
        try:
            tar = tarfile.open(fileobj=stream, mode="r|*")
            for ti in _members(tar):
                entries += 1
                if entries > policy.max_entries:
                    raise ImageError(f"image {ref} is refused: more than {policy.max_entries} "
                                     "entries (a tar bomb?)", "IMAGE_REJECTED", ref=ref)
                name = ti.name
                parts = _parts(name)  # a leading '/' names the image's root, as umoci reads it
                if ".." in parts:
                    raise _reject(ref, index, name, "a '../' path, which would land outside "
                                  "the image's root")
                path = "/".join(parts)
                for i in range(1, len(parts)):
                    if "/".join(parts[:i]) in links:
                        raise _reject(ref, index, name, f"it is written through the symlink "
                                      f"{'/'.join(parts[:i])!r}, which may point out of the root")
                if ti.ischr() or ti.isblk():
                    raise _reject(ref, index, name, "a device node")
                if ti.issym():
                    if _escapes(parts[:-1], ti.linkname):
                        raise _reject(ref, index, name, f"a symlink to {ti.linkname!r}, which "
                                      "climbs out of the image's root")
                    links.add(path)
                    continue
                links.discard(path)
                if ti.islnk():
                    target = _parts(ti.linkname)
                    if ".." in target or ti.linkname.startswith("/"):
                        raise _reject(ref, index, name, f"a hard link to {ti.linkname!r}, "
                                      "outside the image's root")
                    if "/".join(target) not in regular:
                        raise _reject(ref, index, name, f"a hard link to {ti.linkname!r}, which "
                                      "is not a file of the same layer (hard links across "
                                      "layers are refused)")
                    continue
                if ti.isreg():
                    regular.add(path)
                    size += ti.size
                    if size > policy.max_image_bytes:
                        raise ImageError(
                            f"image {ref} is refused: it unpacks to more than the image size "
                            f"budget of {policy.max_image_bytes} bytes (a tar bomb?); raise "
                            "the budget (sandbox.image_max_bytes) if the image is meant to be "
                            "this large", "IMAGE_REJECTED", ref=ref)
                if ti.mode & (stat.S_ISUID | stat.S_ISGID) and not ti.isdir():
                    if policy.setuid == "refuse":
                        raise _reject(ref, index, name, "a setuid/setgid file")
                    setuid.append(path)
        except tarfile.TarError as e:
            raise ImageError(f"image {ref}: layer {index + 1} is not a readable tar "
                             f"stream ({e})", "IMAGE_REJECTED", ref=ref) from e
    return LayerVerdict(size, entries, tuple(setuid))


def manifest_layers(layout: Path, manifest_digest: str) -> tuple[dict[str, object], list[Path]]:
    """(the image config document, the layer blob files, bottom first) of a manifest in an OCI
    layout."""
    manifest = json.loads(blob(layout, manifest_digest).read_bytes())
    config = json.loads(blob(layout, manifest["config"]["digest"]).read_bytes())
    return config, [blob(layout, d["digest"]) for d in manifest.get("layers") or ()]


def blob(layout: Path, digest: str) -> Path:
    algo, _, hexdigest = str(digest).partition(":")
    if algo != "sha256" or len(hexdigest) != 64 or not all(
            c in "0123456789abcdef" for c in hexdigest):
        raise ImageError(f"unsupported digest {digest!r} in the image", "IMAGE_REJECTED")
    return layout / "blobs" / algo / hexdigest
