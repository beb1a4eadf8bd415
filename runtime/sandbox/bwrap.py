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
Otherwise bwrap runs rootless in a user namespace as the server's own user; an image sandbox of
a server with a subordinate id range (``images.subids``) runs in a user namespace that maps the
image's uids, as bwrap's root there with a setpriv drop to the image's user.

Why not a user namespace owned by the sandbox uid when we are root: that bwrap would have to
read every bind source as that uid, and the server's interpreter typically lives under a
0700 home (``/root/.pyenv``); an unprivileged bwrap cannot bind it (``--ro-bind-fd`` is
re-resolved by path). Privileged bwrap + ``setpriv --no-new-privs`` gives the same result for
the sandboxed command: an unprivileged uid, no capabilities, nothing it can regain.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import collections
import contextlib
import dataclasses
import fcntl
import functools
import json
import logging
import os
import select
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from rollout.runtime.sandbox import hardening, hostfs, images, procs, view
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
from rollout.runtime.sandbox.images import ImageLease, inject, owners, subids
from rollout.runtime.sandbox.images.user import ROOT as ROOT_USER

CTL_IN_SANDBOX = "/.sandbox"
LAUNCH_VAR = "ROLLOUT_LAUNCH"
PARKED_EXEC = (Path(__file__).resolve().parent.parent / "envs" / "in_sandbox"
               / "parked_exec.py")
"""The waiter a parked launch runs (:meth:`BwrapSandbox.park`)."""
NS_OWNERS = PARKED_EXEC.with_name("ns_owners.py")
"""What sets the image's owners inside a rootless sandbox's mapped user namespace."""
NS_FILES = PARKED_EXEC.with_name("ns_files.py")
"""What writes a workspace file there (appended to :mod:`hostfs`'s source)."""
log = logging.getLogger(__name__)


def _is_root() -> bool:
    return os.geteuid() == 0


_FOUND: set[str] = set()
"""Tools found on PATH once: not looked for again (a PATH walk per tool per creation); a
missing one is, so installing it fixes a running server."""


def _missing(tool: str) -> bool:
    if tool in _FOUND:
        return False
    if shutil.which(tool) is None:
        return True
    _FOUND.add(tool)
    return False


@functools.lru_cache(maxsize=1)
def _quota_possible() -> bool:
    if not hardening.can_mount():
        log.warning("the server does not run as root: a sandbox's /workspace and /tmp get "
                    "no disk quota (they live on the state dir's filesystem; what an image "
                    "sandbox writes into its image's root does, on Linux 6.6+)")
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


def _seal(args: Sequence[str], root: bool, *, masks: bool = True) -> list[str]:
    """What ends a launch's mounts (after its own binds, which need mount points made): the
    root tmpfs (``root``: not an image's) and, with ``masks``, every tmpfs the view covers a
    path with made read-only. A mask is empty and stays so: on a rootless server its tmpfs is
    the sandbox user's, without a size, and would hold whatever a job wrote into it in
    memory."""
    dests: list[tuple[int, str]] = []
    for i, arg in enumerate(args):
        if arg in _TWO_PATH_MOUNTS and i + 2 < len(args):
            dests.append((i, args[i + 2]))
        elif arg in _ONE_PATH_MOUNTS and i + 1 < len(args):
            dests.append((i, args[i + 1]))
    # A mask that a later mount covers (the state dir below a /tmp the sandbox replaces) is
    # gone from the launch's tree: nothing to seal there.
    covered = [path for i, path in dests if masks and args[i] == "--tmpfs" and path != "/"
               and not any(j > i and (path == d or path.startswith(d.rstrip("/") + "/"))
                           for j, d in dests)]
    return [a for path in (["/"] if root else []) + covered for a in ("--remount-ro", path)]


_TWO_PATH_MOUNTS = frozenset({"--bind", "--ro-bind", "--dev-bind", "--bind-try",
                              "--ro-bind-try", "--dev-bind-try"})
_ONE_PATH_MOUNTS = frozenset({"--tmpfs", "--dir", "--proc", "--dev", "--mqueue"})


def default_env(python: str) -> dict[str, str]:
    """What a sandboxed process sees; nothing of the server's own environment leaks in."""
    bindir = os.path.dirname(python)
    return {"PATH": f"{bindir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/tmp/home", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "TERM": "dumb", "USER": "sandbox", "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg",
            "PYTHONDONTWRITEBYTECODE": "1", "PAGER": "cat", "GIT_PAGER": "cat"}


def _image_env(defaults: dict[str, str], config: images.ImageConfig,
               caller: Mapping[str, str], user: images.ImageUser) -> dict[str, str]:
    """An image sandbox's environment: the sandbox defaults (but their PATH, which names the
    server's interpreter), then the image's ``Env``, then the caller's; ``PATH`` is the
    image's with the static bash of ``/.rollout/bin`` last. An image user other than root
    gets its passwd name as ``USER`` and its passwd home as ``HOME`` unless ``Env`` sets one."""
    env = {k: v for k, v in defaults.items() if k != "PATH"}
    if not user.is_root:
        env["USER"] = user.name
        if user.home and user.home != "/":
            env["HOME"] = user.home
    image_env = config.env_dict
    env.update(image_env)
    env["PATH"] = caller.get("PATH") or inject.image_path(image_env.get("PATH", ""))
    return env


