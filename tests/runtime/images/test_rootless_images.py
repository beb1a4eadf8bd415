"""The rootless path for real: image sandboxes made by a server that is not root (an
unprivileged uid with no capabilities, its own cache). The overlay's copy-on-write root is
mounted by each launch in a user namespace of its own (bubblewrap 0.8 has no ``--overlay``);
the writes land in the sandbox's upper layer, the cached image stays as it was, and the image
config's ``User`` maps onto the server's user."""

from __future__ import annotations

import io
import json
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from rollout.runtime.sandbox.base import ImageSettings
from tests.fixtures.venvs import venv_with_our_packages
from tests.util import patience

pytestmark = pytest.mark.timeout(300)

NOBODY = 65534
CHILD = Path(__file__).with_name("rootless_child.py")
SUBIDS_CHILD = Path(__file__).with_name("subids_child.py")
HARBOR_CHILD = Path(__file__).with_name("subids_harbor_child.py")
CRASH_CHILD = Path(__file__).with_name("subids_crash_child.py")
IPYTHON_CHILD = Path(__file__).with_name("subids_ipython_child.py")
SERVE_CHILD = Path(__file__).with_name("subids_serve_child.py")
REPO = Path(__file__).resolve().parents[3]
FAR = 200000
"""An id beyond the test user's ranges."""
SUBIDS_PREFIX = "rollout-sub-"
"""The test user's name: this prefix and the test session's pid."""


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
    top = _layout_owned_by(user_layout, NOBODY, NOBODY, "rootless-images-")
    try:
        seen: dict[str, Any] = _run_as(NOBODY, NOBODY, CHILD, top)
        assert seen["euid"] == NOBODY
        # The image's root is the server's own user; the job changes the image's files.
        assert seen["root_exec"][:2] == [0, ["0", "hi"]], seen["root_exec"]
        assert seen["bash"][0] == "hi"  # the long-lived bash launch sees the other's write
        assert seen["second_launch"] == ["hi", "gone"]
        assert seen["after_stop"][:2] == [0, ["hi"]], seen["after_stop"]
        # Into the upper layer (a tmpfs in the holder's namespace), never the cache.
        assert seen["upper_written"] == "hi\n"
        assert seen["upper_fs"] == ["tmpfs"] and seen["upper_on_host"] == [], seen
        # Its size is the sandbox's disk quota: a write past it fails where the quota ends
        # (overlayfs reports it as an I/O error), and fits once that file is gone.
        said, _ = seen["quota"]
        assert said[0] != "0" and int(said[1]) <= 4 << 20 and said[2:] == ["fits"], seen["quota"]
        assert 1000 < int(seen["inodes"][0]) <= 4096, seen["inodes"]  # and its files' number
        assert seen["cache_written"] is False and seen["cache_passwd"] is True
        assert seen["dev"] == [["dev-refused"], ["a"], True], seen["dev"]
        assert seen["plain_dev"][0] == ["p", "dev-refused"], seen["plain_dev"]
        said = seen["host_view_tmpfs"][0]
        assert said[-1] == "checked" and set(said[:-1]) <= {
            "writable", "/workspace", "/.sandbox", "/dev/shm", "/tmp"}, said
        # No memory cgroup caps this user's sandboxes: two live layers of 4 MiB would pass
        # the 6 MiB memory cap, so the second sandbox's upper layer is on the disk (and
        # works); after the first ends, a tmpfs again.
        assert seen["budget"] == [["tmpfs", "disk"], ["disk"], True], seen["budget"]
        assert seen["budget_after"] == "tmpfs", seen["budget_after"]
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
        # The holders made ahead: each later sandbox took one that was ready before it asked
        # (the first two from the full pool), each a different one, none handed out twice.
        pool = seen["pool"]
        assert len(pool["ready_before"]) == 2, pool
        assert pool["taken"][:2] == pool["ready_before"], pool
        assert len(set(pool["taken"])) == 3, pool
        assert seen["pool_closed"] == [], "close ends the ready holders"
    finally:
        shutil.rmtree(top, ignore_errors=True)


class SubIdsUser(NamedTuple):
    name: str
    uid: int
    gid: int
    count: int
    """How many ids its sandboxes map (1..count): its ranges' total."""


def _ranges_of(name: str | None, path: str) -> list[tuple[int, int]]:
    """(start, count) of ``name``'s lines of ``path`` (None: every user's)."""
    with open(path, encoding="utf-8") as f:
        parts = [line.strip().split(":") for line in f]
    return [(int(p[1]), int(p[2])) for p in parts
            if len(p) == 3 and name in (None, p[0]) and p[1].isdigit() and p[2].isdigit()]


def _add_range(name: str) -> None:
    """One more 65536-id range of each kind for ``name``, past every user's range."""
    first = max((s + n for p in ("/etc/subuid", "/etc/subgid") for s, n in _ranges_of(None, p)),
                default=100000)
    subprocess.run(["usermod", "--add-subuids", f"{first}-{first + 65535}", "--add-subgids",
                    f"{first}-{first + 65535}", name], check=True, capture_output=True,
                   timeout=60)


