"""Dockerfile builds without a daemon: ``buildah build --isolation chroot`` into the image cache.

A build is keyed by a hash of what it is made from (the Dockerfile, every file of the context
with its path and mode, the build arguments, the network mode), so an unchanged task folder is
built once and an edited one again; concurrent first uses coalesce as fetches do (a flock on
the key). The result is pushed into an OCI layout and goes into the same cache as pulled
images (same checks, same digest key), so a built image is used exactly like a pulled one.

Bounds, stated plainly (what ``buildah --isolation chroot`` allows, and no more):

- **time**: the whole build has a wall-clock deadline; past it buildah is killed (its process
  group) and the build fails with the log's tail.
- **resources**: every ``RUN`` step gets rlimits through ``--ulimit`` (CPU seconds, file size,
  open files, data segment); chroot isolation has no cgroup of its own, so there is no
  memory cgroup per build.
- **network**: ``network="host"`` (the default) gives ``RUN`` steps the host's network, which
  is what ``apt-get``/``pip`` need to reach the package registries; ``network="none"`` gives
  them none (``buildah --network none``). ``FROM`` images come through buildah itself, which
  uses the user's ``registries.conf`` (mirrors, insecure registries) and auth file. With
  ``ImageSettings.build_network = "allowlist"`` a ``host`` build reaches only the registries
  and the listed hosts (:mod:`.egress`: its own network namespace, a proxy that refuses the
  rest; a rootless server needs its subordinate ids for it, as for image users).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollout.runtime.sandbox.base import SandboxUnavailable
from rollout.runtime.sandbox.images import egress, subids
from rollout.runtime.sandbox.images.cache import CachedImage, ImageCache, Progress, _remove
from rollout.runtime.sandbox.images.errors import ImageError

LOG_TAIL_CHARS = 2500
MAX_CONTEXT_BYTES = 1 << 30
MAX_CONTEXT_FILES = 100_000


@dataclass(frozen=True)
class BuildLimits:
    """rlimits of every ``RUN`` step (``buildah --ulimit``). buildah takes Docker's ulimit
    names, which have no address-space limit (``as`` is refused, and every ``RUN`` step with
    it): ``data`` is the memory bound."""

    cpu_seconds: int = 3600
    file_size_bytes: int = 8 << 30
    open_files: int = 65536
    data_bytes: int = 16 << 30
    """RLIMIT_DATA (heap and private mappings): buildah's ``--ulimit`` has no address-space
    limit, so this is the memory bound a step gets."""

    def ulimit_args(self) -> list[str]:
        """``--ulimit`` flags, each at most the server's own hard limit (a step cannot be
        given more than buildah itself has)."""
        out = []
        for name, res, want in (("cpu", resource.RLIMIT_CPU, self.cpu_seconds),
                                ("fsize", resource.RLIMIT_FSIZE, self.file_size_bytes),
                                ("nofile", resource.RLIMIT_NOFILE, self.open_files),
                                ("data", resource.RLIMIT_DATA, self.data_bytes)):
            hard = resource.getrlimit(res)[1]
            value = want if hard == resource.RLIM_INFINITY else min(want, hard)
            out.append(f"--ulimit={name}={value}:{value}")
        return out


@dataclass(frozen=True)
class BuildSpec:
    """One Dockerfile build."""

    context: Path
    """The build context directory."""
    dockerfile: str = "Dockerfile"
    """Relative to ``context`` (or absolute)."""
    build_args: tuple[tuple[str, str], ...] = ()
    network: Literal["host", "none"] = "host"
    timeout_s: float = 3600.0
    limits: BuildLimits = field(default_factory=BuildLimits)
    label: str = ""
    """What errors and progress call the image (a task's name); default: the context path."""

    @property
    def name(self) -> str:
        return self.label or str(self.context)

    def dockerfile_path(self) -> Path:
        p = Path(self.dockerfile)
        return p if p.is_absolute() else self.context / p


def context_key(spec: BuildSpec) -> str:
    """The hash a build is cached by: Dockerfile, context files (path, mode, content; links as
    links), build args, network. Raises :class:`ImageError` for a missing or oversized
    context."""
    ctx = spec.context
    df = spec.dockerfile_path()
    if not ctx.is_dir():
        raise ImageError(f"build context {ctx} of {spec.name} is not a directory",
                         "IMAGE_BUILD_FAILED", ref=spec.name)
    if not df.is_file():
        raise ImageError(f"{spec.name} has no Dockerfile at {df}", "IMAGE_BUILD_FAILED",
                         ref=spec.name)
    h = hashlib.sha256()
    h.update(b"dockerfile\0" + df.read_bytes())
    h.update(json.dumps([sorted(spec.build_args), spec.network]).encode())
    total = files = 0
    for dirpath, dirnames, filenames in os.walk(ctx):
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames
                                        if os.path.islink(os.path.join(dirpath, d))]):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, ctx)
            st = os.lstat(full)
            files += 1
            h.update(f"\0{rel}\0{st.st_mode:o}\0".encode())
            if os.path.islink(full):
                h.update(os.readlink(full).encode())
            elif os.path.isfile(full):
                total += st.st_size
                with open(full, "rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
            if total > MAX_CONTEXT_BYTES or files > MAX_CONTEXT_FILES:
                raise ImageError(f"the build context of {spec.name} is over "
                                 f"{MAX_CONTEXT_BYTES} bytes or {MAX_CONTEXT_FILES} files",
                                 "IMAGE_BUILD_FAILED", ref=spec.name)
    return h.hexdigest()[:32]


def lookup_build(cache: ImageCache, spec: BuildSpec) -> CachedImage | None:
    """The cached result of ``spec``, or None (nothing is built)."""
    return _built(cache, context_key(spec), spec.name)


def build_image(cache: ImageCache, spec: BuildSpec, *,
                progress: Progress | None = None,
                env: Mapping[str, str] | None = None) -> CachedImage:
    """Build ``spec`` into ``cache`` unless a build of the same key is there (blocking).
    :class:`ImageError` ``IMAGE_BUILD_FAILED`` with the build log's tail when buildah fails."""
    note = progress or (lambda _stage: None)
    key = context_key(spec)
    found = _built(cache, key, spec.name)
    if found is not None:
        note("done")
        return found
    if shutil.which("buildah") is None:
        raise ImageError("`buildah` is not installed: Dockerfile builds need it (apt-get "
                         "install buildah)", "IMAGE_BUILD_FAILED", ref=spec.name)
    (cache.root / "builds").mkdir(exist_ok=True)
    lock = os.open(cache.root / "locks" / f"build-{key}.lock",
                   os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        _flock(lock, time.monotonic() + 2 * spec.timeout_s, note)
        found = _built(cache, key, spec.name)
        if found is not None:
            note("done")
            return found
        started = time.monotonic()
        image = _build(cache, spec, key, note, env)
        return CachedImage(spec.name, image.digest, image.path, image.config,
                           image.size_bytes, "built", round(time.monotonic() - started, 2))
    finally:
        os.close(lock)


def _build(cache: ImageCache, spec: BuildSpec, key: str, note: Progress,
           env: Mapping[str, str] | None) -> CachedImage:
    storage = cache.root / "buildah"
    # vfs: no mounts, so a build killed at its deadline leaves files to delete, never a mount
    # on the host (overlay storage left one per killed build).
    store = ["--root", str(storage / "root"), "--runroot", str(storage / "run"),
             "--storage-driver", "vfs", *cache.registry.global_args()]
    tag = f"localhost/rollout-build:{key}"
    staging = cache.root / "tmp" / f"build-{uuid.uuid4().hex[:12]}.{os.getpid()}"
    staging.mkdir(parents=True)
    log_path = staging / "build.log"
    reg = cache.registry
    tls = [] if reg.tls_verify else ["--tls-verify=false"]
    auth = [f"--authfile={reg.authfile}"] if reg.authfile else []
    run_env = {**reg.environ(), **(env or {})}
    try:
        note("building")
        argv = ["buildah", *store, "build", "--isolation", "chroot", "--layers=false",
                "--network", spec.network, *spec.limits.ulimit_args(), *tls, *auth,
                "-f", str(spec.dockerfile_path()), "-t", tag,
                *(f"--build-arg={k}={v}" for k, v in spec.build_args), str(spec.context)]
        network = _egress(cache) if spec.network == "host" else None
        confined = network[0] if network is not None else None
        if network is None:
            code = _run_logged(argv, log_path, spec.timeout_s, run_env)
        else:
            try:
                code = egress.run_confined(argv, network[0], log_path, spec.timeout_s,
                                           run_env, network[1])
            except OSError as e:
                raise SandboxUnavailable(f"the allow-listed build network of {spec.name} could "
                                         f"not be set up: {e}") from e
        if code != 0:
            tail = _tail(log_path)
            why = (f"did not finish within {spec.timeout_s:g} s" if code is None
                   else f"failed (exit {code})")
            refused = (f"; the build network refused {', '.join(sorted(set(confined.refused)))}"
                       f" (only the image registries and {egress.SETTING} are reachable)"
                       if confined is not None and confined.refused else "")
            raise ImageError(f"the Dockerfile build of {spec.name} {why}{refused}; the build "
                             f"log ends:\n{tail}", "IMAGE_BUILD_FAILED", ref=spec.name)
        note("exporting")
        layout = staging / "layout"
        # Uncompressed: the layout is read once, on this disk, and deleted; gzip here and
        # gunzip in the check and the unpack would be CPU spent for nothing.
        code = _run_logged(["buildah", *store, "push", "--disable-compression", *tls, tag,
                            f"oci:{layout}:img"], log_path, cache.registry.timeout_s, run_env)
        if code != 0:
            raise ImageError(f"exporting the built image of {spec.name} failed:\n"
                             f"{_tail(log_path)}", "IMAGE_BUILD_FAILED", ref=spec.name)
        image = cache.add_layout(layout, "img", label=spec.name, progress=note)
        _write_build(cache, key, image.digest, spec.name)
        return image
    finally:
        with contextlib.suppress(Exception):
            subprocess.run(["buildah", *store, "rmi", "-f", tag], capture_output=True,
                           timeout=120, check=False)
        _remove(staging)


def _egress(cache: ImageCache) -> tuple[egress.Egress, subids.SubIds | None] | None:
    """The allow-listing build network of ``cache``'s settings (with the subordinate ranges a
    rootless server maps into the build's user namespace), or None (the host's)."""
    if cache.build_hosts is None:
        return None
    if os.geteuid() == 0 and shutil.which("unshare") is None:
        raise SandboxUnavailable(
            "sandbox.image_build_network = \"allowlist\" needs util-linux `unshare` (the "
            "build runs in a network namespace of its own); install it or set it to \"host\"")
    ids = None
    if os.geteuid() != 0:
        ids, why = subids.lookup(os.geteuid())
        if ids is None:
            raise SandboxUnavailable(
                "sandbox.image_build_network = \"allowlist\" on a rootless server runs "
                "buildah in a user namespace of the server's own, which needs its "
                f"subordinate ids: {why}; or set it to \"host\"")
    allow, forwards = egress.registry_endpoints(cache.registry.conf_path())
    return egress.Egress(egress.AllowList((*allow, *cache.build_hosts)), forwards), ids


def _run_logged(argv: list[str], log_path: Path, timeout: float,
                env: Mapping[str, str]) -> int | None:
    """Run with output appended to ``log_path``; None when killed at the deadline."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=dict(env),
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def _tail(log_path: Path) -> str:
    try:
        data = log_path.read_bytes()[-LOG_TAIL_CHARS:]
    except OSError:
        return "(no build log)"
    return data.decode(errors="replace").strip()


def _built(cache: ImageCache, key: str, name: str) -> CachedImage | None:
    try:
        digest = json.loads((cache.root / "builds" / f"{key}.json").read_text())["digest"]
    except (OSError, ValueError, KeyError):
        return None
    found = cache._load(str(digest), name)
    if found is not None:
        cache._touch(found.digest)
    return found


def _write_build(cache: ImageCache, key: str, digest: str, name: str) -> None:
    tmp = cache.root / "builds" / f".{key}.{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps({"digest": digest, "name": name, "built": time.time()}))
    os.replace(tmp, cache.root / "builds" / f"{key}.json")


def _flock(fd: int, deadline: float, note: Progress) -> None:
    waited = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not waited:
                note("waiting")
                waited = True
            if time.monotonic() > deadline:
                raise ImageError("waited too long for another build of the same context",
                                 "IMAGE_BUILD_FAILED") from None
            time.sleep(0.1)