class BwrapSandbox(Sandbox):
    def __init__(self, config: SandboxConfig, sid: str, path: Path, lock_fd: int,
                 lease: procs.UidLease | None, env: dict[str, str], network: Network,
                 limits: SandboxLimits, rootfs: Path | None,
                 extra_binds: tuple[tuple[str, str, bool], ...] = (),
                 image: ImageLease | None = None,
                 image_user: images.ImageUser = ROOT_USER,
                 holder: subprocess.Popen[bytes] | None = None,
                 pinned: frozenset[str] = frozenset(),
                 ids: subids.SubIds | None = None) -> None:
        super().__init__()
        self._holder = holder
        self._ids = ids if holder is not None else None
        """A rootless image sandbox's subordinate id mapping (its holder's user namespace
        has the image's uids): launches run bwrap as that namespace's root and drop to the
        image user with setpriv, as a root server's do."""
        self._handed: set[str] = set()
        """Host folders :meth:`hand_over` gave the image's users in the mapped namespace:
        given back to the server's user at teardown, while the namespace still exists."""
        self.config = config
        self.id = sid
        self.path = path
        self.workspace = path / "workspace"
        self.workspace_in_sandbox = config.workspace_in_sandbox
        self.env = env
        self.network = network
        self.limits = limits
        self.python = config.python or sys.executable
        self.python_launcher: tuple[str, ...] = ()
        """What the IPython kernel's interpreter is started through (the host loader in an
        image root, see :mod:`rollout.runtime.sandbox.images.inject`)."""
        self.python_inside = ""
        """Where that interpreter is inside, when not at :attr:`python` (an image root that
        cannot have it at its own path: ``/.rollout/python``); see :func:`python_argv`."""
        self.kernel_socket_umask = 0 if self._ids is not None and not image_user.is_root else None
        """The umask the IPython kernel binds its sockets with (then its usual one): on a
        rootless server with a subordinate range the kernel's user is not the server's, which
        must still connect to them (in the control folder only they share)."""
        self.image = image
        self.image_user = image_user
        """Who the processes of an image sandbox are by default (the image config's ``User``,
        or the user the sandbox was asked to run as); ``exec(user=...)`` picks another."""
        self.default_cwd = self.workspace_in_sandbox
        self._lock_fd = lock_fd
        self._lease = lease
        self._launches = 0
        self._parked: subprocess.Popen[bytes] | None = None
        self._parked_needle: bytes | None = None
        self._parked_ready = -1
        self._pinned = frozenset(pinned)
        """Environment keys the image's Env or the creator set: another user's HOME and USER
        never replace them."""
        # A launch's file binds must land on new top-level names: none the host's root (or the
        # rootfs) has, and none this sandbox already binds.
        self._root = str(rootfs) if rootfs else "/"
        if image is not None:
            self._root = str(path / "root") if lease is not None else str(image.image.rootfs)
        self._taken = {CTL_IN_SANDBOX, self.workspace_in_sandbox,
                       *(inside for _, inside in config.extra_ro_binds),
                       *(inside for _, inside, _ in extra_binds)}
        state = os.path.abspath(config.state_dir)
        interpreters = view.python_prefixes(self.python)
        if image is not None:
            binds: Sequence[str] = self._image_root(image, path, lease is not None,
                                                    interpreters,
                                                    setpriv=self._ids is not None)
        elif rootfs is not None:
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
        # /dev/shm is the sandbox's own folder, as /tmp is, shared by its launches (POSIX
        # semaphores and shared memory: multiprocessing's locks, a test runner's workers).
        # Where the sandbox's user could write bwrap's other tmpfs mounts (sizeless: memory
        # outside any quota), /dev and every mask are made read-only: on a rootless server it
        # owns them, and an image's root has the capabilities to. A root server's plain
        # sandbox runs as a uid that cannot, and its launches skip the remounts (each reads
        # the whole mount table, which grows with the live sandboxes).
        sealed = lease is None or image is not None
        mounts = ["--bind", str(path / "tmp"), "/tmp",
                  "--bind", str(self.workspace), self.workspace_in_sandbox,
                  "--bind", str(path / "ctl"), CTL_IN_SANDBOX,
                  "--bind", str(path / SHM_DIR), "/dev/shm",
                  *(["--remount-ro", "/dev"] if sealed else [])]
        if rootfs is None and image is None:
            # The server's Python (a venv in a checkout under /tmp, say) must stay reachable
            # inside although the sandbox gets a /tmp of its own.
            # Masks inside it follow (a wheel install keeps the service's package in it).
            mounts += view.rebinds_below(interpreters, "/tmp/",
                                         view.never_visible(state, config.hide_paths))
        if image is not None:
            # bwrap makes a missing mount point's parents 0700: an image user other than
            # root could not reach /logs/verifier through them.
            mounts += _parents(image.image.rootfs, [inside for _, inside in
                                                    config.extra_ro_binds]
                               + [inside for _, inside, _ in extra_binds])
        for host, inside in config.extra_ro_binds:
            mounts += ["--ro-bind", host, inside]
        for host, inside, writable in extra_binds:
            mounts += ["--bind" if writable else "--ro-bind", host, inside]
        cgroup, seccomp = _hardening(config)
        if cgroup is not None:
            procs.join_spawner(cgroup)
        self._memory_group = os.path.abspath(config.state_dir) if config.memory_bytes >= 0 else None
        self._seccomp = seccomp is not None
        self._ns, self._binds, self._mounts = ns, list(binds), mounts
        self._wrapper = hardening.launch_wrapper(cgroup, seccomp, limits.ulimit_script())
        self._seal = _seal(self._binds + mounts, image is None, masks=sealed)
        self._chains: dict[images.ImageUser, tuple[list[str], list[str], list[str]]] = {}
        self._prefix = self._chain(image_user)[0]  # the default chain, built up front

    def _chain(self, user: images.ImageUser) -> tuple[list[str], list[str], list[str]]:
        """(prefix, uid drop, inner bwrap) of a launch whose processes run as ``user``.

        A root server runs an image user other than root through a second, unprivileged bwrap
        that maps it onto the sandbox's own uid (that inner bwrap loads the seccomp filter,
        which forbids the user namespace it makes; the program's fd is inherited down to it);
        the image's root keeps the sandbox uid with the image capabilities. A rootless server
        with subordinate ids runs bwrap as its holder namespace's root, where the image's uids
        exist, and drops to the user with setpriv; one without maps the user onto its own in
        bwrap's user namespace."""
        cached = self._chains.get(user)
        if cached is not None:
            return cached
        image, lease = self.image, self._lease
        nested = image is not None and lease is not None and not user.is_root
        ns = list(self._ns)
        extra: list[str] = []
        ids = self._ids
        if ids is not None and image is not None and not ids.covers(user.uid, user.gid):
            raise _beyond(ids, image, f"image user {user.name}", user)
        if ids is not None:
            # bwrap runs as the holder namespace's root (no user namespace of its own, so the
            # image's uids stay themselves) and keeps only what the drop needs, or the image
            # capabilities for the image's root.
            ns += ["--cap-drop", "ALL"]
            ns += [a for cap in (("CAP_SETUID", "CAP_SETGID") if not user.is_root
                                 else inject.IMAGE_CAPS) for a in ("--cap-add", cap)]
        elif lease is None:
            ns.append("--unshare-user")
            if image is not None:  # the image's user is the server's own user
                ns += ["--uid", str(user.uid), "--gid", str(user.gid)]
                if not user.is_root and _new_home(image.image.rootfs, user.home):
                    extra += ["--perms", "0755", "--dir", user.home]
        else:
            ns += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
            if image is not None and not nested:
                ns += [a for cap in inject.IMAGE_CAPS for a in ("--cap-add", cap)]
        if self._seccomp and not nested:
            ns += ["--seccomp", hardening.SECCOMP_FD]
        inner: list[str] = []
        if nested:
            inner = [*inject.loader_argv(), f"{inject.BIN_IN}/bwrap", "--unshare-user",
                     "--uid", str(user.uid), "--gid", str(user.gid), "--dev-bind", "/", "/",
                     *(["--seccomp", hardening.SECCOMP_FD] if self._seccomp else [])]
        # Launch-only binds (:meth:`command_argv`) go after these and before the root is
        # made read-only, which they need to create their mount points.
        prefix = [*self._wrapper,
                  *(["nsenter", "-t", str(self._holder.pid), "--user", "--mount",
                     "--preserve-credentials", "--"] if self._holder is not None else []),
                  "bwrap", *ns, *self._binds, *extra, *self._mounts]
        drop: list[str] = []
        if ids is not None and not user.is_root:
            drop = [*inject.loader_argv(), f"{inject.BIN_IN}/setpriv", f"--reuid={user.uid}",
                    f"--regid={user.gid}", "--clear-groups", "--inh-caps=-all",
                    "--no-new-privs", "--"]
        elif lease is not None:
            u = str(lease.uid)
            if image is None:
                drop = ["setpriv", f"--reuid={u}", f"--regid={u}", "--clear-groups",
                        "--inh-caps=-all", "--no-new-privs", "--"]
            elif nested:
                drop = [*inject.loader_argv(), f"{inject.BIN_IN}/setpriv", f"--reuid={u}",
                        f"--regid={u}", "--clear-groups", "--inh-caps=-all", "--no-new-privs",
                        "--"]
            else:
                drop = [*inject.loader_argv(), f"{inject.BIN_IN}/setpriv", f"--reuid={u}",
                        f"--regid={u}", "--clear-groups", *inject.image_caps_args(),
                        "--no-new-privs", "--"]
        self._chains[user] = (prefix, drop, inner)
        return prefix, drop, inner

    def user_for(self, spec: str | None, *,
                 named_by: str = "the user asked for") -> images.ImageUser:
        """A user of this sandbox's image (``spec`` as an image config's ``User`` spells it;
        None: the config's ``User`` itself, which a sandbox made with ``user=`` does not run
        as), for ``exec(..., user=...)``; resolved now, in the image as it was unpacked (not in the
        files the job may have changed since), and, on a root server, given (when called
        before the sandbox's first launch) its home, the image's working directory and the
        files its image gave it, as the sandbox's default user has them. Blocking (it reads
        the image's /etc/passwd). A name the image lacks raises ``IMAGE_REJECTED``."""
        if self.image is None:
            raise SandboxError("only a sandbox on an image runs commands as a user of its "
                               "image", "INVALID_SANDBOX_OPTIONS")
        cached = self.image.image
        if spec is None:
            spec, named_by = cached.config.user, "its config's User"
        user = images.resolve_user(cached.rootfs, spec, image=cached.ref, named_by=named_by)
        if self._ids is not None and not self._ids.covers(user.uid, user.gid):
            raise _beyond(self._ids, self.image, f"the user {spec!r} ({named_by})", user)
        # Only before the first launch: no process of the sandbox could have planted a link.
        if self._ids is not None and not user.is_root and self._launches == 0:
            _ns_owners(self._holder, {"dirs": _home_dirs(
                cached.rootfs, self.path / "root", (user.home, cached.config.working_dir),
                user)})
        if self._lease is not None and not user.is_root and self._launches == 0:
            _give_dirs(self.path / "root", (user.home, cached.config.working_dir),
                       self._lease.uid)
            _give_owned(self.path / "root", owners.owned_by(str(cached.rootfs), user),
                        self._lease.uid)
        return user

    def hand_over(self, paths: Sequence[Path | str], user: Any = None) -> None:
        """On a rootless server with a subordinate range: chown inside the sandbox's mapped
        user namespace, where its root (the server's user, which owns these host folders)
        may give them to any of the image's uids, as :data:`NS_OWNERS` gives the workspace
        at creation; the server cannot from outside."""
        if self._ids is None:
            super().hand_over(paths, user)
            return
        who = user if isinstance(user, images.ImageUser) else self.image_user
        self._handed.update(str(p) for p in paths)
        failed = _ns_owners(self._holder, {"trees": [(str(p), who.uid, who.gid) for p in paths]})
        if failed:
            raise SandboxError(f"sandbox {self.id}: {failed} entries of "
                               f"{[str(p) for p in paths]} could not be given to image user "
                               f"{who.name} ({who.uid}:{who.gid}) in its user namespace")

    def take_back(self, paths: Sequence[Path | str]) -> None:
        if self._ids is not None and paths:
            # A path that is gone (the job removed it) is not kept from the others.
            _ns_owners(self._holder, {"trees": [(str(p), 0, 0) for p in paths]})

    def _user_env(self, user: images.ImageUser | None) -> dict[str, str]:
        """``HOME`` and ``USER`` of a launch as ``user`` when it is not the default one
        (the sandbox defaults for root; the passwd entry's for another user), except what the
        image's Env or the sandbox's creator set."""
        if user is None or user == self.image_user:
            return {}
        defaults = default_env(self.python)
        env = {"USER": defaults["USER"], "HOME": defaults["HOME"]}
        if not user.is_root:
            env["USER"] = user.name
            if user.home and user.home != "/":
                env["HOME"] = user.home
        return {k: v for k, v in env.items() if k not in self._pinned}

    def _image_root(self, image: ImageLease, path: Path, mounted: bool,
                    interpreters: tuple[str, ...], *, setpriv: bool = False) -> list[str]:
        """bwrap arguments of a root made of the image: the overlay (mounted on the host by
        :meth:`_create_sync` when the server may mount; bwrap's own ``--overlay`` otherwise),
        ``/proc``, ``/dev`` and the helpers of ``/.rollout``; the image's config as the
        environment and the working directory."""
        rootfs = image.image.rootfs
        # Either way the overlay is mounted at ``root`` before bwrap starts: on the host once
        # (root server), or by each launch in a user namespace of its own (_userns_overlay).
        args = ["--bind", str(path / "root"), "/"]
        # bwrap itself too on a root server: any launch may run as a user other than root.
        args += ["--proc", "/proc", "--dev", "/dev",
                 *inject.helper_binds(mounted or setpriv, nested=mounted)]
        py_args, ok = inject.python_binds(interpreters, rootfs)
        if ok:
            args += py_args
            self.python_launcher = tuple(inject.loader_argv())
        elif (moved := inject.relocated_python(self.python, str(self.config.state_dir))):
            # Below a system tree, or where the image has the path: at /.rollout/python.
            args += [*py_args, *moved.binds]
            self.python_launcher = tuple(inject.loader_argv(moved.library_path))
            self.python_inside = moved.python
        if image.image.config.working_dir:
            self.default_cwd = image.image.config.working_dir
        return args

    # -- creation ----------------------------------------------------------------------------
    @classmethod
    async def create(cls, config: SandboxConfig, *, workspace_files: Mapping[str, bytes | str],
                     env: Mapping[str, str], network: Network, limits: SandboxLimits,
                     rootfs: Path | str | None = None,
                     binds: Sequence[tuple[str, str, bool]] = (),
                     image: Any = None, user: str | images.UserRequest | None = None,
                     **unknown: Any) -> BwrapSandbox:
        """``binds``: per-sandbox (host dir, sandbox path, writable) mounts, e.g. a task's
        prepared environment, read-only, shared by every job of its repository. ``image``:
        an image source (a reference such as ``docker://python:3.11-slim``, or a
        :class:`~rollout.runtime.sandbox.images.BuildSpec`) whose root this sandbox runs on,
        fetched or built first when the cache lacks it (``SandboxConfig.image`` when it is a
        reference and no ``image`` is given); see :mod:`rollout.runtime.sandbox.images`.
        ``user``: the user of the image every process runs as instead of its config's
        ``User`` (a :class:`~rollout.runtime.sandbox.images.UserRequest` names who asked)."""
        if unknown:
            raise SandboxError(f"unknown sandbox options: {sorted(unknown)}",
                               "INVALID_SANDBOX_OPTIONS")
        for tool in ("bwrap", "dash") + (("setpriv",) if _is_root() else (
                "unshare", "nsenter") if image is not None else ()):
            if _missing(tool):
                raise SandboxUnavailable(
                    f"the bwrap sandbox runtime needs `{tool}` on PATH: install it with "
                    "`apt-get install bubblewrap dash util-linux` (or your distribution's "
                    "packages)")
        rootfs = Path(rootfs) if rootfs else config.rootfs
        if image is None and config.image and images.is_image_ref(config.image):
            image = config.image
        if image is not None and rootfs is not None:
            raise SandboxError("a sandbox takes either an image or a rootfs, not both",
                               "INVALID_SANDBOX_OPTIONS")
        if rootfs is not None and not await asyncio.to_thread(Path(rootfs).is_dir):
            raise SandboxError(f"rootfs {rootfs} is not a directory", "INVALID_SANDBOX_OPTIONS")
        checked = check_binds(binds, config.workspace_in_sandbox, CTL_IN_SANDBOX)
        if user is not None and image is None:
            raise SandboxError("a sandbox's user option needs an image (it names a user of "
                               "the image)", "INVALID_SANDBOX_OPTIONS")
        request = images.UserRequest(user) if isinstance(user, str) else user
        lease = None
        if image is not None:
            if isinstance(image, str):
                image = images.parse_image_ref(image)
            # In a worker thread: a first use fetches or builds (minutes); a cancelled INIT
            # leaves the fetch to finish into the cache, where the next job finds it.
            lease = await asyncio.to_thread(images.lease_image, image, config.images)
        try:
            return await finish_creation(functools.partial(
                cls._create_sync, config, dict(workspace_files), dict(env), network, limits,
                rootfs, checked, lease, request))
        except BaseException:
            if lease is not None:
                lease.release()
            raise

    @classmethod
    def _create_sync(cls, config: SandboxConfig, files: dict[str, bytes | str],
                     env: dict[str, str], network: Network, limits: SandboxLimits,
                     rootfs: Path | None,
                     binds: tuple[tuple[str, str, bool], ...] = (),
                     image: ImageLease | None = None,
                     request: images.UserRequest | None = None) -> BwrapSandbox:
        root = config.sandboxes_dir
        root.mkdir(parents=True, exist_ok=True, mode=0o711)
        sid = uuid.uuid4().hex[:12]
        path = root / sid
        path.mkdir(mode=0o711)
        lease: procs.UidLease | None = None
        lock_fd = -1
        holder: subprocess.Popen[bytes] | None = None
        ids: subids.SubIds | None = None
        layer_group: str | None = None
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
            for sub in ("workspace", "tmp", "tmp/home", "ctl", SHM_DIR):
                (path / sub).mkdir(mode=0o755)
                if owner:
                    os.chown(path / sub, *owner)
            os.chmod(path / "tmp", 0o1777)
            os.chmod(path / SHM_DIR, 0o1777)
            for rel, data in files.items():
                hostfs.write_beneath(path / "workspace", rel,
                                     data.encode() if isinstance(data, str) else data,
                                     0o644, owner)
            sb_env = default_env(config.python or sys.executable)
            user = ROOT_USER
            pinned: set[str] = set(env)
            if image is not None:
                pinned |= set(image.image.config.env_dict)
                user = (images.resolve_user(image.image.rootfs, request.spec,
                                            image=image.image.ref, named_by=request.named_by)
                        if request is not None else
                        images.resolve_user(image.image.rootfs, image.image.config.user,
                                            image=image.image.ref))
                sb_env = _image_env(sb_env, image.image.config, env, user)
                # (a rootless server's upper layer may be a tmpfs of its holder's:
                # ``_rootless_root`` makes ``upper`` and ``work`` for one on the disk)
                for sub in ("upper", "work", "root") if lease is not None else ("root",):
                    (path / sub).mkdir(mode=0o755)
                if lease is not None:  # one overlay for all launches of the sandbox
                    owned = (() if user.is_root else
                             owners.owned_by(str(image.image.rootfs), user))
                    hardening.mount_overlay(image.image.rootfs, path / "upper", path / "work",
                                            path / "root", metacopy=bool(owned))
                    if not user.is_root:
                        _give_dirs(path / "root", (user.home, image.image.config.working_dir),
                                   lease.uid)
                        _give_owned(path / "root", owned, lease.uid)
                else:
                    ids = _mapping_for(user, image)
                    layer_cap, layer_group = _layer_cap(config)
                    holder = _rootless_root(config.images.rootless_root, image, path, sid, ids,
                                            max(0, config.disk_bytes), layer_cap)
                    if ids is not None:
                        _map_owners(holder, image, path, user, ids)
            sb_env.update(env)
            sb = cls(config, sid, path, lock_fd, lease, sb_env, network, limits, rootfs, binds,
                     image, user, holder, frozenset(pinned), ids)
            register_live(sb)
        except BaseException:
            removed = False
            if holder is not None:
                if ids is not None and holder.poll() is None:
                    removed = _ns_remove(holder, path)
                _LAYERS.release(holder.pid)  # before the pid can be reaped and reused
                procs.stop_process(holder)
                _close_pipes(holder)
            if ids is not None and not removed:
                remove_mapped(path, ids)
            if lease:
                lease.release()
            if lock_fd >= 0:
                os.close(lock_fd)
            hostfs.rmtree(path)
            raise
        finally:
            if layer_group is not None:  # the sandbox holds its own reference once made
                hardening.release_memory_cgroup(layer_group)
        return sb

    # -- processes ---------------------------------------------------------------------------
    def command_argv(self, argv: Sequence[str], *, cwd: str | None = None,
                     env: Mapping[str, str] | None = None, tty: bool = False,
                     file_binds: Sequence[tuple[str, str]] = (),
                     user: images.ImageUser | None = None) -> list[str]:
        """``file_binds``: (host file, sandbox path) pairs bound read-only into this launch
        only, e.g. a job's gateway socket, which exists only while RUN serves it (a socket
        stays connectable through a read-only bind). ``user``: who the launch runs as (from
        :meth:`user_for`; default: the sandbox's user)."""
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
        cwd = cwd or self.default_cwd
        if user is not None and self.image is None:
            raise SandboxError("only a sandbox on an image runs commands as a user of its "
                               "image", "INVALID_SANDBOX_OPTIONS")
        prefix, drop, inner = self._chain(user or self.image_user)
        nested = [*inner, "--chdir", cwd, "--"] if inner else []
        return [*prefix, *extra, *self._seal, "--setenv", LAUNCH_VAR, tag,
                "--chdir", cwd, *drop, *nested, *argv]

    def park(self) -> None:
        """Start the launch of this sandbox's next command before anyone asks for it: the
        whole chain runs now and waits in the parked waiter, which :meth:`exec` hands the
        command to. Blocking: run it in the spawner thread (``procs.in_spawner``), whose
        thread outlives the launch as ``--die-with-parent`` needs. Used by the sandbox pool;
        :meth:`wait_parked` says when the waiter is up."""
        if self._parked is not None:
            return
        ready_r, ready_w = os.pipe()
        try:
            argv = self.command_argv([self.python, "-I", "-S", "-c", _parked_script(),
                                      str(ready_w)])
            proc = procs.spawn_parked(argv, self.spawn_env(), pass_fds=(ready_w,))
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            os.close(ready_w)
        self.track(proc.pid)
        self._parked, self._parked_needle = proc, self._needle(argv)
        self._parked_ready = ready_r

    async def wait_parked(self, timeout: float) -> bool:  # noqa: ASYNC109
        """Wait (at most ``timeout``) until the parked waiter reads its command; False when
        it died first or the time ran out (then :meth:`exec` launches afresh or waits)."""
        fd, self._parked_ready = self._parked_ready, -1
        if fd < 0:
            return self._parked is not None
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        loop.add_reader(fd, readable.set)
        try:
            async with asyncio.timeout(timeout):
                await readable.wait()
            return os.read(fd, 1) == b"R"
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(fd)
            os.close(fd)

    def prepare(self, files: Mapping[str, bytes | str], env: Mapping[str, str]) -> None:
        """Give a pooled sandbox its job's workspace files and environment (what
        :meth:`create` would have written; blocking when there are files)."""
        for rel, data in files.items():
            self._write_file(rel, data.encode() if isinstance(data, str) else data, 0o644)
        self.env.update(env)

    @property
    def _mapped_workspace(self) -> bool:
        """The workspace belongs to an image user of the mapped namespace: the server writes
        and removes its files from inside (:data:`NS_FILES`)."""
        return self._ids is not None and not self.image_user.is_root

    def _write_file(self, rel: str, data: bytes, mode: int) -> None:
        if not self._mapped_workspace:
            hostfs.write_beneath(self.workspace, rel, data, mode, self._owner())
            return
        user = self.image_user
        self._ns_file({"op": "write", "root": str(self.workspace), "rel": rel,
                       "data": base64.b64encode(data).decode(), "mode": mode,
                       "owner": [user.uid, user.gid]})

    def _ns_file(self, job: Mapping[str, Any]) -> None:
        if self._holder is None:
            raise SandboxError(f"sandbox {self.id} has no namespace holder",
                               "SANDBOX_DESTROYED")
        done = subprocess.run(
            ["nsenter", "-t", str(self._holder.pid), "--user", "--mount",
             "--preserve-credentials", "--", sys.executable, "-I", "-S", "-c",
             _ns_files_script()], input=json.dumps(job).encode(), capture_output=True,
            timeout=COPY_TIMEOUT_S)
        answer = json.loads(done.stdout or b"null") if done.returncode == 0 else None
        if not isinstance(answer, dict):
            raise SandboxError(f"sandbox {self.id}: a workspace file operation failed: "
                               f"{done.stderr.decode(errors='replace')[-500:]}")
        if "error" in answer:
            kind, _, message = answer["error"]
            cls = _FILE_ERRORS.get(kind, OSError)
            raise cls(message)

    async def copy_workspace_from(self, other: Sandbox, *,
                                  skip: frozenset[str] = frozenset()) -> int:
        """A mapped image user's workspace (this one, or ``other``'s, whose files that user
        may have made 0600) is the server's for the copy on the host, and its user's again
        after it."""
        mapped = [sb for sb in (self, other)
                  if isinstance(sb, BwrapSandbox) and sb._mapped_workspace]
        if not mapped:
            return await super().copy_workspace_from(other, skip=skip)

        def copy() -> int:
            for sb in mapped:
                sb._give_workspace(ROOT_USER)
            try:
                return hostfs.copy_tree(other.workspace, self.workspace, owner=self._owner(),
                                        skip=skip)
            finally:
                for sb in mapped:
                    sb._give_workspace(sb.image_user)

        return await asyncio.to_thread(copy)

    async def put_file(self, rel_path: str, data: bytes | str, mode: int = 0o644) -> None:
        raw = data.encode() if isinstance(data, str) else data
        await asyncio.to_thread(self._write_file, self._rel(rel_path), raw, mode)

    async def remove_file(self, rel_path: str) -> None:
        if not self._mapped_workspace:
            await super().remove_file(rel_path)
            return
        await asyncio.to_thread(self._ns_file, {"op": "unlink", "root": str(self.workspace),
                                                "rel": self._rel(rel_path)})

    @property
    def parked_pid(self) -> int | None:
        """The pid of the parked launch waiting for this sandbox's next command, if any."""
        return self._parked.pid if self._parked is not None else None

    def _take_parked(self) -> subprocess.Popen[bytes] | None:
        proc, self._parked = self._parked, None
        if proc is not None and proc.poll() is not None:  # it died: launch afresh
            self.untrack(proc.pid)
            _close_pipes(proc)
            return None
        return proc

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
                   file_binds: Sequence[tuple[str, str]] = (),
                   user: images.ImageUser | None = None) -> ExecResult:
        """``user``: run as this user of the image (:meth:`user_for`) instead of the
        sandbox's own, with its ``HOME`` and ``USER``."""
        command = ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        env = {**self._user_env(user), **(env or {})}
        other = user is not None and user != self.image_user
        parked = None if file_binds or other else self._take_parked()
        if parked is not None:
            self._check_alive()
            return await procs.run_collect(
                command, env={},
                timeout=timeout if timeout is not None else self.limits.default_timeout_s,
                stdin=stdin, max_output=max_output, on_exit=self.untrack,
                orphan_needle=self._parked_needle, parked=parked,
                request=procs.parked_request(command, self.spawn_env(env), cwd or ""))
        argv = self.command_argv(command, cwd=cwd, file_binds=file_binds, user=user)
        shares = (user if other and self._ids is not None and user is not None
                  and not user.is_root else None)
        if shares is not None:
            # Every user of a root server's sandbox shares its uid, so a command as another
            # user (a task's tests run as their own user) writes the workspace; here the
            # image's uids are distinct, so the workspace is that user's while it runs.
            await asyncio.to_thread(self._give_workspace, shares)
        try:
            return await procs.run_collect(
                argv, env=self.spawn_env(env),
                timeout=timeout if timeout is not None else self.limits.default_timeout_s,
                stdin=stdin, max_output=max_output, on_spawn=self.track, on_exit=self.untrack,
                orphan_needle=self._needle(argv))
        finally:
            if shares is not None and not self.destroyed:
                await asyncio.shield(asyncio.to_thread(self._give_workspace, self.image_user))

    def _give_workspace(self, user: images.ImageUser) -> None:
        """The workspace, with all it holds, to ``user`` in the mapped namespace."""
        failed = _ns_owners(self._holder, {"trees": [(str(self.workspace), user.uid,
                                                       user.gid)]})
        if failed:
            log.warning("sandbox %s: %d workspace entries kept their owner when given to %s",
                        self.id, failed, user.name)

    # -- lifetime ----------------------------------------------------------------------------
    def _kill_runtime_processes(self) -> None:
        # Every launch of this sandbox carries its tag; killing a launch's bwrap ends its PID
        # namespace, and with it whatever the launch left running in the background.
        procs.spawner_barrier()
        if self._parked_ready >= 0:
            with contextlib.suppress(OSError):
                os.close(self._parked_ready)
            self._parked_ready = -1
        parked, self._parked = self._parked, None
        if parked is not None:
            procs.stop_process(parked)
            _close_pipes(parked)
        # The holder of a rootless image sandbox carries the tag too (the reaper finds it by
        # it) but lives until teardown: the launches after ``stop_processes`` (a verifier, a
        # grader) enter its namespaces and its overlay.
        holder = self._holder
        procs.sweep(b"\0" + LAUNCH_VAR.encode() + b"\0" + self.id.encode() + b".",
                    spare=frozenset((holder.pid,)) if holder is not None else frozenset())
        if self._lease is not None:
            if procs.uid_has_processes(self._lease.uid):
                procs.kill_uid(self._lease.uid)

    def _teardown_runtime(self) -> None:
        # Each step on its own: one that raises must not keep the others (the quota mount
        # above all) from being released. Idempotent, since exit may run it a second time.
        group, self._memory_group = self._memory_group, None
        ids, self._ids = self._ids, None
        handed, self._handed = sorted(self._handed), set()
        removed = False
        if ids is not None and self._holder is not None and self._holder.poll() is None:
            # In the holder's namespace, which still maps the image's uids (every launch that
            # entered it is killed above): give back what was handed over, then detach the
            # overlay and remove what the image's users own there (a fresh namespace, the
            # reaper's way, costs three more processes and the maps).
            if handed:
                try:
                    _ns_owners(self._holder, {"trees": [(p, 0, 0) for p in handed]})
                except Exception as e:  # teardown goes on
                    log.warning("sandbox %s: could not give back %s: %s", self.id, handed, e)
            removed = _ns_remove(self._holder, self.path)
        holder, self._holder = self._holder, None
        if holder is not None:  # after every launch that entered its namespaces (killed above)
            _LAYERS.release(holder.pid)  # before the pid can be reaped and reused
            procs.stop_process(holder)
            _close_pipes(holder)
        try:
            if ids is not None and not removed:  # the image's users' files: only inside
                remove_mapped(self.path, ids)
            self._release_host_side(self.path, group)
        finally:
            if self.image is not None:  # after the overlay is gone: eviction may remove it
                self.image.release()
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


