"""The bubblewrap runtime (the default): one sandbox = one directory + a launcher line.

Layout of a sandbox on the host, ``<state_dir>/sandboxes/<id>/``::

    lock        flock held while the sandbox lives (the reaper skips locked dirs)
    meta.json   uid and creator pid, for the reaper
    workspace/  -> /workspace (rw)
    tmp/        -> /tmp (rw, shared by every process of the sandbox)
    ctl/        -> /.sandbox (rw; the IPython kernel's ipc sockets)

Every process of the sandbox (``exec`` commands, the pty bash, the IPython kernel) is started
by the same launcher line, so they all see the same files; each gets its own PID namespace
whose anchor is the bwrap process we spawn, so killing that one process kills everything it
started (including commands that ignore SIGINT, and fork bombs).

The root is an empty tmpfs onto which only what a job needs is bound read-only (system trees,
an allow-listed ``/etc``, the interpreter: :mod:`rollout.runtime.sandbox.view`), then remounted
read-only: bwrap cannot create ``/workspace`` on a read-only bind of ``/`` itself. With
``rootfs`` (or ``host_view="host"``) each top-level entry of that root is bound instead, the
state dir, ``/root``, ``/run`` (host sockets) and similar covered by empty tmpfs mounts.

When the server runs as root, bwrap runs privileged (it can read ``/root/.pyenv`` to bind the
interpreter) and the command then drops to a per-sandbox uid with ``setpriv`` and
``no_new_privs`` — so RLIMIT_NPROC applies (root is exempt from it) and counts per sandbox.
Otherwise bwrap runs rootless in a user namespace as the server's own user.

Why not a user namespace owned by the sandbox uid when we are root: that bwrap would have to
read every bind source as that uid, and the server's interpreter typically lives under a
0700 home (``/root/.pyenv``); an unprivileged bwrap cannot bind it (``--ro-bind-fd`` is
re-resolved by path). Privileged bwrap + ``setpriv --no-new-privs`` gives the same result for
the sandboxed command: an unprivileged uid, no capabilities, nothing it can regain.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import json
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollout.runtime.sandbox import hardening, hostfs, procs, view
from rollout.runtime.sandbox.base import (
    ExecResult,
    Network,
    Sandbox,
    SandboxConfig,
    SandboxError,
    SandboxLimits,
    SandboxUnavailable,
    check_binds,
    finish_creation,
    register_live,
)

CTL_IN_SANDBOX = "/.sandbox"
LAUNCH_VAR = "ROLLOUT_LAUNCH"
log = logging.getLogger(__name__)


def _is_root() -> bool:
    return os.geteuid() == 0


@functools.lru_cache(maxsize=1)
def _quota_possible() -> bool:
    if not hardening.can_mount():
        log.warning("the server does not run as root: sandboxes get no disk quota (their "
                    "/workspace and /tmp live on the state dir's filesystem)")
        return False
    return True


def _hardening(config: SandboxConfig) -> tuple[Path | None, Path | None]:
    """(cgroup.procs of the shared memory cgroup, seccomp program) for this configuration;
    the caller releases the cgroup (``hardening.release_memory_cgroup``) at teardown."""
    state = os.path.abspath(config.state_dir)
    cgroup = None
    if config.memory_bytes >= 0:
        cap = config.memory_bytes or hardening.physical_memory_bytes() // 2
        cgroup = hardening.acquire_memory_cgroup(state, cap)
    seccomp = (hardening.seccomp_program(os.path.join(state, "sandbox-seccomp"))
               if config.seccomp else None)
    return cgroup, seccomp


def default_env(python: str) -> dict[str, str]:
    """What a sandboxed process sees; nothing of the server's own environment leaks in."""
    bindir = os.path.dirname(python)
    return {"PATH": f"{bindir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/tmp/home", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "TERM": "dumb", "USER": "sandbox", "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg",
            "PYTHONDONTWRITEBYTECODE": "1", "PAGER": "cat", "GIT_PAGER": "cat"}


