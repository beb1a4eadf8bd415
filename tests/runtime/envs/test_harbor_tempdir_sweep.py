"""A Harbor job's host temporary folder (verifier output, tests, the oracle's solution) outlives
a SIGKILLed server unless the next start-up sweep removes it; the sweep must never remove the
folder of a server that is still running on the same host."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollout.runtime.sandbox import reap_stale

pytestmark = pytest.mark.timeout(60)

# A stand-in for the server process: it makes a Harbor job's folders exactly as the handler's
# INIT does, says where, and waits to be killed (or ends with its pipe).
_OWNER = textwrap.dedent("""
    import sys
    from rollout.runtime.envs.harbor.handler import _job_dirs
    dirs, _lock = _job_dirs(None)
    (dirs["verifier"] / "reward.txt").write_text("1")
    print(dirs["root"], flush=True)
    sys.stdin.read()
""")


def _owner(tmp: Path) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen([sys.executable, "-c", _OWNER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, "the owner process made no folder"
    return proc, Path(line)


def test_dead_servers_harbor_folders_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    dead, dead_dir = _owner(tmp_path)
    live, live_dir = _owner(tmp_path)
    try:
        assert dead_dir.parent == tmp_path and dead_dir.name.startswith("rollout-harbor-")
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=30)
        assert dead_dir.is_dir()  # a SIGKILLed owner cleans nothing itself

        report = reap_stale(tmp_path / "sandboxes", temp_root=tmp_path)

        assert not os.path.lexists(dead_dir)
        assert report.temp_dirs == [str(dead_dir)]
        assert (live_dir / "verifier" / "reward.txt").read_text() == "1"
        # Not anything else in the temp folder that looks alike but was never locked.
        other = tmp_path / "rollout-harbor-unlocked"
        other.mkdir()
        assert reap_stale(tmp_path / "sandboxes", temp_root=tmp_path).temp_dirs == []
        assert other.is_dir() and live_dir.is_dir()
    finally:
        live.kill()
        live.wait(timeout=30)
    # Its owner gone, the live server's folder goes at the next sweep too.
    assert reap_stale(tmp_path / "sandboxes", temp_root=tmp_path).temp_dirs == [str(live_dir)]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_look_alike_folder_of_another_user_is_left_alone(tmp_path: Path) -> None:
    """The temp folder is everyone's: another user's ``rollout-harbor-*`` folder with an
    unlocked ``lock`` file is theirs, not a dead server's."""
    theirs = tmp_path / "rollout-harbor-theirs"
    theirs.mkdir()
    (theirs / "lock").write_text("")
    (theirs / "keep.txt").write_text("mine")
    for path in (theirs / "keep.txt", theirs / "lock", theirs):
        os.lchown(path, 54321, 54321)
    assert reap_stale(tmp_path / "sandboxes", temp_root=tmp_path).temp_dirs == []
    assert (theirs / "keep.txt").read_text() == "mine"