HOLDER_READY_S = 60.0
MOUNT_REFUSED = 125
"""The holder's exit status when the kernel refused the mount (not a failure to start)."""
LAYER_REFUSED = 124
"""The holder's exit status when the tmpfs upper layer, or an overlay on it, was refused."""


def _userns_overlay(rootfs: Path, path: Path, sid: str, ids: subids.SubIds | None = None,
                    *, mount: bool = True, layer_bytes: int = 0) -> subprocess.Popen[bytes]:
    """The overlay of a rootless image sandbox, held by one process for the sandbox's life:
    a user and mount namespace (util-linux ``unshare``; the server's user is root there) in
    which the kernel mounts the overlay (unprivileged overlay mounts: Linux 5.11+) once;
    every launch enters it (``nsenter``) before bwrap, so all launches share one mount and see
    each other's writes at once (separate mounts of one upper layer do not). bubblewrap 0.8
    (Debian 12) has no ``--overlay`` of its own. The holder waits on a pipe only the server
    holds: it ends when the sandbox closes it or the server dies.

    With ``ids`` the namespace maps the server's subordinate ranges too (``newuidmap`` and
    ``newgidmap`` write its maps once the holder says it is in it: util-linux 2.38's
    ``unshare --map-users`` cannot add them to the root mapping). Holders are made and mapped
    ahead of need (:data:`_HOLDERS`): a sandbox's creation only asks one for its mounts.
    ``mount=False``: no overlay (the private copy of :func:`_rootless_root`), a namespace of
    its own made now, tagged with the sandbox's launch tag.

    ``layer_bytes`` > 0: the upper layer (``data``, its work directory ``work``) lives on a
    tmpfs of that size that the holder mounted on :data:`LAYER_DIR` in its own namespace when
    it was made, as a root server's sandbox directory is a tmpfs: the job's writes to its root
    get the disk quota a rootless server cannot otherwise give, and the whole layer goes with
    the holder (removing the upper layer's entries from the disk cost ~4 ms each at load 9).
    The host sees only an empty folder. Refused: exit :data:`LAYER_REFUSED`."""
    if not mount:
        return _namespace_holder(path, sid, ids)
    layer = path.parent.parent / LAYER_DIR if layer_bytes > 0 else None
    upper, work = ((layer / "data", layer / "work") if layer is not None
                   else (path / "upper", path / "work"))
    dirs = [str(rootfs), str(upper), str(work), str(path / "root")]
    if any("," in d or ":" in d or "\n" in d for d in dirs):
        raise SandboxError(f"a rootless image sandbox needs paths without ',', ':' and line "
                           f"breaks (the overlay's option syntax): {dirs}",
                           "INVALID_SANDBOX_OPTIONS")
    if layer is not None:
        layer.mkdir(mode=0o700, exist_ok=True)
    proc = _HOLDERS.take(_HolderKind(ids, str(layer), layer_bytes) if layer is not None
                         else _HolderKind(ids, "", 0))
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdin.write("".join(f"{line}\n" for line in dirs).encode())
        proc.stdin.flush()
    except OSError:
        pass  # it died: said below
    ready, _, _ = select.select([proc.stdout], [], [], HOLDER_READY_S)
    line = proc.stdout.readline() if ready else b""
    if line.strip() != b"ready":
        _holder_failed(proc)
    return proc


