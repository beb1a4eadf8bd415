"""Hard bounds of bwrap sandboxes: disk quota, aggregate memory cap, seccomp (real sandboxes).

These need the server's privileges (root: host tmpfs mounts, a writable memory cgroup); where
the machine lacks them the tests say so and skip rather than pass.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import pytest

from rollout.runtime.sandbox import SandboxConfig, create_sandbox, hardening, hostfs
from tests.runtime.sandbox_helpers import temp_config

pytestmark = pytest.mark.timeout(120)
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="host tmpfs mounts need root")


def _bytes_on_device(top: Path, dev: int) -> int:
    """Bytes of files under ``top`` that live on filesystem ``dev`` (mount points skipped)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if os.lstat(os.path.join(dirpath, d)).st_dev == dev]
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if st.st_dev == dev:
                total += st.st_blocks * 512
    return total


def _mounts_below(path: Path) -> list[str]:
    prefix = str(path.resolve())
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(prefix)]


@root_only
async def test_disk_fill_gets_enospc_and_the_state_dir_stays_untouched() -> None:
    with temp_config("qd") as base:
        cfg = dataclasses.replace(base, disk_bytes=8 << 20)
        cfg.state_dir.mkdir(parents=True)
        state_dev = os.stat(cfg.state_dir).st_dev
        sb = await create_sandbox(cfg)
        # After creation: the sandboxes' shared /etc (a copy made once) is no write of this one.
        before = _bytes_on_device(cfg.state_dir, state_dev)
        try:
            for where in ("/workspace/fill", "/tmp/fill"):
                res = await sb.exec(f"dd if=/dev/zero of={where} bs=1M count=32", timeout=30)
                assert res.exit_code != 0 and "No space left on device" in res.stderr, res
            # Both directories share the one quota: together they hold at most 8 MiB. -x: a
            # checkout under /tmp (CI) has the server's venv bound into the sandbox's /tmp.
            du = await sb.exec("du -skx /workspace /tmp | awk '{s+=$1} END {print s}'")
            assert int(du.stdout) <= 8 * 1024 + 64, du
            assert os.stat(sb.workspace).st_dev != state_dev
            # Nothing of the 8 MiB landed on the state dir's own filesystem.
            assert _bytes_on_device(cfg.state_dir, state_dev) - before < (1 << 20)
            # The host's view of the workspace still works (editor, checkout) within the quota.
            await sb.exec("rm -f /workspace/fill /tmp/fill")
            await sb.put_file("note.txt", b"host write")
            assert (await sb.exec("cat note.txt")).stdout == "host write"
        finally:
            await sb.destroy()
        assert _mounts_below(cfg.state_dir) == []
        assert not sb.path.exists()


@root_only
async def test_files_are_bounded_in_number_too_and_dev_shm_shares_the_quota() -> None:
    # Each file of a tmpfs pins ~1 KiB of kernel memory that its size does not count: the
    # quota also bounds the number of files (tmpfs_inodes: 4,096 for 8 MiB, where the
    # kernel's default is half the machine's pages). /dev/shm is the sandbox's own folder
    # inside the same quota, never an unbounded tmpfs of bwrap's.
    with temp_config("qi") as base:
        cfg = dataclasses.replace(base, disk_bytes=8 << 20)
        cfg.state_dir.mkdir(parents=True)
        async with await create_sandbox(cfg) as sb:
            res = await sb.exec("for i in $(seq 6000); do : > /tmp/f$i || { echo stopped $i; "
                                "break; }; done", timeout=120)
            said = res.stdout.split()
            assert said[:1] == ["stopped"] and int(said[1]) <= hardening.tmpfs_inodes(8 << 20), (
                res.stdout, res.stderr[-300:])
            assert "No space left on device" in res.stderr
            await sb.exec("rm -f /tmp/f*")
            res = await sb.exec("dd if=/dev/zero of=/dev/shm/fill bs=1M count=32", timeout=30)
            assert res.exit_code != 0 and "No space left on device" in res.stderr, res
            assert (sb.path / "shm" / "fill").stat().st_size <= 8 << 20  # type: ignore[attr-defined]


