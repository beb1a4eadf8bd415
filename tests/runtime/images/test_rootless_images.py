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
        assert seen["sandboxes_left"] == []
    finally:
        shutil.rmtree(top, ignore_errors=True)