OVERLAY_FAILED = ("mount the image's overlay in a user namespace (needs Linux 5.11+ with "
                  "unprivileged user namespaces)")


def _holder_failed(proc: subprocess.Popen[bytes], what: str = OVERLAY_FAILED) -> NoReturn:
    """Stop a holder that did not say it was ready and raise what its exit status means (a
    refused mount, or else that it could not ``what``)."""
    procs.stop_process(proc)
    assert proc.stderr is not None
    err = proc.stderr.read().decode(errors="replace").strip()[-500:]
    code = proc.returncode
    _close_pipes(proc)
    kind = {MOUNT_REFUSED: _OverlayRefused, LAYER_REFUSED: _LayerRefused}.get(
        code, SandboxUnavailable) if code is not None else SandboxUnavailable
    raise kind(f"a rootless server could not {what}: {err or 'no answer'}")


LAYER_DIR = "image-layer"
"""The state directory's folder on which each rootless holder mounts its own tmpfs upper layer,
in its own mount namespace (on the host it stays an empty folder). Not in ``sandboxes/``,
whose entries the start-up sweep removes: removing a folder that is a mount point in other
namespaces detaches those mounts."""


@dataclasses.dataclass(frozen=True)
class _HolderKind:
    """What a holder is made for: its mapping, and its tmpfs upper layer (mount point and
    size; ``""`` and 0: the upper layer on the disk, in the sandbox's folder)."""

    ids: subids.SubIds | None
    layer: str
    layer_bytes: int


