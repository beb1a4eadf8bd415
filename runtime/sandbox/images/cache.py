"""The image cache: fetched with ``skopeo``, checked, unpacked rootless with ``umoci``, keyed by
manifest digest, shared read-only by every sandbox that uses the image.

Layout of a cache directory::

    images/<digest-hex>/rootfs/    the unpacked root (a sandbox's read-only lower layer)
    images/<digest-hex>/image.json the ImageConfig, size, references, when made
    refs/<ref-key>.json            reference -> manifest digest (a tag is resolved once)
    locks/<ref-key>.lock           held while one process fetches a reference
    locks/<digest-hex>.lease       a shared flock per sandbox using the image
    tmp/                           staging (same filesystem: the final step is one rename)

Why so:

- **One fetch per reference**, across threads and processes: the fetcher holds an exclusive
  flock on the reference's lock file (``flock`` locks belong to an open file, so two threads of
  one process exclude each other as two processes do); a waiter finds the result when it gets
  the lock and fetches nothing.
- **Never a half-unpacked image**: everything happens under ``tmp/`` and the image appears with
  one ``rename``; a crash leaves only staging, which the next fetch sweeps.
- **A size budget that never evicts what a job uses**: each sandbox holds a shared flock on its
  image's lease file; eviction (least recently used first) takes the exclusive lock without
  waiting, so an image in use is skipped, in this process or any other.
- **The user's registry set-up is the tools' own**: skopeo runs with the server's environment
  (``CONTAINERS_REGISTRIES_CONF``, ``REGISTRY_AUTH_FILE``, ``~/.config/containers``) plus what
  :class:`RegistryOptions` adds (``--authfile``, ``--src-tls-verify=false``, a cert dir).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import stat
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollout.runtime.sandbox.images.config import ImageConfig, host_architecture
from rollout.runtime.sandbox.images.errors import ImageError
from rollout.runtime.sandbox.images.layers import (
    LayerPolicy,
    LayerVerdict,
    blob,
    check_layers,
    manifest_layers,
)
from rollout.runtime.sandbox.images.ref import ImageRef, parse_image_ref

log = logging.getLogger(__name__)
Action = Literal["pulled", "built", "cached"]
Progress = Callable[[str], None]
"""Called with a stage name (``waiting``, ``fetching``, ``checking``, ``unpacking``, ``done``)."""
_LOCK_POLL_S = 0.05


@dataclass(frozen=True)
class RegistryOptions:
    """What skopeo is told beyond the environment it inherits (where registries.conf, the
    auth file and certificates are found by default)."""

    authfile: str = ""
    """``--authfile``: a containers-auth.json (default: ``REGISTRY_AUTH_FILE``, then
    ``${XDG_RUNTIME_DIR}/containers/auth.json``, as skopeo looks)."""
    registries_conf: str = ""
    """A registries.conf to use instead of the system's (default: the user's
    ``CONTAINERS_REGISTRIES_CONF``, else ``/etc/containers/registries.conf``)."""
    tls_verify: bool = True
    """False: ``--src-tls-verify=false`` for every registry (registries.conf's
    ``insecure = true`` is the per-registry way)."""
    cert_dir: str = ""
    timeout_s: float = 1800.0
    """Deadline of one fetch (skopeo copy) or unpack."""

    def skopeo_args(self) -> list[str]:
        args = []
        if self.authfile:
            args.append(f"--authfile={self.authfile}")
        if not self.tls_verify:
            args.append("--src-tls-verify=false")
        if self.cert_dir:
            args.append(f"--src-cert-dir={self.cert_dir}")
        return args

    def conf_path(self) -> str:
        return self.registries_conf or os.environ.get("CONTAINERS_REGISTRIES_CONF", "")

    def global_args(self) -> list[str]:
        """Global flags of skopeo and buildah: the registries.conf (skopeo reads no
        environment variable for it, so the user's ``CONTAINERS_REGISTRIES_CONF`` is passed
        on as the flag)."""
        conf = self.conf_path()
        return ["--registries-conf", conf] if conf else []

    def environ(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.conf_path():
            env["CONTAINERS_REGISTRIES_CONF"] = self.conf_path()
        return env


@dataclass(frozen=True)
class CachedImage:
    """An image ready in the cache."""

    ref: str
    digest: str
    """The manifest digest (``sha256:...``): the cache key."""
    path: Path
    """``images/<digest-hex>``; the root is ``rootfs`` below it."""
    config: ImageConfig
    size_bytes: int
    action: Action = "cached"
    seconds: float = 0.0

    @property
    def rootfs(self) -> Path:
        return self.path / "rootfs"


class ImageLease:
    """A sandbox's hold on a cached image: eviction skips the image until :meth:`release`."""

    def __init__(self, image: CachedImage, fd: int) -> None:
        self.image = image
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:  # a lease whose sandbox creation was abandoned
        self.release()

    def __enter__(self) -> ImageLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True)
