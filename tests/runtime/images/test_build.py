"""Dockerfile builds with real buildah (chroot isolation), FROM resolved through the
registries.conf mirror to the loopback registry; the result lands in the image cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollout.runtime.sandbox import SandboxConfig, create_sandbox
from rollout.runtime.sandbox.base import ImageSettings
from rollout.runtime.sandbox.images import (
    BuildSpec,
    ImageError,
    build_image,
    cache_for,
    context_key,
    lookup_build,
)
from tests.fixtures.images import Registry, skip_unless_images

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def _buildah() -> None:
    skip_unless_images("buildah")


def _context(root: Path, dockerfile: str, **files: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "Dockerfile").write_text(dockerfile)
    for name, text in files.items():
        (root / name).write_text(text)
    return root


@pytest.mark.slow
def test_a_dockerfile_builds_once_into_the_cache_and_again_when_edited(
        image_registry: Registry, image_settings: ImageSettings, tmp_path: Path) -> None:
    ctx = _context(tmp_path / "ctx", "FROM python:3.11-slim\nCOPY data.txt /app/data.txt\n"
                   "RUN python3 -c \"open('/built', 'w').write('yes')\"\n"
                   "ENV GREETING=hello\nWORKDIR /app\n", **{"data.txt": "v1"})
    cache = cache_for(image_settings)
    stages: list[str] = []
    spec = BuildSpec(ctx, label="task-a", timeout_s=300)
    image = build_image(cache, spec, progress=stages.append)
    assert image.action == "built" and "building" in stages
    assert (image.rootfs / "built").read_text() == "yes"
    assert (image.rootfs / "app" / "data.txt").read_text() == "v1"
    assert image.config.working_dir == "/app" and image.config.env_dict["GREETING"] == "hello"
    again = build_image(cache, spec)
    assert again.action == "cached" and again.digest == image.digest
    assert lookup_build(cache, spec) is not None
    (ctx / "data.txt").write_text("v2")
    assert lookup_build(cache, spec) is None
    edited = build_image(cache, spec)
    assert edited.digest != image.digest and (edited.rootfs / "app/data.txt").read_text() == "v2"


def test_a_failing_build_says_so_with_the_log_tail(
        image_registry: Registry, image_settings: ImageSettings, tmp_path: Path) -> None:
    ctx = _context(tmp_path / "bad", "FROM python:3.11-slim\n"
                   "RUN echo the-step-that-breaks >&2 && exit 3\n")
    with pytest.raises(ImageError) as e:
        build_image(cache_for(image_settings), BuildSpec(ctx, label="task-bad", timeout_s=300))
    assert e.value.reason == "IMAGE_BUILD_FAILED"
    assert "task-bad" in str(e.value) and "the-step-that-breaks" in str(e.value)
    missing = _context(tmp_path / "nobase", "FROM python:0.0-nope\n")
    with pytest.raises(ImageError) as e:
        build_image(cache_for(image_settings), BuildSpec(missing, label="t", timeout_s=300))
    assert e.value.reason == "IMAGE_BUILD_FAILED" and "python:0.0-nope" in str(e.value)
    assert os.listdir(Path(image_settings.cache_dir) / "images") == []


def test_a_build_past_its_deadline_is_killed(
        image_registry: Registry, image_settings: ImageSettings, tmp_path: Path) -> None:
    ctx = _context(tmp_path / "slow", "FROM python:3.11-slim\nRUN sleep 600\n")
    with pytest.raises(ImageError) as e:
        build_image(cache_for(image_settings), BuildSpec(ctx, label="slow", timeout_s=8))
    assert e.value.reason == "IMAGE_BUILD_FAILED" and "did not finish within 8 s" in str(e.value)


def test_the_context_key_covers_files_modes_and_args(tmp_path: Path) -> None:
    ctx = _context(tmp_path / "k", "FROM scratch\n", a="1")
    base = context_key(BuildSpec(ctx))
    assert context_key(BuildSpec(ctx, build_args=(("X", "1"),))) != base
    os.chmod(ctx / "a", 0o755)
    assert context_key(BuildSpec(ctx)) != base
    with pytest.raises(ImageError, match="no Dockerfile"):
        context_key(BuildSpec(tmp_path, label="empty"))


async def test_init_builds_lazily_when_a_jobs_image_is_missing(
        image_registry: Registry, image_settings: ImageSettings, tmp_path: Path) -> None:
    ctx = _context(tmp_path / "lazy", "FROM busybox\nRUN echo lazy > /made-by-build\n")
    cfg = SandboxConfig(state_dir=tmp_path / "state", images=image_settings)
    async with await create_sandbox(cfg, image=BuildSpec(ctx, label="lazy", timeout_s=300)) as sb:
        r = await sb.exec(["cat", "/made-by-build"])
        assert r.stdout == "lazy\n"