_HOLDER_SCRIPT = (
    'if [ "$2" != 0 ]; then mount -t tmpfs -o "size=$2,nr_inodes=$3,mode=0755" tmpfs "$1" && '
    f'mkdir "$1/data" "$1/work" || exit {LAYER_REFUSED}; fi; '
    "echo mapped; "
    "read -r lower && read -r upper && read -r work && read -r root || exit 0; "
    'mount -t overlay overlay -o "lowerdir=$lower,upperdir=$upper,workdir=$work" "$root" '
    f'|| {{ [ "$2" != 0 ] && exit {LAYER_REFUSED}; exit {MOUNT_REFUSED}; }}; '
    "echo ready; read -r _")
"""A holder: mapped, and with its tmpfs upper layer (``$1``, ``$2`` bytes and ``$3`` inodes;
0 bytes: none) mounted,
it waits for its overlay's lower, upper, work and target directories on stdin, one per line;
an end of input (its server gone before a sandbox took it) ends it."""
HOLDER_NAME = "rollout-image-holder"
"""``$0`` of every holder's shell, so ``ps`` says what it is."""


def _spawn_holder(kind: _HolderKind) -> subprocess.Popen[bytes]:
    """A holder in a new user and mount namespace, mapped, its tmpfs layer mounted, waiting
    for its overlay's directories."""
    return _start_holder(kind.ids, _HOLDER_SCRIPT, b"mapped",
                         (HOLDER_NAME, kind.layer or "-", str(kind.layer_bytes),
                          str(hardening.tmpfs_inodes(kind.layer_bytes))))