class BwrapSandbox(Sandbox):
    def __init__(self, config: SandboxConfig, sid: str, path: Path, lock_fd: int,
                 lease: procs.UidLease | None, env: dict[str, str], network: Network,
                 limits: SandboxLimits, rootfs: Path | None,
                 extra_binds: tuple[tuple[str, str, bool], ...] = ()) -> None:
        super().__init__()
        self.config = config
        self.id = sid
        self.path = path
        self.workspace = path / "workspace"
        self.workspace_in_sandbox = config.workspace_in_sandbox
        self.env = env
        self.network = network
        self.limits = limits
        self.python = config.python or sys.executable
        self._lock_fd = lock_fd
        self._lease = lease
        self._launches = 0
        # A launch's file binds must land on new top-level names: none the host's root (or the
        # rootfs) has, and none this sandbox already binds.
        self._root = str(rootfs) if rootfs else "/"
        self._taken = {CTL_IN_SANDBOX, self.workspace_in_sandbox,
                       *(inside for _, inside in config.extra_ro_binds),
                       *(inside for _, inside, _ in extra_binds)}
        state = os.path.abspath(config.state_dir)
        interpreters = view.python_prefixes(self.python)
        if rootfs is not None:
            binds = view.host_binds(str(rootfs), (), state, ())
        elif config.host_view == "host":
            binds = view.host_binds("/", config.hide_paths, state, interpreters)
        else:
            binds = view.minimal_binds(
                state, view.curated_etc(state, config.etc_entries), config.system_paths,
                config.visible_paths, view.never_visible(state, config.hide_paths),
                interpreters)
        ns = ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
              "--hostname", "sandbox", "--die-with-parent"]
        if network == "none":
            ns.append("--unshare-net")
        if lease is None:
            ns.append("--unshare-user")
        else:
            ns += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        mounts = ["--bind", str(path / "tmp"), "/tmp",
                  "--bind", str(self.workspace), self.workspace_in_sandbox,
                  "--bind", str(path / "ctl"), CTL_IN_SANDBOX]
        if rootfs is None:
            # The server's Python (a venv in a checkout under /tmp, say) must stay reachable
            # inside although the sandbox gets a /tmp of its own.
            # Masks inside it follow (a wheel install keeps the service's package in it).
            mounts += view.rebinds_below(interpreters, "/tmp/",
                                         view.never_visible(state, config.hide_paths))
        for host, inside in config.extra_ro_binds:
            mounts += ["--ro-bind", host, inside]
        for host, inside, writable in extra_binds:
            mounts += ["--bind" if writable else "--ro-bind", host, inside]
        cgroup, seccomp = _hardening(config)
        self._memory_group = os.path.abspath(config.state_dir) if config.memory_bytes >= 0 else None
        if seccomp is not None:
            ns += ["--seccomp", hardening.SECCOMP_FD]
        # Launch-only binds (:meth:`command_argv`) go after these and before the root is
        # made read-only, which they need to create their mount points.
        self._prefix = [*hardening.launch_wrapper(cgroup, seccomp),
                        "prlimit", *limits.prlimit_args(), "--", "bwrap", *ns, *binds, *mounts]
        self._drop: list[str] = []
        if lease is not None:
            u = str(lease.uid)
            self._drop = ["setpriv", f"--reuid={u}", f"--regid={u}", "--clear-groups",
                          "--inh-caps=-all", "--no-new-privs", "--"]

    # -- creation ----------------------------------------------------------------------------
    @classmethod
    async def create(cls, config: SandboxConfig, *, workspace_files: Mapping[str, bytes | str],
                     env: Mapping[str, str], network: Network, limits: SandboxLimits,
                     rootfs: Path | str | None = None,
                     binds: Sequence[tuple[str, str, bool]] = (),
                     **unknown: Any) -> BwrapSandbox:
        """``binds``: per-sandbox (host dir, sandbox path, writable) mounts, e.g. a task's
        prepared environment, read-only, shared by every job of its repository."""
        if unknown:
            raise SandboxError(f"unknown sandbox options: {sorted(unknown)}",
                               "INVALID_SANDBOX_OPTIONS")
        for tool in ("bwrap", "prlimit") + (("setpriv",) if _is_root() else ()):
            if shutil.which(tool) is None:
                raise SandboxUnavailable(
                    f"the bwrap sandbox runtime needs `{tool}` on PATH: install it with "
                    "`apt-get install bubblewrap util-linux` (or your distribution's packages)")
        rootfs = Path(rootfs) if rootfs else config.rootfs
        if rootfs is not None and not await asyncio.to_thread(Path(rootfs).is_dir):
            raise SandboxError(f"rootfs {rootfs} is not a directory", "INVALID_SANDBOX_OPTIONS")
        return await finish_creation(functools.partial(
            cls._create_sync, config, dict(workspace_files), dict(env), network, limits,
            rootfs, check_binds(binds, config.workspace_in_sandbox, CTL_IN_SANDBOX)))

    @classmethod
    def _create_sync(cls, config: SandboxConfig, files: dict[str, bytes | str],
                     env: dict[str, str], network: Network, limits: SandboxLimits,
                     rootfs: Path | None,
                     binds: tuple[tuple[str, str, bool], ...] = ()) -> BwrapSandbox:
        root = config.sandboxes_dir
        root.mkdir(parents=True, exist_ok=True, mode=0o711)
        sid = uuid.uuid4().hex[:12]
        path = root / sid
        path.mkdir(mode=0o711)
        lease: procs.UidLease | None = None
        lock_fd = -1
        try:
            if config.disk_bytes > 0 and _quota_possible():
                hardening.mount_quota(path, config.disk_bytes)
            lock_fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _is_root():
                lease = procs.UidLease.acquire(config.uid_lock_dir, config.uid_base,
                                               config.uid_count)
            (path / "meta.json").write_text(json.dumps({
                "uid": lease.uid if lease else None, "server_pid": os.getpid(),
                "created": time.time()}))
            owner = (lease.uid, lease.uid) if lease else None
            for sub in ("workspace", "tmp", "tmp/home", "ctl"):
                (path / sub).mkdir(mode=0o755)
                if owner:
                    os.chown(path / sub, *owner)
            os.chmod(path / "tmp", 0o1777)
            for rel, data in files.items():
                hostfs.write_beneath(path / "workspace", rel,
                                     data.encode() if isinstance(data, str) else data,
                                     0o644, owner)
            sb_env = default_env(config.python or sys.executable)
            sb_env.update(env)
            sb = cls(config, sid, path, lock_fd, lease, sb_env, network, limits, rootfs, binds)
            register_live(sb)
        except BaseException:
            if lease:
                lease.release()
            if lock_fd >= 0:
                os.close(lock_fd)
            hostfs.rmtree(path)
            raise
        return sb

    # -- processes ---------------------------------------------------------------------------
    def command_argv(self, argv: Sequence[str], *, cwd: str | None = None,
                     env: Mapping[str, str] | None = None, tty: bool = False,
                     file_binds: Sequence[tuple[str, str]] = ()) -> list[str]:
        """``file_binds``: (host file, sandbox path) pairs bound read-only into this launch
        only, e.g. a job's gateway socket, which exists only while RUN serves it (a socket
        stays connectable through a read-only bind)."""
        self._check_alive()
        extra: list[str] = []
        for host, inside in file_binds:
            norm = os.path.normpath(inside)
            if (not norm.startswith("/") or norm.count("/") != 1 or norm in ("/", *self._taken)
                    or os.path.lexists(os.path.join(self._root, norm.lstrip("/")))):
                # A new name right below / lands on the launch's own root tmpfs: never on a
                # host path, never under a directory the sandbox can write (and plant links in).
                raise SandboxError(f"a launch bind must be a new top-level name such as "
                                   f"'/.gateway.sock', got {inside!r}", "INVALID_SANDBOX_OPTIONS")
            if not os.path.exists(host) or os.path.isdir(host):
                raise SandboxError(f"launch bind source {host} is not an existing file",
                                   "INVALID_SANDBOX_OPTIONS")
            extra += ["--ro-bind", os.path.abspath(host), norm]
        # No --new-session even without a tty: the launcher already runs in its own session
        # (so there is no terminal to inject input into), and keeping the sandbox's PID 1 in
        # the launcher's process group lets one killpg() end a launch at any moment.
        self._launches += 1
        tag = f"{self.id}.{self._launches}"
        return [*self._prefix, *extra, "--remount-ro", "/", "--setenv", LAUNCH_VAR, tag,
                "--chdir", cwd or self.workspace_in_sandbox, *self._drop, *argv]

    @staticmethod
    def _needle(argv: Sequence[str]) -> bytes | None:
        """What identifies one launch's processes in /proc/*/cmdline."""
        try:
            tag = argv[list(argv).index(LAUNCH_VAR) + 1]
        except (ValueError, IndexError):
            return None
        return b"\0" + LAUNCH_VAR.encode() + b"\0" + tag.encode() + b"\0"

    def spawn_env(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        merged = dict(self.env)
        if env:
            merged.update(env)
        return merged

    def control_dir(self) -> tuple[Path, str]:
        return self.path / "ctl", CTL_IN_SANDBOX

    def _owner(self) -> tuple[int, int] | None:
        return (self._lease.uid, self._lease.uid) if self._lease else None

    async def exec(self, cmd: str | Sequence[str], *, timeout: float | None = None,  # noqa: ASYNC109
                   cwd: str | None = None, env: Mapping[str, str] | None = None,
                   stdin: bytes | None = None, max_output: int = 1 << 20,
                   file_binds: Sequence[tuple[str, str]] = ()) -> ExecResult:
        argv = self.command_argv(["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd),
                                 cwd=cwd, file_binds=file_binds)
        return await procs.run_collect(
            argv, env=self.spawn_env(env),
            timeout=timeout if timeout is not None else self.limits.default_timeout_s,
            stdin=stdin, max_output=max_output, on_spawn=self.track, on_exit=self.untrack,
            orphan_needle=self._needle(argv))

    # -- lifetime ----------------------------------------------------------------------------
    def _kill_runtime_processes(self) -> None:
        # Every launch of this sandbox carries its tag; killing a launch's bwrap ends its PID
        # namespace, and with it whatever the launch left running in the background.
        procs.spawner_barrier()
        procs.sweep(b"\0" + LAUNCH_VAR.encode() + b"\0" + self.id.encode() + b".")
        if self._lease is not None:
            if procs.uid_has_processes(self._lease.uid):
                procs.kill_uid(self._lease.uid)

    def _teardown_runtime(self) -> None:
        # Each step on its own: one that raises must not keep the others (the quota mount
        # above all) from being released. Idempotent, since exit may run it a second time.
        group, self._memory_group = self._memory_group, None
        self._release_host_side(self.path, group)
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
