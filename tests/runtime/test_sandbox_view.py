"""What a job's sandbox can see of the host: only what the job needs (the minimal view), never
the state dir, task files, data sets, home directories, the service's checkout or other jobs'
files. The host view is the control: the same probes find all of them there."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout.runtime.envs.common import DATA_DIR
from rollout.runtime.sandbox import SandboxConfig, create_sandbox
from rollout.runtime.sandbox.view import PACKAGE_ROOT, python_prefixes

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")]

NEEDED_TOP = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "proc", "dev",
              "tmp", "workspace", ".sandbox"}


@dataclasses.dataclass
class Host:
    config: SandboxConfig
    task_file: Path
    other_job: Path


@pytest.fixture
def host() -> Iterator[Host]:
    """A state dir and a task file outside /tmp (a sandbox's /tmp is its own, which would hide
    them for the wrong reason), and another job's sandbox directory in that state dir."""
    root = Path(tempfile.mkdtemp(prefix="rollout-view-", dir="/var/tmp"))
    root.chmod(0o755)  # readable by anyone, as task files and checkouts usually are
    try:
        tasks = root / "tasks"
        tasks.mkdir()
        task_file = tasks / "swe.jsonl"
        shutil.copy(DATA_DIR / "swe.jsonl", task_file)
        other = root / "state" / "sandboxes" / "otherjob" / "workspace"
        other.mkdir(parents=True)
        (other / "their-answer.txt").write_text("42")
        yield Host(SandboxConfig(state_dir=root / "state"), task_file, other)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _private_paths(host: Host) -> list[str]:
    """Host paths no job may read: state, task file, data sets, checkouts, home directories."""
    paths = [str(host.config.state_dir), str(host.task_file), str(host.other_job),
             str(DATA_DIR / "swe.jsonl"), str(DATA_DIR / "swe_repos"),
             str(PACKAGE_ROOT / "runtime"), str(PACKAGE_ROOT / ".git"),
             "/work/main/runtime", "/work/main/.git"]
    interpreter_dirs = {os.path.dirname(p) for p in python_prefixes("")}
    for home in {str(Path.home()), "/root", *(str(p) for p in Path("/home").glob("*"))}:
        if os.path.isdir(home):
            try:
                names = os.listdir(home)
            except OSError:
                continue
            for name in names:
                path = os.path.join(home, name)
                # Only the interpreter's own directories (pyenv) lead through a home.
                if not any(d == path or d.startswith(path + "/") for d in interpreter_dirs):
                    paths.append(path)
    return [p for p in paths if os.path.lexists(p)]


async def _visible(config: SandboxConfig, paths: list[str]) -> list[str]:
    script = 'for p in "$@"; do [ -e "$p" ] || [ -L "$p" ] && echo "$p"; done; true'
    async with await create_sandbox(config) as sb:
        res = await sb.exec(["bash", "-c", script, "probe", *paths], timeout=60)
        assert res.exit_code == 0, res
        return res.stdout.split("\n")[:-1]


async def test_a_job_sees_only_what_it_needs(host: Host) -> None:
    private = _private_paths(host)
    assert len(private) >= 8
    assert await _visible(host.config, private) == []
    async with await create_sandbox(host.config) as sb:
        top = await sb.exec("ls -A /")
        interpreter_tops = {p.strip("/").split("/")[0] for p in python_prefixes("")}
        assert set(top.stdout.split()) <= NEEDED_TOP | interpreter_tops, top.stdout
        # Whatever is bound, nothing of a task file or a repository bundle is anywhere in it.
        found = await sb.exec("find / \\( -path /proc -o -path /sys -o -path /dev \\) -prune "
                              "-o \\( -name '*.jsonl' -o -name '*.bundle' -o -name "
                              "'sandbox-etc*' -o -name 'swe_repos' \\) -print", timeout=120)
        assert found.stdout == "", found.stdout[:2000]
        etc = set((await sb.exec("ls -A /etc")).stdout.split())
        assert {"passwd", "ld.so.cache", "resolv.conf"} <= etc
        assert not etc & {"shadow", "gshadow", "ssh", "pip.conf", "npmrc", "environment"}
        assert (await sb.exec("ls /etc/ssl")).stdout.split() == ["certs", "openssl.cnf"]
        # ... and the job still works: its interpreter, git, a shell.
        res = await sb.exec(["python", "-c", "import sys, json; print(sys.prefix)"])
        assert res.stdout.strip() == os.path.realpath(__import__("sys").prefix), res
        assert (await sb.exec("git --version && tar --version >/dev/null && echo ok")).ok


async def test_the_host_view_shows_them_all(host: Host) -> None:
    """Control: with the whole host root the same probes find the private paths (so the test
    above fails if the minimal view is lost)."""
    config = dataclasses.replace(host.config, host_view="host")
    seen = await _visible(config, _private_paths(host))
    # The host view still gives every sandbox its own /tmp and hides config.hide_paths: a
    # checkout below one of those (a CI clone under /tmp) is out of sight there too.
    covered = ("/tmp", *config.hide_paths)
    expected = [str(host.task_file), str(DATA_DIR / "swe.jsonl"), str(PACKAGE_ROOT / "runtime")]
    expected = [p for p in expected
                if not any(p == c or p.startswith(c.rstrip("/") + "/") for c in covered)]
    assert str(host.task_file) in expected
    assert all(p in seen for p in expected), (expected, seen)


async def test_visible_paths_are_added_without_what_is_never_visible(host: Host,
                                                                     tmp_path: Path) -> None:
    """An operator's extra tree is bound read-only; the state dir inside it stays covered."""
    root = host.config.state_dir.parent
    (root / "toolchain").mkdir()
    (root / "toolchain" / "tool").write_text("t")
    config = dataclasses.replace(host.config, visible_paths=(str(root),))
    seen = await _visible(config, [str(root / "toolchain" / "tool"), str(host.task_file),
                                   str(host.other_job)])
    assert seen == [str(root / "toolchain" / "tool"), str(host.task_file)]


def test_a_launch_seals_the_root_and_every_mask_still_in_its_tree() -> None:
    # On a rootless server a mask's tmpfs is the sandbox user's, without a size: each is made
    # read-only after the launch's own binds; one a later mount covers is not in the tree.
    from rollout.runtime.sandbox.bwrap import _seal

    args = ["--tmpfs", "/", "--ro-bind", "/usr", "/usr", "--tmpfs", "/root", "--tmpfs",
            "/tmp/state", "--ro-bind", "/srv/venv", "/root/venv", "--bind", "/sb/tmp", "/tmp",
            "--dev", "/dev"]
    assert _seal(args, True) == ["--remount-ro", "/", "--remount-ro", "/root"]
    assert _seal(args, False) == ["--remount-ro", "/root"]
    assert _seal(["--bind", "/img", "/"], False) == []
    # A root server's plain sandbox runs as a uid that cannot write root's masks: no remount.
    assert _seal(args, True, masks=False) == ["--remount-ro", "/"]