def _start_holder(ids: subids.SubIds | None, script: str, says: bytes, args: Sequence[str],
                  what: str = OVERLAY_FAILED) -> subprocess.Popen[bytes]:
    """``script`` (``args`` its ``$0``, ``$1``...) in a new user and mount namespace, mapped
    to ``ids`` (or to the server's user alone), once it has said ``says`` (else: could not
    ``what``)."""
    proc = subprocess.Popen(
        ["unshare", "--user", *(["--map-root-user"] if ids is None else []), "--mount", "--",
         "sh", "-c", ("echo mapme; read -r _; " if ids is not None else "") + script, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True)
    assert proc.stdout is not None and proc.stderr is not None
    if ids is not None:
        _map_ids(proc, ids)
    ready, _, _ = select.select([proc.stdout], [], [], HOLDER_READY_S)
    line = proc.stdout.readline() if ready else b""
    if line.strip() != says:
        _holder_failed(proc, what)
    return proc


class _HolderPool:
    """Holders made before a sandbox asks, mapped and with their tmpfs layer mounted
    (``unshare``, ``newuidmap``, ``newgidmap``, ``mount``, ``mkdir``: most of a rootless
    image sandbox's creation, ~17 ms at load 9); a creation only has the overlay mounted.

    - **Each holder serves one sandbox**: :meth:`take` hands it out once; it ends with that
      sandbox (its teardown stops it), never back in the pool.
    - **Bounded**: at most :attr:`size` ready holders per kind (mapping, layer) and
      :attr:`kinds` kinds (the least recently taken one's holders end for a new one), made by
      one background thread per kind after a take (a short delay first, so the refill does
      not compete with the first command of the job that took one); none until the first
      take.
    - **Nothing left behind**: a ready holder waits on a pipe only this process holds, so it
      ends when the process ends, however it ends; :meth:`close` (at exit) ends them at once.
      A process forked from this one never uses its parent's holders."""

    size = 2
    kinds = 4
    refill_delay_s = 0.05

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: dict[_HolderKind, collections.deque[subprocess.Popen[bytes]]] = {}
        self._filling: set[_HolderKind] = set()
        self._closed = False

    def after_fork(self) -> None:
        """In a forked child: its parent's holders (and a lock a parent thread may have held
        at the fork) are not its own."""
        self._lock = threading.Lock()
        self._ready, self._filling = {}, set()

    def take(self, kind: _HolderKind) -> subprocess.Popen[bytes]:
        """A ready holder of this kind (or one made now), and a refill started."""
        proc = None
        with self._lock:
            ready = self._ready.pop(kind, None) or collections.deque()
            self._ready[kind] = ready  # the most recently taken kind last
            stale = list(self._ready)[:-self.kinds]
            ended = [p for k in stale for p in self._ready.pop(k)]
            while ready and proc is None:
                candidate = ready.popleft()
                if candidate.poll() is None:
                    proc = candidate
                else:
                    _close_pipes(candidate)
            refill = not self._closed and kind not in self._filling
            if refill:
                self._filling.add(kind)
        for other in ended:
            procs.stop_process(other)
            _close_pipes(other)
        if refill:
            threading.Thread(target=self._fill, args=(kind,), daemon=True,
                             name="image-holder-pool").start()
        return proc if proc is not None else _spawn_holder(kind)

    def ready(self) -> list[int]:
        """The pids of every ready holder (what :meth:`take` hands out next, by kind)."""
        with self._lock:
            return [p.pid for ready in self._ready.values() for p in ready]

    def _fill(self, kind: _HolderKind) -> None:
        time.sleep(self.refill_delay_s)
        try:
            while True:
                with self._lock:
                    if (self._closed or kind not in self._ready
                            or len(self._ready[kind]) >= self.size):
                        return
                try:
                    proc = _spawn_holder(kind)
                except Exception as e:  # a creation then makes its own, and says why
                    log.warning("image sandboxes: could not make a holder ahead: %s", e)
                    return
                with self._lock:
                    if not self._closed and kind in self._ready:  # (not evicted meanwhile)
                        self._ready[kind].append(proc)
                        continue
                procs.stop_process(proc)
                _close_pipes(proc)
                return
        finally:
            with self._lock:
                self._filling.discard(kind)

    def close(self) -> None:
        """End every ready holder; no more are made."""
        with self._lock:
            self._closed = True
            held = [p for ready in self._ready.values() for p in ready]
            self._ready = {}
        for proc in held:
            procs.stop_process(proc)
            _close_pipes(proc)


_HOLDERS = _HolderPool()
atexit.register(_HOLDERS.close)
os.register_at_fork(after_in_child=_HOLDERS.after_fork)


def _namespace_holder(path: Path, sid: str, ids: subids.SubIds | None) -> subprocess.Popen[bytes]:
    """A user and mount namespace alone (a copied root's, or the crash sweep's), made now and
    tagged with the sandbox's launch tag, so teardown's sweep and the reaper's find it."""
    return _start_holder(ids, "echo ready; read -r _", b"ready",
                         ("sh", str(path), LAUNCH_VAR, f"{sid}.0"),
                         "make a user namespace for an image sandbox")


def _map_ids(proc: subprocess.Popen[bytes], ids: subids.SubIds) -> None:
    """Give the holder's new user namespace the server's user as 0 and the subordinate
    ranges as 1..count, then let it go on."""
    assert proc.stdout is not None and proc.stdin is not None and proc.stderr is not None
    ready, _, _ = select.select([proc.stdout], [], [], HOLDER_READY_S)
    line = proc.stdout.readline() if ready else b""
    errors = []
    if line.strip() == b"mapme":
        errors += subids.write_maps(proc.pid, ids, HOLDER_READY_S)
    else:
        errors.append("the holder did not start")
    if errors:
        procs.stop_process(proc)
        if line.strip() != b"mapme":
            errors[-1] += ": " + (proc.stderr.read().decode(errors="replace").strip()[-300:]
                                  or "no answer")
        _close_pipes(proc)
        raise SandboxUnavailable("a rootless server could not map its subordinate uids and "
                                 "gids into an image sandbox's user namespace: "
                                 + "; ".join(errors))
    proc.stdin.write(b"go\n")
    proc.stdin.flush()


def _mapping_for(user: images.ImageUser, image: ImageLease) -> subids.SubIds | None:
    """The subordinate id mapping a rootless image sandbox of ``user`` gets; None (the
    single-uid mapping, said once) without a range or the helpers. A user beyond the range
    is refused (the image's fault, naming the fix): mapped onto the server's user instead,
    it could write every file of the image, and its own files would not be its own."""
    ids = subids.server_subids()
    if ids is not None and not ids.covers(user.uid, user.gid):
        raise _beyond(ids, image, f"its user {user.name}", user)
    return ids


def _beyond(ids: subids.SubIds, image: ImageLease, what: str,
            user: images.ImageUser | None = None, uid: int = 0,
            gid: int = 0) -> images.ImageError:
    """``IMAGE_REJECTED`` for an id of the image that this server's range does not reach."""
    if user is not None:
        uid, gid = user.uid, user.gid
    ref = image.image.ref
    return images.ImageError(f"image {ref}: " + ids.refusal(what, uid, gid), "IMAGE_REJECTED",
                             ref=ref)


def _ns_owners(holder: subprocess.Popen[bytes] | None, job: Mapping[str, Any]) -> int:
    """Run :data:`NS_OWNERS` in the holder's namespaces with ``job``; how many paths it could
    not change (a failure to run at all raises)."""
    if holder is None:
        raise SandboxError("a mapped image sandbox has no namespace holder",
                           "SANDBOX_START_FAILED")
    done = subprocess.run(
        ["nsenter", "-t", str(holder.pid), "--user", "--mount", "--preserve-credentials", "--",
         sys.executable, "-I", "-S", "-c", NS_OWNERS.read_text()],
        input=json.dumps(job).encode(), capture_output=True, timeout=COPY_TIMEOUT_S)
    if done.returncode != 0:
        raise SandboxError("could not set the image's owners inside the sandbox's user "
                           f"namespace: {done.stderr.decode(errors='replace')[-500:]}",
                           "SANDBOX_START_FAILED")
    return int(done.stdout.strip() or b"0")


def _home_dirs(rootfs: Path, merged: Path, dirs: Sequence[str],
               user: images.ImageUser) -> list[tuple[str, int, int]]:
    """The user's home and working directory to give it (as :func:`_give_dirs` does on a root
    server), as paths in the merged root; judged in the cached image, which is what the
    merged root shows before the first launch."""
    out = []
    for d in dirs:
        norm = os.path.normpath(d) if d else ""
        if (not norm.startswith("/") or norm in _SYSTEM_DIRS
                or inject.through_link(rootfs, norm)):
            continue
        rel = norm.lstrip("/")
        if (not os.path.lexists(rootfs / rel)
                and not os.path.isdir(rootfs / os.path.dirname(rel))):
            continue
        out.append((str(merged / rel), user.uid, user.gid))
    return out


def _map_owners(holder: subprocess.Popen[bytes] | None, image: ImageLease, path: Path,
                user: images.ImageUser, ids: subids.SubIds) -> None:
    """Before the first launch: every file the image's layers gave a user gets that owner in
    the job's layer (a copy-up: the kernel refuses ``metacopy`` in a user namespace), the
    user its home and working directory and the sandbox's own folders."""
    rootfs = image.image.rootfs
    merged = path / "root"
    recorded = owners.image_owners(str(rootfs))
    for rel, uid, gid in recorded:
        if not ids.covers(uid, gid):
            raise _beyond(ids, image, f"the owner of /{rel}", uid=uid, gid=gid)
    chown = [(str(merged / rel), uid, gid) for rel, uid, gid in recorded
             if not inject.through_link(rootfs, "/" + rel)]
    job: dict[str, Any] = {"chown": chown}
    if not user.is_root:
        job["dirs"] = _home_dirs(rootfs, merged, (user.home, image.image.config.working_dir),
                                 user)
        job["trees"] = [(str(path / sub), user.uid, user.gid)
                        for sub in ("workspace", "tmp/home")]
        # The control folder is shared: the server writes the kernel's connection file and
        # log there and connects to the sockets the kernel (the user) binds in it; its group
        # is the user's and nobody else on the host may enter it.
        chown.append((str(path / "ctl"), 0, user.gid))
    started = time.monotonic()
    # Nothing to change (the image's root as the user, every file root's): no process at all.
    failed = _ns_owners(holder, job) if any(job.values()) else 0
    if not user.is_root:
        os.chmod(path / "ctl", 0o770)
    if failed:
        log.warning("image %s: %d of its files kept the server's user as owner in sandbox %s "
                    "(chown refused inside the mapped namespace)", image.image.ref, failed,
                    path.name)
    log.debug("image %s: %d owners set in sandbox %s in %.2f s", image.image.ref, len(chown),
              path.name, time.monotonic() - started)


SHM_DIR = "shm"
"""The sandbox's folder that its launches see as ``/dev/shm`` (within its disk quota)."""
MAPPED_PARTS = ("root", "upper", "work", "workspace", "tmp", "ctl", SHM_DIR)
"""The folders of a sandbox's directory that its image's users may own files in."""


def _ns_remove(holder: subprocess.Popen[bytes], path: Path) -> bool:
    """Remove the :data:`MAPPED_PARTS` of the sandbox at ``path`` inside the holder's
    namespaces with one ``rm`` (no interpreter to start: this was most of a rootless
    teardown); whether they are gone. Where the holder's mount namespace has the overlay on
    ``root`` (its ``mountinfo`` says), ``root`` is left to the host's removal once the holder
    has ended and the mount with it: ``rm`` would walk the whole merged image."""
    root = str(path / "root")
    escaped = (root.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011")
               .replace("\n", "\\012"))
    try:
        with open(f"/proc/{holder.pid}/mountinfo", encoding="utf-8",
                  errors="surrogateescape") as f:
            mounted = any(line.split()[4:5] == [escaped] for line in f)
        parts = [sub for sub in MAPPED_PARTS if not (mounted and sub == "root")]
        subprocess.run(
            ["nsenter", "-t", str(holder.pid), "--user", "--mount", "--preserve-credentials",
             "--", "rm", "-rf", "--", *(str(path / sub) for sub in parts)],
            capture_output=True, timeout=COPY_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("sandbox %s: could not remove its mapped folders in its namespace: %s",
                    path.name, e)
        return False
    return not any(os.path.lexists(path / sub) for sub in parts)


def remove_mapped(path: Path, ids: subids.SubIds, parts: Sequence[str] = MAPPED_PARTS) -> None:
    """Remove what the image's users own in ``parts`` of ``path`` (a torn-down sandbox's
    folders by default; a job's temporary folder names all of its entries) from inside a
    namespace of the same mapping (the server, outside it, may not). A fresh one: the
    sandbox's holder is gone with its launches (teardown stops it; a crashed server's died
    with it) and its overlay with it. Teardown and the reaper's sweep use it."""
    holder = None
    try:
        holder = _userns_overlay(path, path, f"{path.name}-cleanup", ids, mount=False)
        _ns_owners(holder, {"remove": [str(path / sub) for sub in parts]})
    except (SandboxError, OSError, subprocess.SubprocessError) as e:
        log.warning("sandbox %s: could not remove its mapped folders: %s", path.name, e)
    finally:
        if holder is not None:
            procs.stop_process(holder)
            _close_pipes(holder)


class _OverlayRefused(SandboxUnavailable):
    """The kernel refused the rootless overlay mount itself (not a failure to start)."""


_OVERLAY_REFUSED: dict[tuple[int, int], str] = {}
"""(device of the image cache, device of the sandboxes) -> why the kernel refused a rootless
overlay there: found by the first sandbox that tried, so every later one copies at once."""
_OVERLAY_LOCK = threading.Lock()


class _LayerRefused(SandboxUnavailable):
    """The tmpfs upper layer, or the overlay on it, was refused (the disk's upper layer is
    tried next)."""


_LAYER_REFUSED: list[str] = []
"""Why a tmpfs upper layer was refused, once: every later sandbox of this process keeps its
upper layer on the disk at once."""


class _LayerBudget:
    """The sizes of the tmpfs upper layers that this process's live rootless image sandboxes
    hold, kept under a cap where no memory cgroup bounds them (:func:`_layer_cap`).

    A size is reserved before its tmpfs is asked for and released when its holder ends: a job
    may fill its whole layer, so what is bounded is what jobs could hold, not what they hold
    now (an empty tmpfs costs nothing: the holders made ahead are not counted). A sandbox that
    would pass the cap keeps its upper layer on the disk, as every rootless sandbox did before
    tmpfs layers (no quota there), with one warning until the sum is back under the cap."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}
        """holder pid -> the bytes of its layer."""
        self._pending = 0
        """Reserved for holders being asked for now."""
        self._over = False

    def reserve(self, size: int, cap: int) -> bool:
        """Reserve ``size`` bytes if the layers' sum stays within ``cap``; False (and one
        warning until a reservation succeeds again) if it would not."""
        with self._lock:
            held = sum(self._held.values()) + self._pending
            live = len(self._held)
            ok = held + size <= cap
            warn = not ok and not self._over
            self._over = not ok
            if ok:
                self._pending += size
        if warn:
            log.warning("image sandboxes: their tmpfs upper layers would hold more than %.1f "
                        "GiB of memory (%d live, %.1f GiB; no memory cgroup caps them, so "
                        "sandbox.memory_bytes, or half the machine's memory, bounds their "
                        "sizes' sum): this one and the next keep their upper layer on the "
                        "disk, without a quota, until some end", cap / 2**30, live,
                        held / 2**30)
        return ok

    def unreserve(self, size: int) -> None:
        with self._lock:
            self._pending -= size

    def hold(self, pid: int, size: int) -> None:
        """The holder ``pid`` has a layer of ``size`` bytes (until :meth:`release`)."""
        with self._lock:
            self._held[pid] = size

    def release(self, pid: int) -> None:
        """The holder ``pid`` ended (any holder: one without a counted layer is no-op)."""
        with self._lock:
            self._held.pop(pid, None)

    def held(self) -> int:
        with self._lock:
            return sum(self._held.values()) + self._pending

    def after_fork(self) -> None:
        """In a forked child: none of its parent's sandboxes are its own."""
        self._lock = threading.Lock()
        self._held, self._pending, self._over = {}, 0, False


_LAYERS = _LayerBudget()
os.register_at_fork(after_in_child=_LAYERS.after_fork)


def _layer_cap(config: SandboxConfig) -> tuple[int, str | None]:
    """(what the tmpfs upper layers of a rootless server's live image sandboxes may add up to,
    0 for no bound of ours; the state dir whose memory cgroup reference the caller releases
    once the sandbox holds its own, or None).

    A tmpfs's pages are charged to the memory cgroup of the process that writes them, so
    where the sandboxes' shared memory cgroup exists, the layers count against its cap
    already. A rootless server often has no writable memory controller, and then nothing
    else would keep N sandboxes from holding N x ``disk_bytes`` of memory: the bound is then
    the cap that cgroup would have had. ``memory_bytes = -1`` (no cap asked for): none."""
    if config.memory_bytes < 0:
        return 0, None
    cap = config.memory_bytes or hardening.physical_memory_bytes() // 2
    state = os.path.abspath(config.state_dir)
    capped = hardening.acquire_memory_cgroup(state, cap) is not None
    return (0 if capped else cap), state


def _proc_mount_type(point: str) -> str | None:
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="surrogateescape") as f:
            types = [parts[2] for parts in (line.split() for line in f)
                     if len(parts) > 2 and parts[1] == point]
    except OSError:
        return None
    return types[-1] if types else None


