"""Every bad image is one clear ImageError with its reason, and nothing of it lands outside the
cache directory (real registry on loopback, real skopeo and umoci)."""

from __future__ import annotations

import os
import subprocess
import uuid
import warnings
from pathlib import Path

import pytest

from rollout.runtime.sandbox.images import (
    ImageCache,
    ImageError,
    LayerPolicy,
    RegistryOptions,
)
from tests.fixtures.images import (
    Entry,
    Registry,
    free_port,
    layer_bytes,
    skip_unless_images,
    start_registry,
    write_layout,
)

BASE = [Entry("bin", "dir"), Entry("bin/ok", data=b"fine\n", mode=0o755)]


@pytest.fixture(autouse=True)
def _tools() -> None:
    skip_unless_images()


def _refused(cache: ImageCache, ref: str, reason: str, *needles: str) -> ImageError:
    with pytest.raises(ImageError) as e:
        cache.ensure(ref)
    err = e.value
    assert err.reason == reason, str(err)
    for needle in needles:
        assert needle in str(err), str(err)
    # Nothing half-made stays: no image, no staging.
    assert os.listdir(cache.root / "images") == []
    assert os.listdir(cache.root / "tmp") == []
    return err


def test_an_unknown_tag_is_image_not_found(image_registry: Registry, tmp_path: Path) -> None:
    cache = ImageCache(tmp_path / "c", registry=RegistryOptions(
        registries_conf=str(image_registry.registries_conf)))
    _refused(cache, image_registry.ref("library/busybox:no-such-tag"), "IMAGE_NOT_FOUND",
             "unknown image or tag", "manifest unknown")
    # Through the docker.io mirror of registries.conf as well.
    mirrored = ImageCache(tmp_path / "m", registry=RegistryOptions(
        registries_conf=str(image_registry.registries_conf)))
    _refused(mirrored, "docker://nosuchimage:1.0", "IMAGE_NOT_FOUND")


def test_a_registry_that_is_down_is_unreachable(tmp_path: Path) -> None:
    host = f"127.0.0.1:{free_port()}"
    conf = tmp_path / "registries.conf"
    conf.write_text(f'[[registry]]\nlocation = "{host}"\ninsecure = true\n')
    cache = ImageCache(tmp_path / "c", registry=RegistryOptions(registries_conf=str(conf)))
    err = _refused(cache, f"docker://{host}/library/busybox:latest",
                   "IMAGE_REGISTRY_UNREACHABLE", "cannot be reached", "connection refused")
    assert not err.task_fault  # the service's side, not the task's


def test_a_plain_http_registry_not_marked_insecure_says_so(image_registry: Registry,
                                                          tmp_path: Path) -> None:
    conf = tmp_path / "registries.conf"
    conf.write_text("")
    cache = ImageCache(tmp_path / "c", registry=RegistryOptions(registries_conf=str(conf)))
    _refused(cache, image_registry.ref("library/busybox:latest"),
             "IMAGE_REGISTRY_UNREACHABLE", "insecure = true")


def test_refused_credentials_are_auth_failed(busybox_layout: Path, tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt
    hashed = crypt.crypt("right", crypt.mksalt(crypt.METHOD_BLOWFISH))
    htpasswd = tmp_path / "htpasswd"
    htpasswd.write_text(f"tester:{hashed}\n")
    reg = start_registry(tmp_path / "reg", htpasswd=htpasswd)
    try:
        auth = tmp_path / "auth.json"
        subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false",
                        "--dest-creds=tester:right", f"oci:{busybox_layout}:bb",
                        f"docker://{reg.host}/private/bb:1"], check=True, timeout=120,
                       capture_output=True)
        import base64
        import json
        token = base64.b64encode(b"tester:wrong").decode()
        auth.write_text(json.dumps({"auths": {reg.host: {"auth": token}}}))
        cache = ImageCache(tmp_path / "c", registry=RegistryOptions(
            registries_conf=str(reg.registries_conf), authfile=str(auth)))
        _refused(cache, f"docker://{reg.host}/private/bb:1", "IMAGE_AUTH_FAILED",
                 "refused access")
        good = tmp_path / "good.json"
        good.write_text(json.dumps({"auths": {reg.host: {"auth": base64.b64encode(
            b"tester:right").decode()}}}))
        ok = ImageCache(tmp_path / "ok", registry=RegistryOptions(
            registries_conf=str(reg.registries_conf), authfile=str(good)))
        assert ok.ensure(f"docker://{reg.host}/private/bb:1").rootfs.is_dir()
    finally:
        reg.proc.kill()
        reg.proc.wait(timeout=30)


