"""Isolation guarantees of the bubblewrap sandbox. Each test fails if its wall is broken."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout.runtime.sandbox import SandboxConfig, SandboxLimits, create_sandbox, procs
from rollout.runtime.sandbox.bwrap import LAUNCH_VAR
from tests.runtime.sandbox_helpers import host_has, temp_config
from tests.util import assert_eventually, mounts_below

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def cfg() -> Iterator[SandboxConfig]:
    with temp_config("ri") as config:
        yield config


def _uid_of(sb: object) -> int | None:
    lease = getattr(sb, "_lease", None)
    return lease.uid if lease is not None else None


async def test_writes_outside_workspace_fail(cfg: SandboxConfig) -> None:
    async with await create_sandbox(cfg) as sb:
        for target in ("/etc/evil", "/usr/evil", "/evil", f"{os.getcwd()}/evil",
                       "/var/tmp/evil"):
            res = await sb.exec(f"echo x > {target}")
            assert res.exit_code != 0, target
            assert not os.path.exists(target)
        ok = await sb.exec("echo x > /workspace/fine && echo y > /tmp/fine && echo ok")
        assert ok.stdout == "ok\n"


async def test_dev_is_read_only_and_dev_shm_is_the_sandboxes_own(cfg: SandboxConfig) -> None:
    # POSIX semaphores and shared memory work as the sandbox's user (multiprocessing's locks,
    # a test runner's workers) in a /dev/shm that every launch of the sandbox shares and the
    # host sees in the sandbox's folder; nothing else of /dev takes a write.
    async with await create_sandbox(cfg) as sb:
        bash = await sb.bash()
        out = (await bash.run("echo from-bash > /dev/shm/a && echo written")).output
        assert "written" in out, out
        res = await sb.exec("cat /dev/shm/a; python3 -c 'import multiprocessing as m; "
                            "m.Lock(); m.Queue().put(1); print(\"locks\")'; : > /dev/x || "
                            "echo dev-refused; echo null > /dev/null && echo null-ok")
        assert res.stdout.split() == ["from-bash", "locks", "dev-refused", "null-ok"], res
        # (read-only where the sandbox's user could write bwrap's /dev: rootless, an image's
        # root; here, a root server's plain sandbox, its uid may not)
        assert "Permission denied" in res.stderr or "Read-only" in res.stderr, res.stderr
        assert (sb.path / "shm" / "a").read_text() == "from-bash\n"  # type: ignore[attr-defined]


async def test_state_dir_and_other_workspaces_are_invisible(cfg: SandboxConfig) -> None:
    state = os.path.abspath(cfg.state_dir)
    async with await create_sandbox(cfg, workspace_files={"mine.txt": "A"}) as a, \
            await create_sandbox(cfg, workspace_files={"theirs.txt": "B-secret"}) as b:
        assert b.workspace.is_dir()  # visible on the host...
        res = await a.exec(f"ls -A {state}; cat {b.workspace}/theirs.txt; "
                           f"ls {a.workspace}; grep -rs B-secret /tmp /workspace")
        assert res.stdout == ""  # ...but not from inside: the state dir is an empty tmpfs
        assert "No such file" in res.stderr
        assert (await a.exec("cat mine.txt")).stdout == "A"


async def test_host_secrets_in_hidden_paths_are_invisible(cfg: SandboxConfig) -> None:
    async with await create_sandbox(cfg) as sb:
        res = await sb.exec("ls -A /root /run /home")
        visible = [line for line in res.stdout.split("\n")
                   if line and not line.endswith(":") and line != ".pyenv"]
        assert visible == []


async def test_no_network_to_host_loopback(cfg: SandboxConfig) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    probe = ("import socket; s = socket.socket(); s.settimeout(2); "
             f"s.connect(('127.0.0.1', {port})); print('connected')")
    try:
        async with await create_sandbox(cfg) as sb:
            res = await sb.exec(["python", "-c", probe], timeout=20)
            assert res.exit_code != 0 and "connected" not in res.stdout
            assert "ConnectionRefused" in res.stderr or "unreachable" in res.stderr
            ifaces = (await sb.exec("cat /proc/net/dev")).stdout
            assert [line.split(":")[0].strip() for line in ifaces.splitlines()[2:]] == ["lo"]
        # The probe itself works: with loopback networking the same connection succeeds.
        async with await create_sandbox(cfg, network="loopback") as sb:
            res = await sb.exec(["python", "-c", probe], timeout=20)
            assert res.stdout == "connected\n", res
    finally:
        server.close()


async def test_host_processes_are_invisible(cfg: SandboxConfig) -> None:
    marker = f"hostonly{os.getpid()}"
    host = subprocess.Popen(["bash", "-c", f"exec -a {marker} sleep 60"])
    try:
        async with await create_sandbox(cfg) as sb:
            res = await sb.exec("ps -eo pid,args")
            assert marker not in res.stdout
            pids = [int(line.split()[0]) for line in res.stdout.splitlines()[1:]]
            assert max(pids) < 20  # its own PID namespace
            kill = await sb.exec(f"kill -9 {host.pid}")
            assert kill.exit_code != 0
        assert host.poll() is None
    finally:
        host.kill()
        host.wait()


async def test_fork_bomb_is_contained(cfg: SandboxConfig) -> None:
    limits = SandboxLimits(processes=40)
    async with await create_sandbox(cfg, limits=limits) as sb:
        res = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 1; "
                            "ps -e --no-headers | wc -l", timeout=5)
        assert res.timed_out or res.exit_code == 0
        if not res.timed_out:
            assert int(res.stdout.split()[-1]) <= limits.processes + 1
        # The host can still fork, and the sandbox recovers once the bomb's namespace died.
        assert subprocess.run(["true"]).returncode == 0
        after = await sb.exec("echo alive", timeout=20)
        assert after.stdout == "alive\n"
        uid = _uid_of(sb)
    if uid is not None:
        assert not procs.uid_has_processes(uid)


async def test_memory_hog_is_killed(cfg: SandboxConfig) -> None:
    limits = SandboxLimits(address_space_bytes=512 << 20)
    async with await create_sandbox(cfg, limits=limits) as sb:
        res = await sb.exec(["python", "-c", "b = bytearray(2 << 30); print('allocated')"],
                            timeout=30)
        assert res.exit_code != 0 and "allocated" not in res.stdout
        assert "MemoryError" in res.stderr
        res = await sb.exec("x=$(head -c 1000000000 /dev/zero | tr '\\0' a); echo ${#x}",
                            timeout=30)
        assert res.stdout.strip() != "1000000000"
        assert res.exit_code != 0 or res.stdout.strip() in ("", "0")


async def test_rlimits_apply_inside(cfg: SandboxConfig) -> None:
    limits = SandboxLimits(open_files=77, file_size_bytes=1 << 20, cpu_seconds=1)
    async with await create_sandbox(cfg, limits=limits) as sb:
        assert (await sb.exec("ulimit -n")).stdout == "77\n"
        res = await sb.exec("head -c 3000000 /dev/zero > big")
        assert res.exit_code == 128 + 25 and "File size limit exceeded" in res.stderr  # SIGXFSZ
        assert int((await sb.exec("stat -c %s big")).stdout) == 1 << 20
        res = await sb.exec("while :; do :; done", timeout=20)
        assert not res.timed_out and res.exit_code == 128 + 9  # SIGKILL at the hard CPU limit


async def test_every_rlimit_is_set_soft_and_hard_by_the_launch_prologue(
        cfg: SandboxConfig) -> None:
    # The launch line sets the limits with dash builtins (no prlimit exec): each one must
    # arrive exactly, soft = hard, and a size between dash's units is rounded down.
    limits = SandboxLimits(cpu_seconds=321, address_space_bytes=(3 << 30) + 700,
                           processes=123, open_files=99, file_size_bytes=(5 << 20) + 100)
    async with await create_sandbox(cfg, limits=limits) as sb:
        res = await sb.exec(["cat", "/proc/self/limits"])
    rows = {line[:26].strip(): line[26:].split()[:2] for line in res.stdout.splitlines()[1:]}
    assert rows["Max cpu time"] == ["321", "321"]
    assert rows["Max address space"] == [str(3 << 30)] * 2
    assert rows["Max processes"] == ["123", "123"]
    assert rows["Max open files"] == ["99", "99"]
    assert rows["Max file size"] == [str(5 << 20)] * 2


async def test_commands_run_as_the_sandbox_uid_with_no_privileges_left(
        cfg: SandboxConfig) -> None:
    # What the launch's uid drop guarantees, seen by the command itself: the sandbox's own
    # uid and gid (every one of real, effective, saved, fs), no supplementary groups, no
    # capability in any set, no_new_privs, and the seccomp filter.
    async with await create_sandbox(cfg) as sb:
        uid = _uid_of(sb)
        res = await sb.exec(["cat", "/proc/self/status"])
    status = dict(line.split(":", 1) for line in res.stdout.splitlines() if ":" in line)
    fields = {k: v.split() for k, v in status.items()}
    if uid is not None:  # a root server: a uid of the sandbox's own, never root
        assert fields["Uid"] == [str(uid)] * 4 and fields["Gid"] == [str(uid)] * 4
        assert uid != 0
        assert fields["Groups"] == []
    for caps in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        assert int(fields[caps][0], 16) == 0, (caps, fields[caps])
    assert fields["NoNewPrivs"] == ["1"]
    assert fields["Seccomp"] == ["2"]  # filter mode


async def test_account_lookups_read_only_the_sandboxes_files(cfg: SandboxConfig) -> None:
    # The curated /etc answers user and group lookups from its files alone (no NSS module
    # loads per launch); lookups still work, and other databases keep the host's sources.
    async with await create_sandbox(cfg) as sb:
        conf = (await sb.exec(["cat", "/etc/nsswitch.conf"])).stdout
        root = await sb.exec(["getent", "passwd", "root"])
    if not os.path.exists("/etc/nsswitch.conf"):
        pytest.skip("the host has no nsswitch.conf to curate")
    sources = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].split()
               for line in conf.splitlines() if ":" in line and not line.startswith("#")}
    assert sources["passwd"] == ["files"] and sources["group"] == ["files"]
    host = {line.split(":", 1)[0].strip() for line in open("/etc/nsswitch.conf")
            if ":" in line and not line.startswith("#")}
    assert host <= set(sources)
    assert root.stdout.startswith("root:x:0:0:")


_TTY_PROBE = """
import asyncio, os, sys
from pathlib import Path
from rollout.runtime.sandbox import SandboxConfig, create_sandbox