@functools.lru_cache(maxsize=1)
def _tmpfs_takes_user_xattrs() -> bool:
    """Whether a tmpfs can be the upper layer of an overlay mounted in a user namespace: such
    an overlay marks opaque directories and redirects with ``user.*`` extended attributes of
    its upper layer, which tmpfs keeps only from Linux 6.6 (before, the overlay could not mark
    a directory of the image that a job deleted and made again). Probed on ``/dev/shm`` when
    it is a tmpfs, else read from the kernel's version."""
    if _proc_mount_type("/dev/shm") == "tmpfs":
        probe = f"/dev/shm/.rollout-xattr-{os.getpid()}-{threading.get_ident()}"
        try:
            fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                os.setxattr(fd, "user.rollout-probe", b"1")
                return True
            except OSError:
                return False
            finally:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(probe)
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 6)


def _rootless_root(mode: str, image: ImageLease, path: Path, sid: str,
                   ids: subids.SubIds | None = None, layer_bytes: int = 0,
                   layer_cap: int = 0) -> subprocess.Popen[bytes] | None:
    """Make a rootless image sandbox's writable root at ``path/root``: the overlay's holder
    (returned), or, where the kernel refuses a rootless overlay (before Linux 5.11, or an
    upper layer on a filesystem it rejects) or ``mode`` is ``copy``, a private copy of the
    cached root (None: no holder). ``auto`` tries the overlay until it is refused once on
    these filesystems, then copies; ``overlay`` never copies. ``layer_bytes`` > 0 (the
    sandbox's disk quota): the overlay's upper layer on a tmpfs of that size where the kernel
    allows it (:func:`_userns_overlay`) and, with ``layer_cap`` > 0, the live layers' sizes
    stay within it (:class:`_LayerBudget`), else on the disk."""
    rootfs = image.image.rootfs
    key = (os.stat(rootfs).st_dev, os.stat(path).st_dev)
    if mode != "copy" and not (mode == "auto" and key in _OVERLAY_REFUSED):
        try:
            if (layer_bytes > 0 and not _LAYER_REFUSED and _tmpfs_takes_user_xattrs()
                    and (layer_cap <= 0 or _LAYERS.reserve(layer_bytes, layer_cap))):
                try:
                    holder = _userns_overlay(rootfs, path, sid, ids, layer_bytes=layer_bytes)
                    if layer_cap > 0:
                        _LAYERS.hold(holder.pid, layer_bytes)
                    return holder
                except _LayerRefused as e:
                    with _OVERLAY_LOCK:
                        first = not _LAYER_REFUSED
                        _LAYER_REFUSED.append(str(e))
                    if first:
                        log.warning("image sandboxes: a tmpfs upper layer was refused (%s); "
                                    "their upper layers stay on the disk, without a quota",
                                    e)
                finally:
                    if layer_cap > 0:  # held now, or never
                        _LAYERS.unreserve(layer_bytes)
            for sub in ("upper", "work"):
                (path / sub).mkdir(mode=0o755, exist_ok=True)
            return _userns_overlay(rootfs, path, sid, ids)
        except _OverlayRefused as e:
            if mode == "overlay":
                raise
            with _OVERLAY_LOCK:
                first = key not in _OVERLAY_REFUSED
                _OVERLAY_REFUSED[key] = str(e)
            if first:
                log.warning("image sandboxes: the kernel refused a rootless overlay mount (%s); "
                            "each image sandbox gets a private copy of its image's root "
                            "instead (cp -a --reflink=auto: INIT copies the image, the job's "
                            "disk holds it; sandbox.image_rootless_root = \"copy\" skips "
                            "this try)", e)
    _copy_root(rootfs, path / "root", image.image.ref)
    # With subordinate ids, the copy still needs the mapped namespace its owners live in.
    return None if ids is None else _userns_overlay(rootfs, path, sid, ids, mount=False)


