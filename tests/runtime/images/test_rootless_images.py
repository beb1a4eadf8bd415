"""The rootless path for real: image sandboxes made by a server that is not root (an
unprivileged uid with no capabilities, its own cache). The overlay's copy-on-write root is
mounted by each launch in a user namespace of its own (bubblewrap 0.8 has no ``--overlay``);
the writes land in the sandbox's upper layer, the cached image stays as it was, and the image
config's ``User`` maps onto the server's user."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from rollout.runtime.sandbox.base import ImageSettings

pytestmark = pytest.mark.timeout(300)

NOBODY = 65534
CHILD = Path(__file__).with_name("rootless_child.py")


def _system_python() -> str:
    """An interpreter the unprivileged user can run with this venv's packages (a pyenv
    interpreter under root's 0700 home cannot be)."""
    exe = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    if not os.path.isfile(exe):
        pytest.skip(f"{exe} is missing: the unprivileged child needs a system Python of this "
                    "venv's version")
    return exe


def test_a_rootless_server_runs_image_sandboxes_copy_on_write(user_layout: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the other image tests already run rootless here")
    python = _system_python()
    site = sysconfig.get_paths()["purelib"]
    top = Path(tempfile.mkdtemp(prefix="rootless-images-", dir="/tmp"))
    try:
        shutil.copytree(user_layout, top / "layout")
        for d, _, files in os.walk(top):
            for name in (d, *(os.path.join(d, f) for f in files)):
                os.lchown(name, NOBODY, NOBODY)
        os.chmod(top, 0o755)
        boot = (f"import site, runpy, sys; site.addsitedir({site!r}); "
                f"sys.argv = [{str(CHILD)!r}, {str(top)!r}]; "
                f"runpy.run_path({str(CHILD)!r}, run_name='__main__')")
        proc = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             "--inh-caps=-all", "env", "-i", f"HOME={top}", "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
             python, "-c", boot], capture_output=True, text=True, timeout=240, cwd=top)
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen = json.loads(proc.stdout.strip().splitlines()[-1])
        assert seen["euid"] == NOBODY
        # The image's root is the server's own user; the job changes the image's files.
        assert seen["root_exec"][:2] == [0, ["0", "hi"]], seen["root_exec"]
        assert seen["bash"][0] == "hi"  # the long-lived bash launch sees the other's write
        assert seen["second_launch"] == ["hi", "gone"]
        # Into the upper layer, never the cache.
        assert seen["upper_written"] == "hi\n"
        assert seen["cache_written"] is False and seen["cache_passwd"] is True
        # The image's User maps onto the server's user too.
        assert seen["named"][:2] == [0, ["1000", "1001", "/home/app", "ok"]], seen["named"]
        assert seen["as_root"][:2] == [0, ["0", "/tmp/home"]], seen["as_root"]
        # The copy fallback (forced): same behaviour, no holder, the cache untouched.
        assert seen["copy_exec"][:2] == [0, ["0", "copied"]], seen["copy_exec"]
        assert seen["copy_bash"][0] == "copied" and seen["copy_second"] == ["gone"]
        assert seen["copy_holder"] is False and seen["copy_in_sandbox"] == "copied\n"
        assert seen["copy_cache_written"] is False and seen["copy_cache_passwd"] is True
        assert seen["copy_named"][:2] == [0, ["1000", "/home/app", "ok"]], seen["copy_named"]
        assert seen["sandboxes_left"] == []
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_a_refused_overlay_is_found_once_then_every_sandbox_copies(
        tmp_path: Path, busybox_layout: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # A kernel older than 5.11 (or an upper layer on a filesystem it rejects) refuses the
    # holder's mount; this kernel accepts it, so the refusal is played by a stand-in holder.
    # The first sandbox finds it and copies, says so once, and the next ones copy at once.
    from rollout.runtime.sandbox import bwrap
    from rollout.runtime.sandbox.images import lease_image

    tries: list[str] = []

    def refused(rootfs: Path, path: Path, sid: str) -> None:
        tries.append(sid)
        raise bwrap._OverlayRefused("mount: permission denied")

    monkeypatch.setattr(bwrap, "_userns_overlay", refused)
    monkeypatch.setattr(bwrap, "_OVERLAY_REFUSED", {})
    lease = lease_image(f"oci:{busybox_layout}:bb",
                        ImageSettings(cache_dir=str(tmp_path / "cache")))
    try:
        for sid in ("a", "b"):
            (tmp_path / sid / "root").mkdir(parents=True)
            with caplog.at_level("INFO", logger=bwrap.__name__):
                assert bwrap._rootless_root("auto", lease, tmp_path / sid, sid) is None
            assert (tmp_path / sid / "root" / "bin" / "busybox").is_file()
        assert tries == ["a"]
        warnings = [r for r in caplog.records if "refused a rootless overlay" in r.message]
        assert len(warnings) == 1 and "private copy" in warnings[0].message
        # "overlay" never falls back: the refusal is the sandbox's error.
        (tmp_path / "c" / "root").mkdir(parents=True)
        with pytest.raises(bwrap._OverlayRefused):
            bwrap._rootless_root("overlay", lease, tmp_path / "c", "c")
        assert list((tmp_path / "c" / "root").iterdir()) == []
    finally:
        lease.release()
