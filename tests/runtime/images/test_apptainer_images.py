"""The Apptainer runtime takes the same image references and the same cache, against the
TEST-ONLY stand-in of the CLI (``tests/runtime/fake_singularity``: no apptainer binary exists on
our machines; it records the command lines and runs commands on the host). Checked: the cached
rootfs directory is what the instance starts, the image's Env reaches the container, the lease
holds eviction off until destroy; skopeo and umoci are real."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout.runtime.sandbox import SandboxConfig, create_sandbox
from rollout.runtime.sandbox.apptainer import uses_image_cache
from rollout.runtime.sandbox.base import ImageSettings
from rollout.runtime.sandbox.images import BuildSpec, cache_for

FAKE_DIR = Path(__file__).parents[1] / "fake_singularity"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="rai", dir="/tmp"))
    monkeypatch.setenv("PATH", f"{FAKE_DIR}:/usr/local/bin:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_SINGULARITY_LOG", str(d / "calls.jsonl"))
    monkeypatch.setenv("FAKE_SINGULARITY_STATE", str(d / "instances"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def test_an_oci_reference_starts_the_cached_rootfs(fake: Path, busybox_layout: Path,
                                                          tmp_path: Path) -> None:
    settings = ImageSettings(cache_dir=str(tmp_path / "cache"))
    cfg = SandboxConfig(runtime="apptainer", state_dir=tmp_path / "state", images=settings)
    sb = await create_sandbox(cfg, image=f"oci:{busybox_layout}:bb")
    async with sb:
        calls = [json.loads(line) for line in (fake / "calls.jsonl").read_text().splitlines()]
        start = next(c for c in calls if c[:2] == ["instance", "start"])
        cached = cache_for(settings).lookup(f"oci:{busybox_layout}:bb")
        assert cached is not None and start[-2] == str(cached.rootfs)
        assert sb.spawn_env()["APPTAINERENV_PATH"] == "/bin"  # the image's Env
        assert cache_for(settings).entries()[0].in_use
    assert not cache_for(settings).entries()[0].in_use


def test_which_images_go_through_the_cache() -> None:
    cfg = SandboxConfig(runtime="apptainer")
    cache_pulls = SandboxConfig(runtime="apptainer", images=ImageSettings(apptainer_pulls="cache"))
    assert uses_image_cache("oci:/x/layout:t", cfg)
    assert uses_image_cache("docker-archive:/x/a.tar", cfg)
    assert uses_image_cache(BuildSpec(Path("/ctx")), cfg)
    assert not uses_image_cache("docker://python:3.11", cfg)  # Apptainer's own pull into a SIF
    assert uses_image_cache("docker://python:3.11", cache_pulls)
    assert not uses_image_cache("/images/x.sif", cfg)
    assert not uses_image_cache("oras://ghcr.io/x/y:1", cache_pulls)