def _remove_test_user(name: str) -> None:
    """The user and every subordinate range it has (userdel alone keeps them on some
    versions of shadow)."""
    for path, flag in (("/etc/subuid", "--del-subuids"), ("/etc/subgid", "--del-subgids")):
        for start, n in _ranges_of(name, path):
            subprocess.run(["usermod", flag, f"{start}-{start + n - 1}", name],
                           capture_output=True, timeout=60)
    subprocess.run(["userdel", name], capture_output=True, timeout=60)


def sweep_stale_test_users() -> list[str]:
    """Remove the test users a session killed before its end left (their pid is gone);
    another live session's user stays."""
    gone = []
    for entry in pwd.getpwall():
        pid = entry.pw_name.removeprefix(SUBIDS_PREFIX)
        if pid != entry.pw_name and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _remove_test_user(entry.pw_name)
            gone.append(entry.pw_name)
    return gone


@pytest.fixture(scope="session")
def subids_user() -> Iterator[SubIdsUser]:
    """A real user with ranges in /etc/subuid and /etc/subgid, as an administrator gives one
    to each user that runs rootless containers: named after this session's pid, so that two
    suites on one machine never share one, and removed with its ranges at the session's end
    (a session killed before it leaves one that the next session's sweep removes)."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("making a user with subordinate ids needs root and useradd")
    if shutil.which("newuidmap") is None:
        pytest.skip("newuidmap is missing (apt-get install uidmap; scripts/setup_images.sh)")
    sweep_stale_test_users()
    name = f"{SUBIDS_PREFIX}{os.getpid()}"
    _remove_test_user(name)
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True, timeout=60)
    try:
        if not _ranges_of(name, "/etc/subuid") or not _ranges_of(name, "/etc/subgid"):
            _add_range(name)  # useradd gave none (SUB_UID_COUNT 0)
        count = min(sum(n for _, n in _ranges_of(name, p)) for p in ("/etc/subuid",
                                                                    "/etc/subgid"))
        if count >= FAR:
            pytest.skip(f"the test user's ranges reach {FAR}, the id the tests need beyond "
                        "them")
        entry = pwd.getpwnam(name)
        yield SubIdsUser(name, entry.pw_uid, entry.pw_gid, count)
    finally:
        _remove_test_user(name)


def test_the_subids_test_user_is_this_sessions_own(subids_user: SubIdsUser) -> None:
    # Two suites on one machine each have their own user; one a killed session left (its
    # pid gone) is removed by the next session's sweep, never a live session's.
    assert subids_user.name == f"{SUBIDS_PREFIX}{os.getpid()}"
    stale = subprocess.Popen(["true"])
    stale.wait(timeout=60)
    dead = f"{SUBIDS_PREFIX}{stale.pid}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", dead],
                   check=True, capture_output=True, timeout=60)
    try:
        _add_range(dead)
        assert sweep_stale_test_users() == [dead]
        with pytest.raises(KeyError):
            pwd.getpwnam(dead)
        assert _ranges_of(dead, "/etc/subuid") == [] and _ranges_of(dead, "/etc/subgid") == []
        assert pwd.getpwnam(subids_user.name).pw_uid == subids_user.uid  # the live one stays
    finally:
        _remove_test_user(dead)


def _layout_owned_by(layout: Path, uid: int, gid: int, prefix: str) -> Path:
    """A fresh folder below /tmp holding a copy of ``layout``, all of it owned by ``uid``, for
    a server that runs as that user; the caller removes it."""
    top = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        shutil.copytree(layout, top / "layout")
        for d, _, files in os.walk(top):
            for name in (d, *(os.path.join(d, f) for f in files)):
                os.lchown(name, uid, gid)
        os.chmod(top, 0o755)
    except BaseException:
        shutil.rmtree(top, ignore_errors=True)
        raise
    return top


def _with_far_ids(owned: Path) -> Path:
    """A copy of the ``owned`` layout with two more tags: ``far`` (User 200000) and
    ``far-owner`` (a layer giving /far.txt to uid 200000); the caller removes its parent."""
    top = Path(tempfile.mkdtemp(prefix="far-ids-", dir="/tmp"))
    layout = top / "layout"
    shutil.copytree(owned, layout)
    subprocess.run(["umoci", "config", "--image", f"{layout}:owned", "--tag", "far",
                    "--config.user", f"{FAR}:{FAR}"], check=True, capture_output=True,
                   timeout=120)
    raw = top / "layer.tar"
    with tarfile.open(raw, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("far.txt")
        info.uid, info.size = FAR, 2
        tar.addfile(info, io.BytesIO(b"f\n"))
    subprocess.run(["umoci", "raw", "add-layer", "--image", f"{layout}:owned", "--tag",
                    "far-owner", str(raw)], check=True, capture_output=True, timeout=120)
    return layout


@pytest.fixture
def own_python() -> Iterator[str]:
    """A rootless server's own interpreter outside the system trees (an image sandbox binds
    the server's interpreter for the IPython kernel, never over the image's /usr, /opt or
    /tmp): this venv's base installation hard-linked (readable by any user; never chown
    anything in it) below the checkout's build/, and a venv of it whose one .pth adds this
    venv's packages; its python's path."""
    base = os.path.realpath(sys.base_prefix)
    build = REPO / "build"
    tops = ("/usr", "/opt", "/tmp", "/var")
    if any(p == t or p.startswith(t + "/") for p in (base, str(build)) for t in tops):
        pytest.skip("the kernel needs an interpreter and a checkout outside /usr, /opt, /tmp "
                    "and /var")
    build.mkdir(exist_ok=True)
    if os.stat(base).st_dev != os.stat(build).st_dev:
        pytest.skip("hard links need the base interpreter on the checkout's filesystem")
    top = Path(tempfile.mkdtemp(prefix="own-python-", dir=build))
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    try:
        os.chmod(top, 0o755)
        stdlib = top / "base" / "lib" / version
        stdlib.mkdir(parents=True)
        subprocess.run(["cp", "-al", f"{base}/bin", str(top / "base")], check=True,
                       timeout=120)
        for src in Path(base, "lib").iterdir():
            if src.name != version:
                subprocess.run(["cp", "-al", str(src), str(top / "base" / "lib")], check=True,
                               timeout=120)
        for src in Path(base, "lib", version).iterdir():
            if src.name != "site-packages":
                subprocess.run(["cp", "-al", str(src), str(stdlib)], check=True, timeout=120)
        (stdlib / "site-packages").mkdir()
        yield venv_with_our_packages(str(top / "base" / "bin" / version), top / "venv")
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _run_as(uid: int, gid: int, child: Path, top: Path, env: tuple[str, ...] = (),
            args: tuple[str, ...] = (), returncode: int = 0,
            python: str = "", timeout: float = 240) -> dict[str, object]:
    """Run ``child TOP ARGS...`` as ``uid`` with no capabilities, this venv's packages (and
    the checkout, for ``tests.*``) on its path and ``env`` (NAME=value) added; check its exit
    status and return the first JSON line it prints."""
    python = python or _system_python()
    site = sysconfig.get_paths()["purelib"]
    boot = (f"import site, runpy, sys; site.addsitedir({site!r}); "
            f"sys.path.insert(0, {str(REPO)!r}); "
            f"sys.argv = [{str(child)!r}, {str(top)!r}, *{list(args)!r}]; "
            f"runpy.run_path({str(child)!r}, run_name='__main__')")
    proc = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all",
         "env", "-i", f"HOME={top}", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", *env, python, "-c",
         boot],
        capture_output=True, text=True, timeout=timeout, cwd=top)
    assert proc.returncode == returncode, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("{"))
    return json.loads(line)  # type: ignore[no-any-return]


def test_a_rootless_server_with_subordinate_ids_keeps_the_images_owners(
        owned_layout: Path, subids_user: SubIdsUser) -> None:
    # The server runs as a user with a subordinate range: each sandbox's user namespace maps
    # the image's uids (0 the server's user, 1.. the range), so the image's user (app) cannot
    # change root's files or another user's, and writes its own, its home and its workspace.
    uid, gid = subids_user.uid, subids_user.gid
    far = _with_far_ids(owned_layout)
    try:
        top = _layout_owned_by(far, uid, gid, "subids-images-")
    finally:
        shutil.rmtree(far.parent)
    try:
        seen = _run_as(uid, gid, SUBIDS_CHILD, top)
        assert seen["euid"] == uid and seen["subids"] != "None", seen
        mine = ["own-ok", "dir-ok", "group-ok", "root-denied", "passwd-denied", "other-denied",
                "ws-ok", "home-ok"]
        for mode in ("auto", "copy"):  # the overlay, and the private copy of the root
            code, out, err = seen[f"{mode}_app"]  # type: ignore[misc]
            assert code == 0 and out == ["1000", "1000:1001", "0:0", "0:0", *mine], (mode, out,
                                                                                     err)
            # The image's root writes everything, its users' files too.
            code, out, err = seen[f"{mode}_root"]  # type: ignore[misc]
            assert out == ["0", "1000:1001", "passwd-ok", "app-file-ok"], (mode, out, err)
        assert seen["holder"] is True
        # The bash tool runs as the image's user with the same rights.
        assert seen["bash"][:2] == ["1000", "b"] and "denied" in seen["bash"], seen["bash"]  # type: ignore[index,operator]
        # The server's file API writes the user's workspace for it (the editor tool).
        assert seen["put_file"][:2] == [0, ["1000:1001", "1000:1001", "1000:1001", "server",  # type: ignore[index]
                                            "app-ok"]] and seen["put_file"][3] == "e\nmore\n", (  # type: ignore[index]
            seen["put_file"])
        assert seen["file_errors"] == ["FileNotFoundError", "IsADirectoryError",
                                       "PermissionError"], seen["file_errors"]
        # One command as the image's root in the app sandbox (a Harbor [verifier].user).
        assert seen["as_root"][1] == ["0", "root-ok", "app-file-ok"], seen["as_root"]  # type: ignore[index]
        # Another non-root user writes the workspace; the sandbox's user gets it back after.
        assert seen["other_user"][1] == ["1002", "ws-file-ok", "ws-dir-ok", "ws-new-ok",  # type: ignore[index]
                                         "root-denied"], seen["other_user"]
        assert seen["after_other"][1] == ["1000", "back-ok", "1000", "1000"], seen["after_other"]  # type: ignore[index]
        # The cache is untouched: its files keep their content and the server's user.
        # A grader's copy of the agent's workspace (both mapped): app's files, app's again.
        assert seen["copy"] == [2, 0, ["s", "1000:1001", "grader-ok"], ["agent-ok"]], seen["copy"]
        # Ids beyond the range: refused, the task's fault.
        for tag, what in (("far", "its user 200000 (200000:200000)"),
                          ("far-owner", "the owner of /far.txt (200000:0)")):
            reason, message = seen[tag]  # type: ignore[misc]
            assert reason == "IMAGE_REJECTED", seen[tag]
            assert f"{what} is beyond the server's subordinate id range" in message, message
            assert f"0..{subids_user.count}" in message, message
            assert "usermod --add-subuids" in message and subids_user.name in message, message
        assert seen["cache_rootfile"] == "r\n" and seen["cache_owned"] == "v1\n"
        assert seen["cache_uids"] == [uid]
        assert seen["sandboxes_left"] == []
        assert seen["fresh_namespace_removals"] == []
        # Nothing of the sandboxes is left on the host, owned by a subordinate id or not.
        left = [os.path.join(d, n) for d, dirs, files in os.walk(top / "state")
                for n in dirs + files
                if os.lstat(os.path.join(d, n)).st_uid != uid]
        assert left == []
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_the_sweep_removes_a_crashed_rootless_servers_sandbox_of_subordinate_files(
        owned_layout: Path, subids_user: SubIdsUser) -> None:
    # A server with a subordinate range SIGKILLed with an image sandbox open: its folder holds
    # files of the image's user (a subordinate uid on the host; one folder of them 0500),
    # which the next server's start-up sweep removes from inside a fresh mapped namespace.
    uid, gid = subids_user.uid, subids_user.gid
    top = _layout_owned_by(owned_layout, uid, gid, "subids-crash-")
    try:
        crashed = _run_as(uid, gid, CRASH_CHILD, top, args=("crash",), returncode=-9)
        assert crashed["written"] == "ok", crashed
        # Its holders (the sandbox's, and the two made ahead) end with it: each waits on a
        # pipe only the server held.
        holders = crashed["holders"]
        assert len(holders) == 3, crashed

        def ended() -> bool:
            return not any(os.path.exists(f"/proc/{pid}") for pid in holders)
        deadline = time.monotonic() + patience(30)
        while not ended() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ended(), [open(f"/proc/{p}/cmdline", "rb").read() for p in holders
                         if os.path.exists(f"/proc/{p}")]
        left = top / "state" / "sandboxes" / str(crashed["sid"])
        foreign = {os.lstat(os.path.join(d, n)).st_uid for d, dirs, files in os.walk(left)
                   for n in dirs + files} - {uid}
        assert foreign, "the crashed sandbox should hold files of subordinate uids"
        reaped = _run_as(uid, gid, CRASH_CHILD, top, args=("reap",))
        assert reaped == {"removed": [crashed["sid"]], "live": []}, reaped
        assert not left.exists()
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_the_ipython_kernel_runs_as_the_image_user_on_a_rootless_server(
        owned_layout: Path, subids_user: SubIdsUser, own_python: str) -> None:
    # The kernel (this server's interpreter, bound read-only: the busybox image has no
    # Python) runs as the image's app with its rights; the server still writes its
    # connection file and connects to the sockets app's kernel binds.
    uid, gid = subids_user.uid, subids_user.gid
    top = _layout_owned_by(owned_layout, uid, gid, "subids-ipython-")
    try:
        seen = _run_as(uid, gid, IPYTHON_CHILD, top, python=own_python,
                       args=(sysconfig.get_paths()["purelib"],))
        assert seen["cell"] == ["ok", ["1000", "1001", "v1", "kernel-ws-ok", "kernel-own-ok",
                                       "kernel-root-denied"]], seen
        assert seen["restarted"] == ["ok", ["1000"]], seen
        # A harness's relay, as the image's user, reaches the server's 0600 gateway socket.
        assert seen["gateway"][:2] == [0, ["sent"]] and seen["gateway"][3] == ["hello"], seen  # type: ignore[index]
        assert seen["sandboxes_left"] == []
    finally:
        shutil.rmtree(top, ignore_errors=True)


# The verifier also writes a folder of its own and beside its tests, and with umask 077 (a
# reward file only its own user may read): the server must still read and remove them.
VERIFIER_WRITES = ("umask 077\nmkdir -p /logs/verifier/sub && echo s > /logs/verifier/sub/f "
                   "&& echo c > /tests/cache || exit 1\n")


def test_harbor_verifiers_of_image_users_write_their_reward_on_a_rootless_server(
        user_layout: Path, subids_user: SubIdsUser) -> None:
    # On a rootless server with a subordinate range /logs/verifier and /tests are the
    # server's folders, root's inside the sandbox; a verifier (or agent) of a non-root image
    # user gets them in the sandbox's user namespace, and the server takes them back to read
    # the reward and to remove them.
    from tests.runtime.envs.test_harbor_users import APP, TEST, _task

    uid, gid = subids_user.uid, subids_user.gid
    top = _layout_owned_by(user_layout, uid, gid, "subids-harbor-")
    try:
        tasks = top / "tasks"
        layout = top / "layout"
        for name, tag, agent, verifier, users in (
                ("a-verifier-app", "root", "root", APP, '|user = "app"'),
                ("b-image-user", "named", APP, APP, ""),
                ("c-verifier-root", "named", APP, "root", '|user = "root"'),
                ("d-agent-app", "root", APP, "root", 'user = "app"|')):
            folder = _task(tasks, name, layout, tag, agent, verifier, users)
            (folder / "tests" / "test.sh").write_text(
                TEST.replace("#!/bin/sh\n", "#!/bin/sh\n" + VERIFIER_WRITES, 1))
        # A verifier user beyond the server's range: INIT refuses the task, naming the fix.
        _task(tasks, "e-far-verifier", layout, "root", "root", "root", f'|user = "{FAR}"')
        (top / "tmp").mkdir()
        for d, _, files in os.walk(top):
            for name in (d, *(os.path.join(d, f) for f in files)):
                os.lchown(name, uid, gid)
        seen = _run_as(uid, gid, HARBOR_CHILD, top, (f"TMPDIR={top / 'tmp'}",))
        assert seen["euid"] == uid and seen["subids"] != "None", seen
        results = seen["results"]
        assert results[:4] == [[name, 1.0, 0.0, []] for name in (  # type: ignore[index]
            "a-verifier-app", "b-image-user", "c-verifier-root", "d-agent-app")], seen
        name, oracle, noop, problems = results[4]  # type: ignore[index]
        assert (name, oracle, noop) == ("e-far-verifier", None, None), results[4]  # type: ignore[index]
        assert problems[0].startswith("oracle earned None") and "IMAGE_REJECTED: image " in (
            problems[0]), problems
        assert (f"the user '{FAR}' (task.toml [verifier].user) ({FAR}:0) is beyond the "
                "server's subordinate id range") in problems[0], problems
        # The jobs' verifier folders and sandboxes are gone, none left to a subordinate id.
        assert os.listdir(top / "tmp") == []
        assert os.listdir(top / "state" / "sandboxes") == []
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_without_a_subordinate_range_the_server_says_so_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from rollout.runtime.sandbox.images import subids

    (tmp_path / "subuid").write_text("someone:100000:65536\n")
    (tmp_path / "subgid").write_text("someone:100000:65536\n")
    monkeypatch.setattr(subids, "SUBUID", str(tmp_path / "subuid"))
    monkeypatch.setattr(subids, "SUBGID", str(tmp_path / "subgid"))
    subids.server_subids.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=subids.__name__):
            assert subids.server_subids() is None and subids.server_subids() is None
        assert len(caplog.records) == 1, caplog.records
        message = caplog.records[0].getMessage()
        assert "no range in " + str(tmp_path / "subuid") in message
        assert "can write every file of the image" in message
        me = pwd.getpwuid(os.geteuid()).pw_name
        (tmp_path / "subuid").write_text(f"{me}:100000:65536\n")
        (tmp_path / "subgid").write_text(f"{os.geteuid()}:200000:4096\n")
        ids, why = subids.lookup(os.geteuid())
        assert ids == subids.SubIds(((100000, 65536),), ((200000, 4096),), me) and why == ""
        assert ids.uid_map(5) == ["0", "5", "1", "1", "100000", "4096"]
        assert ids.covers(4096, 0) and not ids.covers(4097, 0)
        # A range added with `usermod --add-subuids` counts too: the ranges follow each other.
        (tmp_path / "subgid").write_text(f"{me}:200000:4096\n{me}:300000:65536\n"
                                         "other:400000:65536\n")
        ids, _ = subids.lookup(os.geteuid())
        assert ids is not None and ids.count == 65536 + 4096 - 4096
        assert ids.gid_map(5) == ["0", "5", "1", "1", "200000", "4096", "4097", "300000",
                                  "61440"]
        # Beyond it: the uid, what exists and the fix, past every user's range.
        why = ids.refusal("its user far", 70000, 0)
        assert "(70000:0) is beyond the server's subordinate id range" in why, why
        assert "uids and gids 0..65536" in why and "at least 4464 more ids" in why, why
        assert f"usermod --add-subuids 524288-589823 --add-subgids 524288-589823 {me}" in why
    finally:
        subids.server_subids.cache_clear()


@pytest.fixture
def busybox_lease(tmp_path: Path, busybox_layout: Path) -> Iterator[Any]:
    """A lease on the busybox image in a cache of the test's own."""
    from rollout.runtime.sandbox.images import lease_image

    lease = lease_image(f"oci:{busybox_layout}:bb",
                        ImageSettings(cache_dir=str(tmp_path / "cache")))
    try:
        yield lease
    finally:
        lease.release()