def _copy_root(rootfs: Path, dest: Path, ref: str) -> None:
    """Copy the cached root into the sandbox's own ``dest`` (reflinks where the filesystem
    has them; hard links inside the image stay hard links inside the copy, never to the
    cache, so a job's write cannot reach the cache)."""
    started = time.monotonic()
    try:
        proc = subprocess.run(["cp", "-a", "--reflink=auto", "--", f"{rootfs}/.", str(dest)],
                              capture_output=True, timeout=COPY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SandboxError(f"copying the root of image {ref} took over {COPY_TIMEOUT_S:g} s",
                           "SANDBOX_START_FAILED") from None
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()[-500:]
        if "No space left" in err:
            raise images.ImageError(f"image {ref}: the disk filled up while copying its root "
                                    f"into a sandbox: {err}", "IMAGE_DISK_FULL", ref=ref)
        raise SandboxError(f"could not copy the root of image {ref} into the sandbox: {err}",
                           "SANDBOX_START_FAILED")
    log.info("image %s: root copied into sandbox %s in %.1f s (no rootless overlay)", ref,
             dest.parent.name, time.monotonic() - started)


COPY_TIMEOUT_S = 1800.0


def _parents(rootfs: Path, insides: Sequence[str]) -> list[str]:
    """bwrap arguments creating (0755) the parents of these mount points the image lacks."""
    args: list[str] = []
    made: set[str] = set()
    for inside in insides:
        parent = os.path.dirname(os.path.normpath(inside))
        chain = []
        while parent not in ("/", ""):
            chain.append(parent)
            parent = os.path.dirname(parent)
        for d in reversed(chain):
            if d not in made and not os.path.lexists(os.path.join(rootfs, d.lstrip("/"))):
                args += ["--perms", "0755", "--dir", d]
                made.add(d)
    return args


def _new_home(rootfs: Path, home: str) -> bool:
    """Whether ``home`` is a directory the image lacks and bwrap may create: an absolute path
    below a top-level name, no part of it a link in the image."""
    if not home.startswith("/") or home.count("/") < 2 or ".." in home.split("/"):
        return False
    return hostfs.kind_beneath(rootfs, home.lstrip("/")) is None and not inject.through_link(
        rootfs, home)


def _give_dirs(merged: Path, dirs: Sequence[str], uid: int) -> None:
    """Give an image user on a root server its home and working directory (created when the
    image lacks the home): the rootless unpack left every image file root's, so without this
    the user could write nothing but /workspace and /tmp. Only those directories themselves
    change owner (in the job's upper layer: the cache is untouched), never what is in them,
    and never a path through a link or a system tree."""
    for d in dirs:
        norm = os.path.normpath(d) if d else ""
        if (not norm.startswith("/") or norm in _SYSTEM_DIRS
                or inject.through_link(merged, norm)):
            continue
        target = merged / norm.lstrip("/")
        if not os.path.lexists(target):
            if not target.parent.is_dir():
                continue
            os.mkdir(target, 0o755)
        if os.path.isdir(target) and not os.path.islink(target):
            os.lchown(target, uid, uid)


def _give_owned(merged: Path, owned: Sequence[tuple[str, bool, bool]], uid: int) -> None:
    """Hand an image user on a root server the files its image gave it (``COPY --chown``, what
    a ``RUN`` after ``USER`` made; :mod:`~rollout.runtime.sandbox.images.owners`): owner and
    group become the sandbox's uid, which is that user (and group) inside, in the job's upper
    layer (a metadata copy-up); the cache is untouched. Before the job runs, so no path holds
    a link the job planted; the last component is never followed."""
    for rel, is_owner, is_group in owned:
        if inject.through_link(merged, "/" + rel):
            continue
        with contextlib.suppress(OSError):
            os.chown(merged / rel, uid if is_owner else -1, uid if is_group else -1,
                     follow_symlinks=False)


_SYSTEM_DIRS = ("/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/var", "/opt", "/tmp",
                "/proc", "/dev", "/sys", "/root", "/home", "/srv", "/run", "/boot", "/mnt")


_FILE_ERRORS: dict[str, type[OSError]] = {
    "PermissionError": PermissionError, "FileNotFoundError": FileNotFoundError,
    "IsADirectoryError": IsADirectoryError, "NotADirectoryError": NotADirectoryError,
    "SpecialFileError": hostfs.SpecialFileError, "FileTooLarge": hostfs.FileTooLarge}
"""hostfs's exceptions by name, raised again on the server's side of :data:`NS_FILES`."""


@functools.lru_cache(maxsize=1)
def _ns_files_script() -> str:
    return Path(hostfs.__file__).read_text() + "\n" + NS_FILES.read_text()


@functools.lru_cache(maxsize=1)
def _parked_script() -> str:
    return PARKED_EXEC.read_text()


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
