"""bwrap sandboxes whose root is a cached image: copy-on-write per job, the image's config, the
tools in any image (real bubblewrap, real registry, real skopeo/umoci)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout.runtime.sandbox import SandboxConfig, create_sandbox
from rollout.runtime.sandbox.base import ImageSettings, python_argv
from rollout.runtime.sandbox.images import ImageError, cache_for
from rollout.runtime.tools.editor import EditorTool
from tests.fixtures.images import Registry
from tests.fixtures.venvs import venv_with_our_packages

REPO = Path(__file__).resolve().parents[3]


def _config(tmp_path: Path, settings: ImageSettings, **kw: object) -> SandboxConfig:
    return SandboxConfig(state_dir=tmp_path / "state", images=settings, **kw)  # type: ignore[arg-type]


async def test_jobs_on_one_image_write_copy_on_write_and_never_into_the_cache(
        tmp_path: Path, image_settings: ImageSettings) -> None:
    cfg = _config(tmp_path, image_settings)
    a = await create_sandbox(cfg, image="docker://python:3.11-slim")
    b = await create_sandbox(cfg, image="docker://python:3.11-slim")
    async with a, b:
        image = a.image.image  # type: ignore[attr-defined]
        before = sorted(os.listdir(image.rootfs / "etc"))
        r = await a.exec("echo from-a > /etc/written-by-a && rm /etc/hostname && "
                         "python3 -c 'import sys; print(sys.version_info[:2])'")
        assert r.ok, r.output
        assert "(3, 11)" in r.stdout
        # The other job sees the image as it is, and so does the cache.
        r = await b.exec("cat /etc/written-by-a; test -e /etc/hostname && echo still-there")
        assert "No such file" in r.stderr and "still-there" in r.stdout
        assert sorted(os.listdir(image.rootfs / "etc")) == before
        # Another launch of the same job (a new bwrap) sees its own writes.
        r = await a.exec("cat /etc/written-by-a; test -e /etc/hostname || echo gone")
        assert r.stdout.split() == ["from-a", "gone"]
        # The job runs as an unprivileged uid that may still change the image's files.
        r = await a.exec("id -u; echo more >> /usr/lib/os-release && tail -1 /usr/lib/os-release")
        assert r.ok and r.stdout.split()[-1] == "more"
        if os.geteuid() == 0:
            assert r.stdout.split()[0] != "0"
        # The image's root may change any of the image's files, but not bwrap's /dev (a
        # tmpfs without a size); /dev/shm is the job's own, and multiprocessing's locks work.
        r = await a.exec("python3 -c 'import multiprocessing as m; m.Lock(); print(\"locks\")';"
                         " : > /dev/x || echo dev-refused")
        assert r.stdout.split() == ["locks", "dev-refused"], r.output
        assert "Read-only file system" in r.stderr, r.stderr
    for sb in (a, b):
        assert not sb.path.exists()  # type: ignore[attr-defined]
    assert cache_for(image_settings).entries()[0].in_use is False


async def test_the_image_config_applies_and_every_tool_works_in_a_busybox_image(
        tmp_path: Path, image_settings: ImageSettings, image_registry: Registry) -> None:
    cfg = _config(tmp_path, image_settings)
    async with await create_sandbox(cfg, image="docker://busybox:latest",
                                    env={"FROM_JOB": "1"}) as sb:
        r = await sb.exec(["sh", "-c", "pwd; echo $PATH; echo $FROM_JOB; ls /usr 2>&1"])
        lines = r.stdout.splitlines()
        assert lines[0] == "/root"  # WorkingDir
        assert lines[1].startswith("/bin:") and lines[2] == "1"
        assert "No such file" in lines[3]  # the host's /usr is not there
        # The image has no bash: the static one of /.rollout/bin stands in.
        bash = await sb.bash()
        out = await bash.run("cd /tmp && export X=7 && echo $BASH_VERSION")
        assert out.exit_code == 0 and out.output.strip()
        assert (await bash.run("pwd; echo $X")).output.split() == ["/tmp", "7"]
        editor = EditorTool(sb)
        created = await editor({"command": "create", "path": "/workspace/a.txt",
                                     "file_text": "hello\n"})
        assert not created.is_error, created.output
        viewed = await editor({"command": "view", "path": "/workspace/a.txt"})
        assert "hello" in viewed.output
        kernel = await sb.ipython()
        cell = await kernel.execute("import os; print(sorted(os.listdir('/bin'))[:3], "
                                    "open('/workspace/a.txt').read().strip())")
        assert cell.status == "ok" and "hello" in cell.output and "busybox" in cell.output


async def test_a_server_wide_image_is_every_sandboxs_root(
        tmp_path: Path, image_settings: ImageSettings) -> None:
    cfg = _config(tmp_path, image_settings, image="docker://debian:bookworm-slim")
    async with await create_sandbox(cfg) as sb:
        r = await sb.exec("cat /etc/debian_version")
        assert r.ok and r.stdout.startswith("12")


async def test_a_bad_image_fails_sandbox_creation_with_its_reason(
        tmp_path: Path, image_settings: ImageSettings, image_registry: Registry) -> None:
    cfg = _config(tmp_path, image_settings)
    with pytest.raises(ImageError) as e:
        await create_sandbox(cfg, image="docker://python:0.0-nonexistent")
    assert e.value.reason == "IMAGE_NOT_FOUND" and "python:0.0-nonexistent" in str(e.value)
    with pytest.raises(ImageError) as e:
        await create_sandbox(cfg, image="python:3.11")
    assert e.value.reason == "INVALID_IMAGE_REF"
    sandboxes = tmp_path / "state" / "sandboxes"
    assert not sandboxes.exists() or os.listdir(sandboxes) == []


@pytest.fixture
def system_venv() -> Iterator[str]:
    """What ``python3 -m venv .venv`` makes on Debian: a venv of the system's
    ``/usr/bin/pythonX.Y`` (its base below ``/usr``, which an image sandbox never binds over
    the image's own), outside the system trees, whose one ``.pth`` adds this venv's packages
    (IPython and the kernel); its python's path."""
    exe = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    build = REPO / "build"
    if not os.path.isfile(exe):
        pytest.skip(f"{exe} is missing: the test needs a system Python of this venv's version")
    if any(str(build) == t or str(build).startswith(t + "/") for t in ("/usr", "/opt", "/tmp",
                                                                        "/var")):
        pytest.skip("the test's venv must lie outside /usr, /opt, /tmp and /var")
    build.mkdir(exist_ok=True)
    top = Path(tempfile.mkdtemp(prefix="system-venv-", dir=build))
    try:
        yield venv_with_our_packages(exe, top / "venv")
    finally:
        shutil.rmtree(top, ignore_errors=True)


async def test_a_server_on_a_venv_of_the_system_python_has_the_python_tool_in_images(
        tmp_path: Path, image_settings: ImageSettings, image_registry: Registry,
        system_venv: str) -> None:
    # Its base lies below /usr, the image's own: the interpreter is bound at /.rollout/python
    # instead, where the kernel and the in-sandbox scripts run it through the host's loader.
    cfg = _config(tmp_path, image_settings, python=system_venv)
    async with await create_sandbox(cfg, image="docker://busybox:latest") as sb:
        r = await sb.exec([*python_argv(sb), "-c", "import json, ssl, sys; "
                           "print(sys.prefix, sys.base_prefix, sys.version_info[:2])"])
        assert r.ok, r.output
        assert r.stdout.split()[:2] == ["/.rollout/python/venv", "/.rollout/python/base"]
        kernel = await sb.ipython()
        cell = await kernel.execute("import os, sys; print(sys.executable, "
                                    "sorted(os.listdir('/bin'))[:3])")
        assert cell.status == "ok", cell.output
        assert "/.rollout/python/venv/bin/python" in cell.output and "busybox" in cell.output
        r = await sb.exec(["sh", "-c", "ls /usr 2>&1"])
        assert "No such file" in r.output  # the host's /usr is still not there