def probe():  # the server's own terminal, as this process sees it
    try:
        os.close(os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY))
        return "server-has-tty"
    except OSError:
        return "server-has-no-tty"

async def main():
    print(probe())
    async with await create_sandbox(SandboxConfig(state_dir=Path(sys.argv[1]))) as sb:
        res = await sb.exec("if : 3</dev/tty; then echo sandbox-has-tty; "
                            "else echo sandbox-has-no-tty; fi")
        print(res.stdout.strip(), res.stderr.strip()[-200:])

asyncio.run(main())
"""


def test_a_server_terminal_never_reaches_its_sandboxes(cfg: SandboxConfig) -> None:
    # Launches of a server without a terminal skip the new session (process group only, for
    # speed); a server started from a terminal must still give its launches a session of
    # their own, or they could open the terminal (inject input with TIOCSTI, take the
    # foreground). The server here is a child whose controlling terminal is a fresh pty.
    master, slave = os.openpty()
    try:
        done = subprocess.run(["setsid", "--ctty", sys.executable, "-c", _TTY_PROBE,
                               str(cfg.state_dir)], stdin=slave, capture_output=True,
                              timeout=80, text=True)
    finally:
        os.close(slave)
        os.close(master)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "server-has-tty", done.stdout  # the probe itself sees a terminal
    assert lines[1].startswith("sandbox-has-no-tty"), done.stdout


async def test_a_launch_leads_a_process_group_of_its_own(cfg: SandboxConfig) -> None:
    # One killpg() ends a launch (timeouts, cancellation): its launcher leads its own
    # process group, with or without a session of its own.
    async with await create_sandbox(cfg) as sb:
        run = asyncio.ensure_future(sb.exec("sleep 30", timeout=60))
        try:
            await assert_eventually(lambda: bool(sb.tracked_pids))
            (pid,) = sb.tracked_pids
            assert os.getpgid(pid) == pid != os.getpgid(0)
        finally:
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run


async def test_sigint_ignoring_command_is_killed_at_timeout(cfg: SandboxConfig) -> None:
    marker = f"stubborn{os.getpid()}"
    async with await create_sandbox(cfg) as sb:
        start = time.monotonic()
        res = await sb.exec(f"trap '' INT TERM HUP; exec -a {marker} sleep 300", timeout=1)
        assert res.timed_out
        assert time.monotonic() - start < 10
        await assert_eventually(lambda: not host_has(marker))
        bash = await sb.bash()
        res2 = await bash.run(f"trap '' INT; bash -c \"trap '' INT; exec -a {marker} "
                              "sleep 300\"", timeout=1, interrupt_grace_s=0.5)
        assert res2.timed_out and res2.restarted
        await assert_eventually(lambda: not host_has(marker))
        assert (await (await sb.bash()).run("echo back")).output == "back\n"


@pytest.mark.timeout(240)
async def test_many_cycles_with_cancellations_leave_nothing_behind(
        cfg: SandboxConfig, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Mounts are read below this test's own directories: the mount table is the whole host's,
    # and other processes on the machine (another test run, a server) mount and unmount their
    # own sandboxes' quotas meanwhile, which says nothing about ours.
    roots = (cfg.state_dir, tmp_path)
    assert [m for root in roots for m in mounts_below(root)] == []
    # Temporary files of this process go to a directory of its own: /tmp also holds what other
    # runs on the machine create (a soak benchmark's rollout-soak-*), which says nothing here.
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    # Children that outlive single tests (a session's loopback image registry) were there
    # before and are not ours to judge.
    before = _children()
    uids: set[int] = set()
    sandbox_ids: set[str] = set()
    for i in range(200):
        sb = await create_sandbox(cfg, workspace_files={"f.txt": str(i)})
        sandbox_ids.add(sb.id)
        if i == 0:  # each sandbox has its quota mount, so the check after the loop can fail
            assert mounts_below(cfg.sandboxes_dir) != []
        if (u := _uid_of(sb)) is not None:
            uids.add(u)
        if i % 2:
            if i % 10 == 1:
                bash = await sb.bash()
                task = asyncio.create_task(bash.run("sleep 300"))
            else:
                task = asyncio.create_task(sb.exec("cat f.txt; sleep 300"))
            await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            assert (await sb.exec("cat f.txt")).stdout == str(i)
        await sb.destroy()
    assert [e for e in os.listdir(cfg.sandboxes_dir) if not e.startswith(".")] == []
    assert [m for root in roots for m in mounts_below(root)] == []
    assert os.listdir(private_tmp) == []
    await assert_eventually(lambda: _leftovers(cfg, uids, sandbox_ids) == [])
    await assert_eventually(lambda: not (_children() - before))


def _leftovers(cfg: SandboxConfig, uids: set[int], sandbox_ids: set[str]) -> list[str]:
    """Processes our sandboxes may have left. Sandbox uids are leased host-wide, so once ours
    are destroyed another server on the machine may lease the same uid and run processes as
    it: a uid we can lease again is checked whole (nobody else is using it); a uid another
    holder has is checked only for processes tagged with one of our sandboxes' launches."""
    found = []
    for uid in uids:
        lease = procs.UidLease.try_claim(cfg.uid_lock_dir, uid)
        try:
            if lease is not None:
                if procs.uid_has_processes(uid):
                    found.append(f"uid {uid}")
                continue
        finally:
            if lease is not None:
                lease.release()
        found += [f"uid {uid} pid {pid}" for pid in _pids_of(uid)
                  if _launch_tag(pid).split(".")[0] in sandbox_ids]
    return found


def _pids_of(uid: int) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                pids.append(int(pid))
        except OSError:
            continue
    return pids


def _launch_tag(pid: int) -> str:
    """The ROLLOUT_LAUNCH tag (``<sandbox id>.<n>``) in a process's environment, or ''."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return ""
    prefix = LAUNCH_VAR.encode() + b"="
    return next((e[len(prefix):].decode(errors="replace") for e in env
                 if e.startswith(prefix)), "")


def _children() -> set[str]:
    """This process's live children (pids)."""
    me = str(os.getpid())
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[1] == me and fields[0] != "Z":
                    out.add(pid)
            except OSError:
                continue
    return out
