"""Container images as sandbox roots: rootless, daemonless, cached by manifest digest.

The API (stable; the ``harbor`` environment and the SWE-bench image path build on it):

- **References**: :func:`parse_image_ref` turns ``docker://REF``, ``oci:DIR[:TAG]``,
  ``oci-archive:FILE`` or ``docker-archive:FILE`` into a frozen :class:`ImageRef` (or an
  :class:`ImageError` ``INVALID_IMAGE_REF`` saying what a valid one looks like);
  :func:`is_image_ref` tells such a reference from a plain path.
- **Builds**: a :class:`BuildSpec` (context directory, Dockerfile, build args, network,
  timeout, :class:`BuildLimits`) is built daemonless by ``buildah --isolation chroot``,
  cached by a hash of its context (:func:`build_image`, :func:`lookup_build`).
- **The cache**: :func:`cache_for` gives the process's :class:`ImageCache` for an
  :class:`~rollout.runtime.sandbox.base.ImageSettings` (``SandboxConfig.images``).
  ``cache.ensure(ref)`` fetches (``skopeo copy``), checks every layer
  (:mod:`~rollout.runtime.sandbox.images.layers`) and unpacks (``umoci raw unpack --rootless``)
  once, however many threads and processes ask; ``cache.acquire(ref)`` adds an
  :class:`ImageLease` that keeps eviction away while a sandbox uses the image;
  ``cache.lookup(ref)`` never fetches. A :class:`CachedImage` carries the digest, the
  ``rootfs`` directory and the :class:`ImageConfig` (``Env``, ``WorkingDir``, ``User``);
  :func:`resolve_user` turns ``User`` into an :class:`ImageUser` through the image's own
  ``/etc/passwd`` and ``/etc/group``; a :class:`UserRequest` (``create_sandbox(...,
  user=...)``) replaces ``User`` for one sandbox, and ``sandbox.user_for(spec)`` plus
  ``exec(..., user=...)`` runs one command as another user of the image (a Harbor verifier).
- **One call for both**: :func:`prepare_image` (blocking) takes an image source (a reference
  string, an :class:`ImageRef` or a :class:`BuildSpec`) and returns the
  :class:`CachedImage`; :func:`lookup_image` answers without fetching or building.
- **Sandboxes**: ``create_sandbox(cfg, image=SOURCE)`` (or ``SandboxConfig.image`` for every
  sandbox) starts a bwrap sandbox whose root is the image: the cached rootfs as the read-only
  lower layer of an overlay with a per-sandbox upper layer, so INIT copies nothing and one
  job's writes are invisible to every other job and to the cache. The Apptainer runtime takes
  the same sources and starts the same cached rootfs directory.
- **Errors**: every failure is one :class:`ImageError` with a reason of
  :data:`~rollout.runtime.sandbox.images.errors.REASONS` (``INVALID_IMAGE_REF``,
  ``IMAGE_NOT_FOUND``, ``IMAGE_AUTH_FAILED``, ``IMAGE_REJECTED``, ``IMAGE_BUILD_FAILED``,
  ``IMAGE_REGISTRY_UNREACHABLE``, ``IMAGE_DISK_FULL``), raised in INIT: the job FAILS naming the
  image, never gets a reward.

See docs/images.md for the user's side (registries.conf, offline mirrors, limits).
"""

from __future__ import annotations

import threading
from pathlib import Path

from rollout.runtime.sandbox.base import ImageSettings
from rollout.runtime.sandbox.images.build import (
    BuildLimits,
    BuildSpec,
    build_image,
    context_key,
    lookup_build,
)
from rollout.runtime.sandbox.images.cache import (
    CachedImage,
    CacheEntry,
    ImageCache,
    ImageLease,
    Progress,
    RegistryOptions,
)
from rollout.runtime.sandbox.images.config import ImageConfig, host_architecture
from rollout.runtime.sandbox.images.errors import REASONS, ImageError
from rollout.runtime.sandbox.images.layers import LayerPolicy, LayerVerdict, check_layers
from rollout.runtime.sandbox.images.ref import (
    ImageRef,
    is_image_ref,
    parse_image_ref,
    with_transport,
)
from rollout.runtime.sandbox.images.user import ImageUser, UserRequest, resolve_user

ImageSource = str | ImageRef | BuildSpec
"""What names an image: a reference (string or parsed) or a Dockerfile build."""

__all__ = ["REASONS", "BuildLimits", "BuildSpec", "CacheEntry", "CachedImage", "ImageCache",
           "ImageConfig", "ImageError", "ImageLease", "ImageRef", "ImageSettings",
           "ImageSource", "ImageUser", "LayerPolicy", "LayerVerdict", "Progress",
           "RegistryOptions", "UserRequest", "build_image", "cache_for", "check_layers",
           "context_key", "host_architecture", "is_image_ref", "lease_image", "lookup_build",
           "lookup_image", "parse_image_ref", "prepare_image", "resolve_user", "source_label",
           "with_transport"]

_CACHES: dict[tuple[ImageSettings, Path], ImageCache] = {}
_CACHES_LOCK = threading.Lock()


def cache_for(settings: ImageSettings | None = None) -> ImageCache:
    """The process's :class:`ImageCache` for ``settings`` (one object per directory and
    settings, so the in-process eviction lock is shared)."""
    settings = settings or ImageSettings()
    root = settings.resolved_cache_dir()
    with _CACHES_LOCK:
        cache = _CACHES.get((settings, root))
        if cache is None:
            cache = ImageCache(
                root, budget_bytes=settings.budget_bytes,
                policy=LayerPolicy(max_image_bytes=settings.max_image_bytes,
                                   setuid=settings.setuid),
                registry=RegistryOptions(authfile=settings.authfile,
                                         registries_conf=settings.registries_conf,
                                         tls_verify=settings.tls_verify,
                                         timeout_s=settings.timeout_s),
                build_hosts=(settings.build_hosts if settings.build_network == "allowlist"
                             else None))
            _CACHES[(settings, root)] = cache
        return cache


def source_label(source: ImageSource) -> str:
    """How errors and progress bars name an image source."""
    return source.name if isinstance(source, BuildSpec) else str(source)


def prepare_image(source: ImageSource, settings: ImageSettings | None = None, *,
                  progress: Progress | None = None, refresh: bool = False) -> CachedImage:
    """Fetch or build ``source`` into the cache unless it is there (blocking)."""
    cache = cache_for(settings)
    if isinstance(source, BuildSpec):
        return build_image(cache, source, progress=progress)
    return cache.ensure(source, progress=progress, refresh=refresh)


def lease_image(source: ImageSource, settings: ImageSettings | None = None, *,
                progress: Progress | None = None) -> ImageLease:
    """:func:`prepare_image` plus a lease that keeps eviction away until it is released (what
    a sandbox holds while it runs on the image; blocking)."""
    cache = cache_for(settings)
    return cache.lease_of(lambda: prepare_image(source, settings, progress=progress),
                          source_label(source))


def lookup_image(source: ImageSource, settings: ImageSettings | None = None
                 ) -> CachedImage | None:
    """The cached image of ``source``, or None; never fetches or builds (blocking: a build's
    key hashes its context)."""
    cache = cache_for(settings)
    if isinstance(source, BuildSpec):
        return lookup_build(cache, source)
    return cache.lookup(source)