def test_a_refused_overlay_is_found_once_then_every_sandbox_copies(
        tmp_path: Path, busybox_lease: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # A kernel older than 5.11 (or an upper layer on a filesystem it rejects) refuses the
    # holder's mount; this kernel accepts it, so the refusal is played by a stand-in holder.
    # The first sandbox finds it and copies, says so once, and the next ones copy at once.
    from rollout.runtime.sandbox import bwrap

    tries: list[str] = []

    def refused(rootfs: Path, path: Path, sid: str, ids: object = None) -> None:
        tries.append(sid)
        raise bwrap._OverlayRefused("mount: permission denied")

    monkeypatch.setattr(bwrap, "_userns_overlay", refused)
    monkeypatch.setattr(bwrap, "_OVERLAY_REFUSED", {})
    for sid in ("a", "b"):
        (tmp_path / sid / "root").mkdir(parents=True)
        with caplog.at_level("INFO", logger=bwrap.__name__):
            assert bwrap._rootless_root("auto", busybox_lease, tmp_path / sid, sid) is None
        assert (tmp_path / sid / "root" / "bin" / "busybox").is_file()
    assert tries == ["a"]
    warnings = [r for r in caplog.records if "refused a rootless overlay" in r.message]
    assert len(warnings) == 1 and "private copy" in warnings[0].message
    # "overlay" never falls back: the refusal is the sandbox's error.
    (tmp_path / "c" / "root").mkdir(parents=True)
    with pytest.raises(bwrap._OverlayRefused):
        bwrap._rootless_root("overlay", busybox_lease, tmp_path / "c", "c")
    assert list((tmp_path / "c" / "root").iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_rollout_serve_as_a_rootless_user_runs_harbor_and_harness_jobs(
        user_layout: Path, subids_user: SubIdsUser, own_python: str) -> None:
    # The whole way a user runs Harbor tasks on a shared cluster, as an unprivileged user with
    # a subordinate range: `rollout tasks import-harbor`, `rollout serve` (its own process),
    # `rollout submit`. The model's job (the built-in agent loop), the oracle and the no-op
    # are scored by the task's own verifier as the image's user (a second task: a program the
    # agent installs in /usr/local/bin, and a reward of 0.75 with a named component); a
    # harness (a command that asks the model gateway once through its relay, then does the
    # task) runs in the task's image too, and its request becomes the job's turn. The server
    # stops on SIGTERM and leaves no sandbox behind.
    uid, gid = subids_user.uid, subids_user.gid
    top = _layout_owned_by(user_layout, uid, gid, "subids-serve-")
    try:
        # The interpreter's copy links its own libpython (the original's path is under root's
        # home, and the system's older libpython lacks symbols its ssl module needs).
        libs = Path(own_python).parents[2] / "base" / "lib"
        seen: dict[str, Any] = _run_as(
            uid, gid, SERVE_CHILD, top, python=own_python, timeout=patience(1100),
            env=(f"LD_LIBRARY_PATH={libs}",),
            args=(sysconfig.get_paths()["purelib"], str(REPO)))
        assert seen["euid"] == uid
        assert seen["submit"][0] == 0, seen["submit"]
        assert seen["rewards"] == {"model": 1, "oracle": 1, "noop": 0, "harness": 1,
                                   "oracle-tool": 0.75, "noop-tool": 0}, seen
        # A program installed in a system path; a reward that is not 0 or 1, with a component.
        assert seen["components"]["oracle-tool"].get("greets") == 1, seen["components"]
        assert seen["components"]["noop-tool"].get("greets") == 0, seen["components"]
        assert seen["turns"]["model"] == 2 and seen["turns"]["harness"] == 1, seen["turns"]
        assert seen["metadata"]["harness"]["final_text"] == "hello from the model", seen
        assert seen["serve_exit"] == 0, seen["log_tail"]
        assert seen["sandboxes_left"] == [], seen
        # SIGKILLed while the agent (the image's user) had written into its Harbor folder:
        # the folder holds a subordinate uid's file; the restarted server's sweep removes it
        # and the dead sandbox, and the recovered job, once cancelled, leaves nothing.
        crash = seen["crash"]
        before, after = crash["before"], crash["after_restart"]
        assert before["harbor"] and before["foreign"] and before["sandboxes"], crash
        assert crash["after_kill"] == {k: before[k] for k in ("harbor", "sandboxes")}, crash
        assert not set(before["harbor"]) & set(after["harbor"]), crash
        assert not set(before["sandboxes"]) & set(after["sandboxes"]), crash
        assert crash["cancel"][0] == 0 and "CANCELLED" in crash["state"].upper(), crash
        assert crash["serve_exit"] == 0, crash
        assert crash["left"] == {"harbor": [], "sandboxes": [], "tmp_foreign": []}, crash
    finally:
        shutil.rmtree(top, ignore_errors=True)


class StandInHolders(NamedTuple):
    tries: list[tuple[str, int]]
    """(sandbox id, tmpfs layer bytes; 0: the disk's) of each holder asked for."""
    refuse: set[str]
    """Sandbox ids whose tmpfs layer the stand-in refuses (as a kernel before 6.6 does)."""


@pytest.fixture
def stand_in_holders(monkeypatch: pytest.MonkeyPatch) -> StandInHolders:
    """Holders played by a stand-in (the real ones run as an unprivileged user above): it
    records what was asked for and refuses a tmpfs layer where told; tmpfs probed as usable,
    no layer refused yet, and a budget of layers of this test's own."""
    from rollout.runtime.sandbox import bwrap

    seen = StandInHolders([], set())

    def holder(rootfs: Path, path: Path, sid: str, ids: object = None, *,
               layer_bytes: int = 0) -> Any:
        seen.tries.append((sid, layer_bytes))
        if layer_bytes and (sid in seen.refuse or "*" in seen.refuse):
            raise bwrap._LayerRefused("mount: wrong fs type")
        return types.SimpleNamespace(pid=4_000_000 + len(seen.tries), sid=sid)

    monkeypatch.setattr(bwrap, "_userns_overlay", holder)
    monkeypatch.setattr(bwrap, "_LAYER_REFUSED", [])
    monkeypatch.setattr(bwrap, "_tmpfs_takes_user_xattrs", lambda: True)
    monkeypatch.setattr(bwrap, "_LAYERS", bwrap._LayerBudget())
    return seen


def test_a_refused_tmpfs_layer_is_found_once_then_upper_layers_stay_on_the_disk(
        tmp_path: Path, busybox_lease: Any, stand_in_holders: StandInHolders,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # A kernel whose tmpfs keeps no user.* attributes (before 6.6) cannot hold an upper layer
    # of an overlay mounted in a user namespace.
    from rollout.runtime.sandbox import bwrap

    tries = stand_in_holders.tries
    stand_in_holders.refuse.add("*")
    for sid in ("a", "b"):
        (tmp_path / sid / "root").mkdir(parents=True)
        with caplog.at_level("INFO", logger=bwrap.__name__):
            got = bwrap._rootless_root("auto", busybox_lease, tmp_path / sid, sid, None, 1 << 30)
        assert got.sid == sid
        assert (tmp_path / sid / "work").is_dir()  # the disk layer's work directory
    assert tries == [("a", 1 << 30), ("a", 0), ("b", 0)]
    warnings = [r for r in caplog.records if "tmpfs upper layer was refused" in r.message]
    assert len(warnings) == 1 and "without a quota" in warnings[0].message
    # Where tmpfs keeps no user attributes, no tmpfs layer is even tried.
    monkeypatch.setattr(bwrap, "_LAYER_REFUSED", [])
    monkeypatch.setattr(bwrap, "_tmpfs_takes_user_xattrs", lambda: False)
    (tmp_path / "c" / "root").mkdir(parents=True)
    bwrap._rootless_root("auto", busybox_lease, tmp_path / "c", "c", None, 1 << 30)
    assert tries[-1] == ("c", 0)


def test_without_a_memory_cgroup_the_live_tmpfs_layers_stay_within_the_memory_cap(
        tmp_path: Path, busybox_lease: Any, stand_in_holders: StandInHolders,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # A job may fill its whole tmpfs layer and, with no memory cgroup, nothing charges those
    # pages anywhere: the sizes of the live layers stay within the cap; the sandbox past it
    # keeps its upper layer on the disk, and one made after a layer ended gets a tmpfs again.
    from rollout.runtime.sandbox import bwrap

    tries, budget, mib = stand_in_holders.tries, bwrap._LAYERS, 1 << 20
    stand_in_holders.refuse.add("refused")

    def make(sid: str, cap: int = 9 * mib) -> Any:
        (tmp_path / sid / "root").mkdir(parents=True)
        return bwrap._rootless_root("auto", busybox_lease, tmp_path / sid, sid, None, 4 * mib,
                                    cap)

    with caplog.at_level("INFO", logger=bwrap.__name__):
        a, b, _, _ = make("a"), make("b"), make("c"), make("d")
    assert tries == [("a", 4 * mib), ("b", 4 * mib), ("c", 0), ("d", 0)]
    assert (tmp_path / "c" / "upper").is_dir() and not (tmp_path / "a" / "upper").exists()
    warned = [r for r in caplog.records if "would hold more than" in r.message]
    assert len(warned) == 1 and "on the disk" in warned[0].message, warned
    assert budget.held() == 8 * mib
    budget.release(a.pid)  # its sandbox's teardown stopped its holder
    make("e")
    assert tries[-1] == ("e", 4 * mib) and budget.held() == 8 * mib
    # A refused layer gives its reservation back; no cap of ours (a memory cgroup caps the
    # layers, or none was asked for) reserves nothing.
    budget.release(b.pid)
    make("refused")
    assert tries[-2:] == [("refused", 4 * mib), ("refused", 0)] and budget.held() == 4 * mib
    monkeypatch.setattr(bwrap, "_LAYER_REFUSED", [])
    make("f", cap=0)
    assert tries[-1] == ("f", 4 * mib) and budget.held() == 4 * mib


def test_the_layer_cap_is_the_memory_cap_only_where_no_memory_cgroup_applies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout.runtime.sandbox import SandboxConfig, bwrap, hardening

    group: list[Path | None] = [None]
    calls: list[tuple[str, str, int]] = []

    def acquire(state: str, cap: int) -> Path | None:
        calls.append(("acquire", state, cap))
        return group[0]

    monkeypatch.setattr(hardening, "acquire_memory_cgroup", acquire)
    monkeypatch.setattr(hardening, "physical_memory_bytes", lambda: 64 << 30)
    state = str(tmp_path)
    assert bwrap._layer_cap(SandboxConfig(state_dir=tmp_path)) == (32 << 30, state)
    assert bwrap._layer_cap(SandboxConfig(state_dir=tmp_path, memory_bytes=5 << 30)) == (
        5 << 30, state)
    group[0] = tmp_path / "cgroup.procs"  # the sandboxes' memory cgroup caps the layers
    assert bwrap._layer_cap(SandboxConfig(state_dir=tmp_path)) == (0, state)
    assert bwrap._layer_cap(SandboxConfig(state_dir=tmp_path, memory_bytes=-1)) == (0, None)
    assert len(calls) == 3  # no cap asked for: no cgroup either


_FORK_CHILD = """
import os, subprocess, sys, time
from rollout.runtime.sandbox import bwrap

made = []
def spawn(kind):
    made.append(subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE))
    return made[-1]
bwrap._spawn_holder = spawn
taken = bwrap._HOLDERS.take(bwrap._HolderKind(None, "/layer-fork", 1 << 20))
deadline = time.monotonic() + float(sys.argv[1])
while len(bwrap._HOLDERS.ready()) < bwrap._HolderPool.size and time.monotonic() < deadline:
    time.sleep(0.01)
ready = bwrap._HOLDERS.ready()
assert bwrap._LAYERS.reserve(1 << 20, 1 << 30)
bwrap._LAYERS.hold(taken.pid, 1 << 20)
bwrap._LAYERS.unreserve(1 << 20)
pid = os.fork()
if pid == 0:
    os._exit(0 if bwrap._HOLDERS.ready() == [] and bwrap._LAYERS.held() == 0 else 3)
_, status = os.waitpid(pid, 0)
print(len(ready), os.waitstatus_to_exitcode(status), bwrap._HOLDERS.ready() == ready,
      bwrap._LAYERS.held())
"""


def test_a_forked_child_has_none_of_its_parents_holders_or_layers() -> None:
    # A process forked from the server (a multiprocessing worker, a grader's fork) must never
    # hand out its parent's ready holders (each serves one sandbox) nor count its parent's
    # tmpfs layers: in it the pool and the budget start empty (os.register_at_fork), and its
    # parent's stay as they were. In a fresh interpreter, holders stood in for as above.
    out = subprocess.run([sys.executable, "-c", _FORK_CHILD, str(patience(30))],
                         capture_output=True, text=True, timeout=patience(120))
    assert out.stdout.split() == ["2", "0", "True", str(1 << 20)], (out.stdout, out.stderr)


def test_this_kernels_tmpfs_keeps_user_attributes_as_probed() -> None:
    from rollout.runtime.sandbox import bwrap

    release = tuple(int(x) for x in os.uname().release.split(".")[:2])
    assert bwrap._tmpfs_takes_user_xattrs() == (release >= (6, 6))


def test_the_holder_pool_is_bounded_per_kind_and_in_kinds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Holders stood in for by processes that wait on their stdin as a holder does.
    from rollout.runtime.sandbox import bwrap

    made: list[subprocess.Popen[bytes]] = []

    def spawn(kind: object) -> subprocess.Popen[bytes]:
        made.append(subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE))
        return made[-1]

    monkeypatch.setattr(bwrap, "_spawn_holder", spawn)
    pool = bwrap._HolderPool()
    pool.kinds, pool.refill_delay_s = 2, 0.0
    kinds = [bwrap._HolderKind(None, f"/layer-{n}", 1 << 20) for n in range(3)]

    def settled(count: int) -> list[int]:
        deadline = time.monotonic() + patience(30)
        while len(pool.ready()) != count and time.monotonic() < deadline:
            time.sleep(0.01)
        return pool.ready()

    try:
        first = pool.take(kinds[0])  # none ready: made now; two made ahead
        before = settled(2)
        assert len(before) == 2 and first.pid not in before
        again = pool.take(kinds[0])
        assert again.pid == before[0]  # the oldest ready one
        assert len(settled(2)) == 2  # refilled to the bound, not past it
        second = pool.take(kinds[1])
        assert len(settled(4)) == 4  # two kinds, two each
        a_ready = [p for p in made if p.pid in pool.ready()][:2]
        third = pool.take(kinds[2])  # a third kind: the least recently taken kind's end
        settled(4)
        assert all(p.poll() is not None for p in a_ready), "kind 0's ready holders ended"
        taken = {first.pid, again.pid, second.pid, third.pid}
        assert not taken & set(pool.ready()), "a taken holder never comes back"
        pool.close()
        assert pool.ready() == [] and all(p.poll() is not None for p in made
                                          if p.pid not in taken)
    finally:
        pool.close()
        for p in made:
            p.kill()
            p.wait()