def test_the_inode_bound_follows_the_size() -> None:
    assert hardening.tmpfs_inodes(2 << 30) == (2 << 30) // hardening.BYTES_PER_INODE
    assert hardening.tmpfs_inodes(1 << 20) == hardening.MIN_INODES


@root_only
def test_rmtree_detaches_a_quota_mount(tmp_path: Path) -> None:
    target = tmp_path / "sb"
    target.mkdir()
    hardening.mount_quota(target, 1 << 20)
    (target / "x").write_bytes(b"1")
    assert _mounts_below(target)
    hostfs.rmtree(target)
    assert _mounts_below(target) == [] and not target.exists()


def _memory_cgroup_available() -> bool:
    procs = hardening.acquire_memory_cgroup("/nonexistent/probe", 1 << 30)
    hardening.release_memory_cgroup("/nonexistent/probe")
    return procs is not None


async def test_memory_cap_is_shared_by_all_sandboxes_of_a_server() -> None:
    if not _memory_cgroup_available():
        pytest.skip("no writable memory cgroup here: sandboxes have no aggregate cap")
    with temp_config("qm") as base:
        # Each process may map 4 GiB (RLIMIT_AS); only the shared cgroup stops these.
        cfg = dataclasses.replace(base, memory_bytes=160 << 20, disk_bytes=512 << 20)
        a, b = await asyncio.gather(create_sandbox(cfg), create_sandbox(cfg))
        try:
            hog = "python3 -c 'x = bytearray(300 << 20); x[::4096] = b\"1\" * len(x[::4096])'"
            res = await a.exec(hog, timeout=60)
            assert res.exit_code == 137, res  # SIGKILL from the cgroup's OOM killer
            # 100 MiB of tmpfs pages written by sandbox A count against the same cap, so
            # 100 MiB more in sandbox B no longer fit, though either alone would.
            filled = await a.exec("dd if=/dev/zero of=/tmp/f bs=1M count=100", timeout=60)
            assert filled.ok, filled
            alone = "python3 -c 'x = bytearray(100 << 20); x[::4096] = b\"1\" * len(x[::4096])'"
            res = await b.exec(alone, timeout=60)
            assert res.exit_code == 137, res
            await a.exec("rm -f /tmp/f")
            res = await b.exec(alone, timeout=60)
            assert res.ok, res
        finally:
            await asyncio.gather(a.destroy(), b.destroy())


async def test_seccomp_keeps_namespaces_and_mounts_out() -> None:
    probe = ("import ctypes, os\n"
             "libc = ctypes.CDLL(None, use_errno=True)\n"
             "for name, call in (('userns', lambda: libc.unshare(0x10000000)),\n"
             "                   ('mountns', lambda: libc.unshare(0x20000)),\n"
             "                   ('mount',\n"
             "                    lambda: libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))):\n"
             "    rc = call()\n"
             "    print(name, rc, os.strerror(ctypes.get_errno()) if rc else 'ok')\n")
    with temp_config("qs") as cfg:
        assert cfg.seccomp
        if hardening.seccomp_program(str(cfg.state_dir / "probe")) is None:
            pytest.skip("pyseccomp/libseccomp unavailable: no seccomp filter")
        sb = await create_sandbox(cfg)
        try:
            status = await sb.exec("grep Seccomp: /proc/self/status")
            assert status.stdout.split() == ["Seccomp:", "2"], status
            res = await sb.exec(["python3", "-c", probe])
            lines = res.stdout.splitlines()
            assert lines == ["userns -1 Operation not permitted",
                             "mountns -1 Operation not permitted",
                             "mount -1 Operation not permitted"], res
            # Ordinary process creation still works (clone without CLONE_NEW* flags).
            ok = await sb.exec("python3 -c 'import subprocess; subprocess.run([\"true\"], "
                               "check=True)' && (sleep 0 &) && echo fine")
            assert ok.stdout.strip() == "fine", ok
        finally:
            await sb.destroy()


def test_sandbox_config_defaults_bound_every_sandbox() -> None:
    cfg = SandboxConfig()
    assert cfg.disk_bytes > 0 and cfg.memory_bytes >= 0 and cfg.seccomp
