"""The image cache against a real registry on loopback, real skopeo and umoci."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import threading
from pathlib import Path

import pytest

from rollout.runtime.sandbox.images import (
    ImageCache,
    ImageError,
    RegistryOptions,
    cache_for,
    parse_image_ref,
    prepare_image,
    with_transport,
)
from tests.fixtures.images import Registry


def test_references_parse_into_values_and_bad_ones_say_what_is_valid() -> None:
    ref = parse_image_ref("docker://python:3.11-slim")
    assert (ref.transport, ref.target, str(ref)) == ("docker", "python:3.11-slim",
                                                     "docker://python:3.11-slim")
    oci = parse_image_ref("oci:/data/layout:v1")
    assert (oci.transport, oci.target, oci.tag) == ("oci", "/data/layout", "v1")
    assert parse_image_ref("oci-archive:/x/img.tar").target == "/x/img.tar"
    pinned = parse_image_ref("docker://reg.example/a/b@sha256:" + "a" * 64)
    assert pinned.pinned_digest == "sha256:" + "a" * 64
    for bad, why in (("python:3.11", "no known transport"), ("docker://UPPER/x", "registry"),
                     ("oci:relative/dir", "absolute"), ("", "empty"),
                     ("docker://a b", "whitespace")):
        with pytest.raises(ImageError) as e:
            parse_image_ref(bad)
        assert e.value.reason == "INVALID_IMAGE_REF" and why in str(e.value)
        assert "docker://NAME[:TAG]" in str(e.value)
    # As data sets and Dockerfiles spell an image: a registry reference unless it names a
    # transport (a bad one stays as it is, for the parser to refuse).
    assert with_transport(" python:3.11-slim ") == "docker://python:3.11-slim"
    for spelled in ("docker://a/b:1", "oci:/l:t", "oci-archive:/x.tar", "oci:relative"):
        assert with_transport(spelled) == spelled


def test_a_registry_image_is_fetched_once_and_its_config_kept(
        image_registry: Registry, tmp_path: Path) -> None:
    settings = image_registry.settings(tmp_path / "c")
    stages: list[str] = []
    image = prepare_image("docker://busybox:latest", settings, progress=stages.append)
    assert image.action == "pulled" and image.digest.startswith("sha256:")
    assert stages[:1] == ["fetching"] and "unpacking" in stages and stages[-1] == "done"
    assert (image.rootfs / "bin" / "busybox").is_file()
    assert image.config.env_dict["PATH"] == "/bin" and image.config.working_dir == "/root"
    assert image.path.name == image.digest.split(":")[1]
    again = prepare_image("docker://busybox:latest", settings)
    assert again.action == "cached" and again.digest == image.digest
    # Straight at the registry, the same manifest: the same cache entry, not a second unpack.
    direct = prepare_image(image_registry.ref("library/busybox:latest"), settings)
    assert direct.digest == image.digest
    assert len(list((tmp_path / "c" / "images").iterdir())) == 1


def test_local_layouts_and_archives_are_references_too(
        busybox_layout: Path, tmp_path: Path) -> None:
    cache = ImageCache(tmp_path / "c")
    from_layout = cache.ensure(f"oci:{busybox_layout}:bb")
    archive = tmp_path / "bb.tar"
    subprocess.run(["skopeo", "copy", "--quiet", f"oci:{busybox_layout}:bb",
                    f"oci-archive:{archive}"], check=True, timeout=120)
    from_archive = cache.ensure(f"oci-archive:{archive}")
    assert from_archive.digest == from_layout.digest
    assert (from_archive.rootfs / "bin" / "sh").is_symlink()


def _layer_types(layout: Path) -> list[str]:
    index = json.loads((layout / "index.json").read_text())
    digest = index["manifests"][0]["digest"].split(":")[1]
    manifest = json.loads((layout / "blobs" / "sha256" / digest).read_text())
    return [d["mediaType"] for d in manifest["layers"]]


async def test_zstd_layers_are_recompressed_and_run(busybox_layout: Path, tmp_path: Path) -> None:
    # Made offline as a registry would serve a zstd image (skopeo, as `podman push
    # --compression-format zstd` does); umoci 0.4 cannot unpack such layers itself.
    zstd = tmp_path / "zstd"
    subprocess.run(["skopeo", "copy", "--quiet", "--dest-compress-format", "zstd",
                    f"oci:{busybox_layout}:bb", f"oci:{zstd}:z"], check=True, timeout=120)
    assert _layer_types(zstd) == ["application/vnd.oci.image.layer.v1.tar+zstd"]
    cache = ImageCache(tmp_path / "c")
    image = cache.ensure(f"oci:{zstd}:z")
    assert image.action == "pulled" and (image.rootfs / "bin" / "busybox").is_file()
    assert image.config.working_dir == "/root"
    assert cache.ensure(f"oci:{zstd}:z").digest == image.digest  # one key per image
    from rollout.runtime.sandbox import SandboxConfig, create_sandbox
    from rollout.runtime.sandbox.base import ImageSettings
    cfg = SandboxConfig(state_dir=tmp_path / "state",
                        images=ImageSettings(cache_dir=str(tmp_path / "c")))
    async with await create_sandbox(cfg, image=f"oci:{zstd}:z") as sb:
        r = await sb.exec(["sh", "-c", "echo ran-in-zstd-image; ls /bin/busybox"])
        assert r.ok and r.stdout.split() == ["ran-in-zstd-image", "/bin/busybox"], r.output


def _fetch_in_process(root: str, ref: str, conf: str, out: str) -> None:
    cache = ImageCache(root, registry=RegistryOptions(registries_conf=conf))
    image = cache.ensure(ref)
    Path(out).write_text(json.dumps([image.digest, image.action]))


def test_concurrent_first_uses_coalesce_into_one_fetch_across_threads_and_processes(
        image_registry: Registry, tmp_path: Path) -> None:
    root = tmp_path / "c"
    ref = "docker://busybox:latest"
    conf = str(image_registry.registries_conf)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_fetch_in_process,
                         args=(str(root), ref, conf, str(tmp_path / f"p{i}.json")))
             for i in range(2)]
    results: list[tuple[str, str]] = []

    def in_thread() -> None:
        cache = ImageCache(root, registry=RegistryOptions(registries_conf=conf))
        image = cache.ensure(ref)
        results.append((image.digest, image.action))

    threads = [threading.Thread(target=in_thread) for _ in range(3)]
    for p in procs:
        p.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    results += [tuple(json.loads((tmp_path / f"p{i}.json").read_text())) for i in range(2)]
    assert len(results) == 5 and len({d for d, _ in results}) == 1
    assert sorted(a for _, a in results) == ["cached"] * 4 + ["pulled"]


def test_eviction_removes_only_images_no_sandbox_holds(
        image_registry: Registry, busybox_layout: Path, tmp_path: Path) -> None:
    # Two different images: busybox, and busybox with one more file.
    other = tmp_path / "other"
    subprocess.run(["skopeo", "copy", "--quiet", f"oci:{busybox_layout}:bb",
                    f"oci:{other}:bb"], check=True, timeout=120)
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "marker").write_text("x")
    subprocess.run(["umoci", "insert", "--rootless", "--image", f"{other}:bb",
                    str(extra / "marker"), "/marker"], check=True, timeout=120)
    first = ImageCache(tmp_path / "c").ensure(f"oci:{busybox_layout}:bb")
    budget = first.size_bytes + first.size_bytes // 2  # room for one image, not two
    cache = ImageCache(tmp_path / "c", budget_bytes=budget)
    lease = cache.acquire(f"oci:{busybox_layout}:bb")
    second = cache.ensure(f"oci:{other}:bb")  # over budget, but the first one is leased
    assert first.rootfs.is_dir() and second.rootfs.is_dir()
    assert [e.in_use for e in cache.entries() if e.digest == first.digest] == [True]
    lease.release()
    assert cache.evict() == [first.digest]  # least recently used and no longer held
    assert not first.path.exists() and second.rootfs.is_dir()
    assert cache.lookup(f"oci:{busybox_layout}:bb") is None


def test_an_image_over_the_whole_cache_budget_is_refused(
        busybox_layout: Path, tmp_path: Path) -> None:
    cache = ImageCache(tmp_path / "c", budget_bytes=1000)
    with pytest.raises(ImageError) as e:
        cache.ensure(f"oci:{busybox_layout}:bb")
    assert e.value.reason == "IMAGE_REJECTED" and "cache budget" in str(e.value)
    assert os.listdir(tmp_path / "c" / "images") == [] and os.listdir(tmp_path / "c" / "tmp") == []


def test_cache_for_shares_one_cache_per_settings(image_registry: Registry,
                                                 tmp_path: Path) -> None:
    settings = image_registry.settings(tmp_path / "c")
    assert cache_for(settings) is cache_for(settings)
    assert cache_for(settings).registry.registries_conf == str(image_registry.registries_conf)