class CacheEntry:
    digest: str
    size_bytes: int
    last_used: float
    in_use: bool
    refs: tuple[str, ...] = field(default=())


class ImageCache:
    """One cache directory. Blocking methods: call them from a worker thread."""

    def __init__(self, root: Path | str, *, budget_bytes: int = 32 << 30,
                 policy: LayerPolicy | None = None,
                 registry: RegistryOptions | None = None,
                 build_hosts: tuple[str, ...] | None = None) -> None:
        self.root = Path(os.path.abspath(root))
        self.budget_bytes = budget_bytes
        self.policy = policy or LayerPolicy()
        self.registry = registry or RegistryOptions()
        self.build_hosts = build_hosts
        """None: builds use the network their spec names; else a build on the host's network
        reaches only the registries and these hosts (:mod:`.egress`)."""
        for sub in ("images", "refs", "locks", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        os.chmod(self.root / "images", 0o755)
        self._evict_lock = threading.Lock()

    # -- public ------------------------------------------------------------------------------
    def lookup(self, ref: ImageRef | str) -> CachedImage | None:
        """The cached image of ``ref`` without fetching anything, or None."""
        ref = _ref(ref)
        digest = ref.pinned_digest or self._resolved(ref)
        return self._load(digest, str(ref)) if digest else None

    def ensure(self, ref: ImageRef | str, *, progress: Progress | None = None,
               refresh: bool = False) -> CachedImage:
        """The cached image of ``ref``, fetched and unpacked first when missing (once, however
        many threads and processes ask at the same time). ``refresh``: resolve a tag again
        (a new push under the same tag) instead of the digest it resolved to before."""
        ref = _ref(ref)
        if not refresh:
            found = self.lookup(ref)
            if found is not None:
                self._touch(found.digest)
                return found
        note = progress or (lambda _stage: None)
        deadline = time.monotonic() + 2 * self.registry.timeout_s
        with self._locked(self.root / "locks" / f"{ref.key}.lock", deadline, note):
            if not refresh:
                found = self.lookup(ref)  # another thread or process fetched it meanwhile
                if found is not None:
                    self._touch(found.digest)
                    note("done")
                    return found
            return self._fetch(ref, note)

    def acquire(self, ref: ImageRef | str, *, progress: Progress | None = None) -> ImageLease:
        """:meth:`ensure` plus a lease, taken so that eviction cannot remove the image between
        the two (it is looked up again once the lease is held)."""
        return self.lease_of(lambda: self.ensure(ref, progress=progress), str(ref))

    def lease_of(self, get: Callable[[], CachedImage], label: str) -> ImageLease:
        """A lease on the image ``get()`` makes ready; ``get`` runs again when the image was
        evicted between its return and the lease."""
        for _ in range(5):
            image = get()
            fd = os.open(self._lease_path(image.digest),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            if image.rootfs.is_dir():
                self._touch(image.digest)
                return ImageLease(image, fd)
            os.close(fd)  # evicted between ensure and the lock: fetch again
        raise ImageError(f"image {label} was evicted five times while being leased; the "
                         "cache budget is too small for the images in use", "IMAGE_DISK_FULL",
                         ref=label)

    def add_layout(self, layout: Path, tag: str, *, label: str,
                   progress: Progress | None = None) -> CachedImage:
        """Unpack an image from a local OCI layout (what a build produced) into the cache."""
        ref = ImageRef("oci", str(layout), tag)
        image = self.ensure(ref, progress=progress)
        with contextlib.suppress(OSError):  # the layout is staging: nobody names it again
            (self.root / "refs" / f"{ref.key}.json").unlink()
        return CachedImage(label, image.digest, image.path, image.config, image.size_bytes,
                           "built", image.seconds)

    def entries(self) -> list[CacheEntry]:
        out = []
        refs: dict[str, list[str]] = {}
        for f in (self.root / "refs").glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                data = json.loads(f.read_text())
                refs.setdefault(data["digest"], []).append(data["ref"])
        for d in (self.root / "images").iterdir():
            meta = d / "image.json"
            try:
                data = json.loads(meta.read_text())
                used = (d / "used").stat().st_mtime if (d / "used").exists() else 0.0
            except (OSError, ValueError):
                continue
            digest = "sha256:" + d.name
            out.append(CacheEntry(digest, int(data.get("size_bytes", 0)), used,
                                  self._in_use(digest), tuple(refs.get(digest, ()))))
        return sorted(out, key=lambda e: e.last_used)

    def total_bytes(self) -> int:
        return sum(e.size_bytes for e in self.entries())

    def evict(self, need_bytes: int = 0) -> list[str]:
        """Remove least recently used images no sandbox holds until ``need_bytes`` more fit in
        the budget; returns the digests removed."""
        gone = []
        with self._evict_lock:
            entries = self.entries()
            total = sum(e.size_bytes for e in entries)
            for e in entries:
                if total + need_bytes <= self.budget_bytes:
                    break
                if self._remove_unused(e.digest):
                    total -= e.size_bytes
                    gone.append(e.digest)
        return gone

    # -- fetch -------------------------------------------------------------------------------
    def _fetch(self, ref: ImageRef, note: Progress) -> CachedImage:
        started = time.monotonic()
        self._sweep_staging()
        staging = self.root / "tmp" / f"{uuid.uuid4().hex[:12]}.{os.getpid()}"
        staging.mkdir()
        try:
            note("fetching")
            layout = staging / "layout"
            self._run(["skopeo", *self.registry.global_args(), "copy", "--quiet",
                       *self.registry.skopeo_args(), str(ref),
                       f"oci:{layout}:img"], ref, "fetch")
            digest = _layout_digest(layout)
            if _zstd_layers(layout, digest):
                layout, digest = self._to_gzip(ref, layout, staging / "gzip", note)
            existing = self._load(digest, str(ref))
            if existing is None:
                note("checking")
                config_doc, blobs = manifest_layers(layout, digest)
                config = ImageConfig.from_oci(config_doc)
                self._check_platform(ref, config)
                verdict = self._check(ref, blobs)
                if verdict.size_bytes > self.budget_bytes:
                    raise ImageError(
                        f"image {ref} unpacks to {verdict.size_bytes} bytes, more than the "
                        f"whole image cache budget ({self.budget_bytes} bytes)",
                        "IMAGE_REJECTED", ref=str(ref))
                self.evict(verdict.size_bytes)
                note("unpacking")
                bundle = staging / "bundle"
                bundle.mkdir()
                # `raw unpack`: the root file system only. `umoci unpack` also hashes every
                # file into an mtree manifest (for `umoci repack`, which nothing here runs):
                # more than half of its time on a 220 MB Debian image (12.5 s against 5.7).
                self._run(["umoci", "raw", "unpack", "--rootless", "--image",
                           f"{layout}:img", str(bundle / "rootfs")], ref, "unpack")
                _strip_setuid(bundle / "rootfs", verdict.setuid_paths)
                (bundle / "image.json").write_text(json.dumps({
                    "digest": digest, "config": config.to_json(),
                    "size_bytes": verdict.size_bytes, "created": time.time(),
                    "first_ref": str(ref)}))
                (bundle / "used").touch()
                os.chmod(bundle, 0o755)
                try:
                    os.rename(bundle, self._image_dir(digest))
                except OSError as e:  # the same digest arrived under another reference
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise
            self._write_ref(ref, digest)
            image = self._load(digest, str(ref))
            if image is None:
                raise ImageError(f"image {ref} vanished from the cache right after it was "
                                 "unpacked", "IMAGE_DISK_FULL", ref=str(ref))
            note("done")
            action: Action = "pulled" if existing is None else "cached"
            return CachedImage(image.ref, image.digest, image.path, image.config,
                               image.size_bytes, action, round(time.monotonic() - started, 2))
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise _disk_full(ref, self.root) from e
            raise
        finally:
            _remove(staging)

    def _to_gzip(self, ref: ImageRef, layout: Path, dest: Path,
                 note: Progress) -> tuple[Path, str]:
        """The image of ``layout`` again, its zstd layers recompressed as gzip by skopeo
        (umoci 0.4 and Python's tarfile read gzip, not zstd); keyed by the new manifest's
        digest, the same for every fetch of the image."""
        note("recompressing zstd layers")
        self._run(["skopeo", "copy", "--quiet", "--dest-compress-format", "gzip",
                   f"oci:{layout}:img", f"oci:{dest}:img"], ref, "fetch")
        _remove(layout)
        return dest, _layout_digest(dest)

    def _check(self, ref: ImageRef, blobs: list[Path]) -> LayerVerdict:
        with contextlib.ExitStack() as stack:
            streams = (stack.enter_context(open(b, "rb")) for b in blobs)
            return check_layers(str(ref), streams, self.policy)

    @staticmethod
    def _check_platform(ref: ImageRef, config: ImageConfig) -> None:
        host = host_architecture()
        if config.architecture and config.architecture != host:
            raise ImageError(f"image {ref} is built for {config.os or '?'}/"
                             f"{config.architecture}, and this server runs {host}: use an "
                             f"image (or a manifest list entry) for linux/{host}",
                             "IMAGE_REJECTED", ref=str(ref))
        if config.os and config.os != "linux":
            raise ImageError(f"image {ref} is a {config.os} image; only linux images run",
                             "IMAGE_REJECTED", ref=str(ref))

    def _run(self, argv: list[str], ref: ImageRef, what: str) -> None:
        if shutil.which(argv[0]) is None:
            raise ImageError(f"`{argv[0]}` is not installed: images need skopeo and umoci "
                             "(apt-get install skopeo umoci)", "IMAGE_REGISTRY_UNREACHABLE",
                             ref=str(ref))
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, check=False,
                                  timeout=self.registry.timeout_s, env=self.registry.environ(),
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            raise ImageError(f"{what} of image {ref} did not finish within "
                             f"{self.registry.timeout_s:g} s", "IMAGE_REGISTRY_UNREACHABLE",
                             ref=str(ref)) from e
        if proc.returncode != 0:
            raise classify_failure(ref, what, (proc.stderr or proc.stdout).strip(), self.root)

    # -- bookkeeping -------------------------------------------------------------------------
    def _image_dir(self, digest: str) -> Path:
        return self.root / "images" / digest.partition(":")[2]

    def _lease_path(self, digest: str) -> Path:
        return self.root / "locks" / f"{digest.partition(':')[2]}.lease"

    def _resolved(self, ref: ImageRef) -> str:
        try:
            return str(json.loads((self.root / "refs" / f"{ref.key}.json").read_text())["digest"])
        except (OSError, ValueError, KeyError):
            return ""

    def _write_ref(self, ref: ImageRef, digest: str) -> None:
        tmp = self.root / "refs" / f".{ref.key}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps({"ref": str(ref), "digest": digest}))
        os.replace(tmp, self.root / "refs" / f"{ref.key}.json")

    def _load(self, digest: str, ref: str) -> CachedImage | None:
        d = self._image_dir(digest)
        try:
            data = json.loads((d / "image.json").read_text())
        except (OSError, ValueError):
            return None
        return CachedImage(ref, digest, d, ImageConfig.from_json(data.get("config") or {}),
                           int(data.get("size_bytes", 0)))

    def _touch(self, digest: str) -> None:
        with contextlib.suppress(OSError):
            os.utime(self._image_dir(digest) / "used")

    def _in_use(self, digest: str) -> bool:
        try:
            fd = os.open(self._lease_path(digest), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def _remove_unused(self, digest: str) -> bool:
        fd = os.open(self._lease_path(digest), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            short = digest.partition(":")[2][:16]
            trash = self.root / "tmp" / f"evicted.{short}.{uuid.uuid4().hex[:6]}"
            try:
                os.rename(self._image_dir(digest), trash)
            except FileNotFoundError:
                return False
        finally:
            os.close(fd)
        log.info("image cache %s: evicted %s", self.root, digest)
        _remove(trash)
        return True

    def _sweep_staging(self) -> None:
        """Remove staging whose process is gone (a crash mid-fetch) and evicted leftovers."""
        for d in (self.root / "tmp").iterdir():
            pid = d.name.rpartition(".")[2]
            if d.name.startswith("evicted.") or (pid.isdigit() and not _alive(int(pid))):
                _remove(d)

    @contextlib.contextmanager
    def _locked(self, path: Path, deadline: float, note: Progress) -> Iterator[None]:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            waited = False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not waited:
                        note("waiting")
                        waited = True
                    if time.monotonic() > deadline:
                        raise ImageError(f"waited too long for another fetch of {path.stem}",
                                         "IMAGE_REGISTRY_UNREACHABLE") from None
                    time.sleep(_LOCK_POLL_S)
            yield
        finally:
            os.close(fd)


def classify_failure(ref: ImageRef | str, what: str, stderr: str, root: Path) -> ImageError:
    """One reason per way skopeo or umoci fails, with the tool's own last words."""
    low = stderr.lower()
    tail = stderr[-1200:]
    if "no space left on device" in low:
        return _disk_full(ref, root, tail)
    if any(s in low for s in ("unauthorized", "authentication required",
                              "requested access to the resource is denied", "403 forbidden")):
        return ImageError(f"the registry refused access to image {ref} (check the auth file "
                          f"or `skopeo login`): {tail}", "IMAGE_AUTH_FAILED", ref=str(ref))
    if "no image found in manifest list" in low or "choosing image instance" in low:
        return ImageError(f"image {ref} has no variant for linux/{host_architecture()}: {tail}",
                          "IMAGE_REJECTED", ref=str(ref))
    if any(s in low for s in ("manifest unknown", "name unknown", "no such file",
                              "does not exist", "no descriptor found")):
        return ImageError(f"image {ref} does not exist (unknown image or tag): {tail}",
                          "IMAGE_NOT_FOUND", ref=str(ref))
    if any(s in low for s in ("connection refused", "no such host", "i/o timeout",
                              "dial tcp", "network is unreachable", "tls: ",
                              "http response to https client", "connection reset",
                              "pinging container registry", "timeout")):
        hint = (" (a plain-http registry must be marked `insecure = true` in registries.conf)"
                if "https client" in low else "")
        return ImageError(f"the registry of image {ref} cannot be reached{hint}: {tail}",
                          "IMAGE_REGISTRY_UNREACHABLE", ref=str(ref))
    if what == "unpack":
        return ImageError(f"image {ref} could not be unpacked: {tail}", "IMAGE_REJECTED",
                          ref=str(ref))
    return ImageError(f"image {ref} could not be fetched: {tail}", "IMAGE_NOT_FOUND",
                      ref=str(ref))


def _disk_full(ref: ImageRef | str, root: Path, detail: str = "") -> ImageError:
    return ImageError(f"the disk of the image cache {root} is full while unpacking image "
                      f"{ref}; free space or lower the cache budget"
                      + (f": {detail}" if detail else ""), "IMAGE_DISK_FULL", ref=str(ref))


def _zstd_layers(layout: Path, manifest_digest: str) -> bool:
    """Whether the manifest names a zstd-compressed layer."""
    manifest = json.loads(blob(layout, manifest_digest).read_bytes())
    return any(str(d.get("mediaType", "")).endswith("+zstd")
               for d in manifest.get("layers") or ())


def _layout_digest(layout: Path) -> str:
    index = json.loads((layout / "index.json").read_text())
    for m in index.get("manifests") or ():
        if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == "img":
            return str(m["digest"])
    raise ImageError(f"skopeo wrote no image into {layout}", "IMAGE_NOT_FOUND")


def _strip_setuid(rootfs: Path, paths: tuple[str, ...]) -> None:
    for rel in paths:
        p = rootfs / rel
        with contextlib.suppress(OSError):
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                os.chmod(p, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))


def _remove(path: Path) -> None:
    """Remove a tree whatever its modes (an image's root has 0555 directories)."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        for d, dirs, _ in os.walk(path):
            for name in dirs:
                with contextlib.suppress(OSError):
                    full = os.path.join(d, name)
                    if not os.path.islink(full):
                        os.chmod(full, 0o700)
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ref(ref: ImageRef | str) -> ImageRef:
    return ref if isinstance(ref, ImageRef) else parse_image_ref(ref)