def test_another_architecture_is_refused(tmp_path: Path) -> None:
    ref = write_layout(tmp_path / "arm", [layer_bytes(BASE)], architecture="arm64")
    _refused(ImageCache(tmp_path / "c"), ref, "IMAGE_REJECTED", "arm64", "amd64")


@pytest.mark.parametrize(("entries", "needle"), [
    ([Entry("../../{marker}", data=b"x")], "'../' path"),
    ([Entry("bin/../../../{marker}", data=b"x")], "'../' path"),
    ([Entry("escape", "symlink", target="/tmp/{marker}"),
      Entry("escape/pwned", data=b"x")], "written through the symlink 'escape'"),
    ([Entry("up", "symlink", target="../../../../tmp/{marker}")], "climbs out"),
    ([Entry("dev", "dir"), Entry("dev/sda", "chr")], "a device node"),
    ([Entry("bin/two", "hardlink", target="bin/ok")], "hard links across layers"),
    ([Entry("bin/abs", "hardlink", target="/etc/shadow")], "outside the image's root"),
], ids=["dotdot", "dotdot-inside", "abs-symlink-write-through", "relative-symlink-escape",
        "device", "hardlink-across-layers", "hardlink-absolute"])
def test_hostile_layers_are_refused_and_nothing_lands_outside(
        tmp_path: Path, entries: list[Entry], needle: str) -> None:
    marker = f"rollout-escape-{uuid.uuid4().hex[:8]}"
    evil = [Entry(e.name.format(marker=marker), e.kind, e.data,
                  e.target.format(marker=marker), e.mode) for e in entries]
    ref = write_layout(tmp_path / "evil", [layer_bytes(BASE), layer_bytes(evil)])
    cache_root = tmp_path / "deep" / "er" / "c"
    _refused(ImageCache(cache_root), ref, "IMAGE_REJECTED", "layer 2", needle)
    for where in (tmp_path, tmp_path / "deep", Path("/tmp"), Path("/")):
        assert not (where / marker).exists()


def test_setuid_files_are_stripped_by_default_and_refused_on_request(tmp_path: Path) -> None:
    layer = layer_bytes([*BASE, Entry("bin/su", data=b"#!/bin/sh\n", mode=0o4755),
                         Entry("bin/sg", data=b"#!/bin/sh\n", mode=0o2755)])
    ref = write_layout(tmp_path / "suid", [layer])
    image = ImageCache(tmp_path / "c").ensure(ref)
    for name in ("su", "sg"):
        mode = os.stat(image.rootfs / "bin" / name).st_mode
        assert mode & 0o6000 == 0 and mode & 0o755 == 0o755
    strict = ImageCache(tmp_path / "strict", policy=LayerPolicy(setuid="refuse"))
    _refused(strict, ref, "IMAGE_REJECTED", "setuid/setgid file", "bin/su")


def test_a_tar_bomb_over_the_size_budget_is_refused_before_it_lands(tmp_path: Path) -> None:
    bomb = layer_bytes([*BASE, Entry("zeros", size=64 << 20)])  # 64 MiB of zeros
    assert len(bomb) < 1 << 20
    ref = write_layout(tmp_path / "bomb", [bomb])
    cache = ImageCache(tmp_path / "c", policy=LayerPolicy(max_image_bytes=16 << 20))
    _refused(cache, ref, "IMAGE_REJECTED", "size budget", str(16 << 20))


def test_a_full_disk_during_unpack_is_disk_full(busybox_layout: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    # Room for the fetched layout (about 1 MiB compressed), not for the unpacked root (2 MiB).
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2700k", "tmpfs", str(small)],
                   check=True)
    try:
        cache = ImageCache(small / "c")
        err = _refused(cache, f"oci:{busybox_layout}:bb", "IMAGE_DISK_FULL", "is full")
        assert not err.task_fault
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_a_missing_local_layout_is_not_found(tmp_path: Path) -> None:
    _refused(ImageCache(tmp_path / "c"), f"oci:{tmp_path}/nothing:t", "IMAGE_NOT_FOUND")
