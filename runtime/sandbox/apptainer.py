"""The Apptainer/Singularity runtime (``SandboxConfig(runtime="apptainer", image=...)``).

For clusters where an admin provides Apptainer and users bring SIF images. Each sandbox is one
instance (``instance start``, stopped at destroy); commands run with ``exec instance://<name>``.
The CLI (``apptainer``, else ``singularity``) is called directly, every call with a deadline,
not through spython, whose calls wait without one, and so that the instance and every launch
start under the sandbox's rlimits and memory cgroup. The sandbox's directory layout is the
bwrap runtime's (workspace, tmp, ctl), so tools work the same on both runtimes.

Bounds under Apptainer, compared with bwrap:

- **Isolation**: ``--containall`` (implies ``--contain``: a minimal /dev, no host /home, /tmp
  or working directory; ``--cleanenv``; ``--ipc`` and ``--pid`` namespaces),
  ``--writable-tmpfs`` (the image is read-only; writes outside the binds go to an in-memory
  overlay whose size the admin's ``sessiondir max size`` bounds, 64 MiB by default),
  ``--no-home``, no network (``--net --network none``) unless the job asks for loopback, and,
  when the server runs as root, ``--no-privs`` on the instance and every exec, which drops the
  capabilities root otherwise keeps inside a container. No seccomp filter of ours (bwrap's
  ``hardening.seccomp_program``): Apptainer applies its own only through an admin's profile.
- **rlimits**: the same ``prlimit`` line as bwrap (CPU time, address space, open files, file
  size, processes) wraps ``instance start`` and every ``exec``, so the instance's own
  processes and everything launched carry them. RLIMIT_NPROC does not bind a root server
  (Apptainer runs the container as the calling user, and root is exempt): ``--pids-limit``
  below is what caps processes there.
- **cgroups**: with ``SandboxConfig.memory_bytes >= 0`` and where Apptainer can apply cgroup
  limits (a root server, or cgroups v2 with systemd delegation), the instance gets
  ``--memory`` and ``--memory-swap`` of one process's address-space limit (so no swap) and
  ``--pids-limit`` of ``limits.processes``; and, as with bwrap, the instance start and every
  launch first join the state dir's shared memory cgroup (``hardening``), which caps all
  sandboxes together. ``memory_bytes = -1`` turns both off (Apptainer without cgroup support).
- **Disk**: as with bwrap, a root server mounts a ``disk_bytes`` tmpfs on the sandbox's
  directory, and ``/workspace``, ``/tmp`` and ``/.sandbox`` are binds of it: a job that writes
  without end gets ENOSPC there, not a full host disk. Rootless servers get no quota.

Per-job options: ``image=`` (a job's own image, e.g. a swe task's ``spec.image``: the image's
own ``PATH`` is kept, since it carries the environment) and ``binds=`` ((host dir, sandbox
path, writable) triples, given as ``--bind host:path:ro`` unless writable, the way the bwrap
runtime takes a task's prepared venv). :func:`ensure_image` pulls (``docker://``,
``oras://``) or builds (a ``.def`` recipe) an image once into a cache of SIF files, for
``rollout tasks prepare``.

Gaps compared with bwrap: no per-sandbox uid (RLIMIT_NPROC and the uid kill sweep do not
apply; ``--pids-limit`` stands in where cgroups allow); a timed-out ``exec`` is killed from the
host side, and anything it left inside the instance dies when the instance stops at destroy.

Honesty note: no apptainer or singularity binary exists on the machines this was written on,
so this module has only ever driven a recording stand-in of the CLI
(``tests/runtime/fake_singularity``, which also records the rlimits and cgroups it was started
under): the command lines and what the host applies before the CLI starts (rlimits, cgroup,
quota tmpfs) are checked; real isolation, Apptainer's own cgroup flags, image pulls and builds
are not.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rollout.runtime.sandbox import hardening, hostfs, images, procs
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
log = logging.getLogger(__name__)
REMOTE_SCHEMES = ("docker", "oras")
"""Image references Apptainer resolves from a registry (the rest are local paths)."""
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
INSTALL_HINT = ("the apptainer sandbox runtime needs `apptainer` (or SingularityCE's "
                "`singularity`) on PATH: install Apptainer "
                "(https://apptainer.org/docs/admin/main/installation.html) or SingularityCE, "
                "or use the default bwrap runtime")


def find_singularity() -> str:
    """The CLI to drive: ``apptainer``, else ``singularity`` (SingularityCE, or Apptainer's
    compatibility link); both take the same commands and flags used here."""
    exe = shutil.which("apptainer") or shutil.which("singularity")
    if exe is None:
        raise SandboxUnavailable(INSTALL_HINT)
    return exe


def uses_image_cache(image: Any, config: SandboxConfig) -> bool:
    """Whether an Apptainer sandbox takes ``image`` from the image cache
    (:mod:`rollout.runtime.sandbox.images`): a Dockerfile build, an ``oci:``,
    ``oci-archive:`` or ``docker-archive:`` reference, and ``docker://`` references when
    ``config.images.apptainer_pulls`` is ``cache``. Otherwise (SIF files, sandbox directories,
    ``oras://``, and ``docker://`` by default) Apptainer resolves the image itself, into SIF
    files (:func:`ensure_image`)."""
    if isinstance(image, images.BuildSpec):
        return True
    if isinstance(image, images.ImageRef):
        remote = image.is_remote
    elif isinstance(image, str) and images.is_image_ref(image):
        remote = image.startswith("docker://")
    else:
        return False
    return not remote or config.images.apptainer_pulls == "cache"


def cgroup_limits_possible() -> bool:
    """Whether Apptainer's cgroup flags (``--memory``, ``--pids-limit``) can work here: as
    root (cgroups v1 or v2), or on the unified cgroups v2 hierarchy, where Apptainer reaches a
    rootless user's limits through systemd delegation. Elsewhere the CLI refuses the flags."""
    return os.geteuid() == 0 or os.path.exists("/sys/fs/cgroup/cgroup.controllers")


def instance_options(sb_path: Path, workspace_in_sandbox: str, network: Network,
                     extra_ro_binds: Sequence[tuple[str, str]],
                     binds: Sequence[tuple[str, str, bool]] = (), *,
                     limits: SandboxLimits | None = None, cgroup_limits: bool = False,
                     as_root: bool = False, minimal_view: bool = True) -> list[str]:
    """``instance start`` options. ``--containall`` implies ``--contain`` (a minimal /dev, no
    host /home, /tmp or cwd), ``--cleanenv``, ``--ipc`` and ``--pid``; ``--no-privs`` (root
    servers) drops the capabilities root keeps inside a container by default;
    ``cgroup_limits`` gives the instance a memory cap of one process's address-space limit
    (swap included, so no swap) and a process cap of ``limits.processes``, the bound that
    RLIMIT_NPROC cannot give when every sandbox runs as the server's own user.
    ``minimal_view`` (``host_view="minimal"``) adds ``--no-mount hostfs,bind-paths``: none of
    the host directories an admin's ``apptainer.conf`` binds into every container (a shared
    data or scratch directory) reaches a job; only the image and our binds do."""
    opts = ["--containall", "--writable-tmpfs", "--no-home", "--cleanenv"]
    if minimal_view:
        opts += ["--no-mount", "hostfs,bind-paths"]
    if as_root:
        opts.append("--no-privs")
    if network == "none":
        opts += ["--net", "--network", "none"]
    if cgroup_limits and limits is not None:
        opts += ["--memory", str(limits.address_space_bytes),
                 "--memory-swap", str(limits.address_space_bytes),
                 "--pids-limit", str(limits.processes)]
    opts += ["--bind", f"{sb_path / 'workspace'}:{workspace_in_sandbox}",
             "--bind", f"{sb_path / 'tmp'}:/tmp",
             "--bind", f"{sb_path / 'ctl'}:{CTL_IN_SANDBOX}"]
    for host, inside in extra_ro_binds:
        opts += ["--bind", f"{host}:{inside}:ro"]
    for host, inside, writable in binds:
        opts += ["--bind", f"{host}:{inside}" if writable else f"{host}:{inside}:ro"]
    return opts


class ApptainerSandbox(Sandbox):
    def __init__(self, config: SandboxConfig, sid: str, path: Path, lock_fd: int,
                 exe: str, env: dict[str, str], network: Network,
                 limits: SandboxLimits, memory_group: str | None = None,
                 cgroup_procs: Path | None = None) -> None:
        super().__init__()
        self.config = config
        self.id = sid
        self.path = path
        self.workspace = path / "workspace"
        self.workspace_in_sandbox = config.workspace_in_sandbox
        self.env = env
        self.network = network
        self.limits = limits
        self.python = config.python or "python3"
        self.exe = exe
        self.instance_name = f"rollout-{sid}"
        self._lock_fd = lock_fd
        self._memory_group = memory_group
        self._prefix = launch_prefix(limits, cgroup_procs)
        self._privs = ["--no-privs"] if os.geteuid() == 0 else []
        self.image_lease: images.ImageLease | None = None
        """Held while the sandbox runs on an image of the image cache."""

    @classmethod
    async def create(cls, config: SandboxConfig, *, workspace_files: Mapping[str, bytes | str],
                     env: Mapping[str, str], network: Network, limits: SandboxLimits,
                     image: Any = None, binds: Sequence[tuple[str, str, bool]] = (),
                     user: Any = None, **unknown: Any) -> ApptainerSandbox:
        """``image``: this sandbox's own image instead of ``config.image``; ``binds``: (host
        dir, sandbox path, writable) mounts, read-only unless writable. ``user`` is refused:
        Apptainer runs every process as the server's own user."""
        if unknown:
            raise SandboxError(f"unknown sandbox options: {sorted(unknown)}",
                               "INVALID_SANDBOX_OPTIONS")
        if user is not None:
            spec = getattr(user, "spec", user)
            named_by = getattr(user, "named_by", "the sandbox's user option")
            raise SandboxError(f"the apptainer runtime runs every process as the server's own "
                               f"user; it cannot run as {spec!r} ({named_by}): use the bwrap "
                               "runtime", "INVALID_SANDBOX_OPTIONS")
        exe = find_singularity()
        checked = check_binds(binds, config.workspace_in_sandbox, CTL_IN_SANDBOX)
        # A job's own image carries its environment, PATH included (a SWE-bench image puts its
        # conda env there); the server's image gets the usual PATH.
        own_image = bool(image)
        image = image or config.image
        if not image:
            raise SandboxError("the apptainer runtime needs an image (a .sif file or a "
                               "sandbox directory): set SandboxConfig.image",
                               "INVALID_SANDBOX_OPTIONS")
        lease = None
        if uses_image_cache(image, config):
            # The bwrap runtime's cache: fetched (skopeo) or built (buildah), checked and
            # unpacked (umoci) once; the instance starts the cached root directory, read-only,
            # with the image's Env, as a sandbox image.
            if isinstance(image, str):
                image = images.parse_image_ref(image)
            lease = await asyncio.to_thread(images.lease_image, image, config.images)
            env = {**lease.image.config.env_dict, **env}
            image = str(lease.image.rootfs)
        elif "://" not in image and not await asyncio.to_thread(os.path.exists, image):
            raise SandboxError(f"image {image} does not exist", "INVALID_SANDBOX_OPTIONS")
        try:
            sb = await finish_creation(functools.partial(
                cls._create_sync, config, exe, image, dict(workspace_files), dict(env),
                network, limits, checked, own_image))
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        sb.image_lease = lease
        return sb

    @classmethod
    def _create_sync(cls, config: SandboxConfig, exe: str, image: str,
                     files: dict[str, bytes | str], env: dict[str, str], network: Network,
                     limits: SandboxLimits, binds: tuple[tuple[str, str, bool], ...] = (),
                     own_image: bool = False) -> ApptainerSandbox:
        root = config.sandboxes_dir
        root.mkdir(parents=True, exist_ok=True, mode=0o711)
        sid = uuid.uuid4().hex[:12]
        path = root / sid
        path.mkdir(mode=0o711)
        lock_fd = -1
        name = f"rollout-{sid}"
        state = os.path.abspath(config.state_dir)
        memory_group = None
        try:
            # The bwrap runtime's disk quota: /workspace, /tmp and /.sandbox are binds of this
            # directory, a size-limited tmpfs, so a job fills its own quota, not the host's disk.
            if config.disk_bytes > 0 and hardening.can_mount():
                hardening.mount_quota(path, config.disk_bytes)
            lock_fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            (path / "meta.json").write_text(json.dumps({
                "uid": None, "server_pid": os.getpid(), "created": time.time(),
                "runtime": "apptainer", "instance": name}))
            for sub in ("workspace", "tmp", "tmp/home", "ctl"):
                (path / sub).mkdir(mode=0o755)
            os.chmod(path / "tmp", 0o1777)
            for rel, data in files.items():
                hostfs.write_beneath(path / "workspace", rel,
                                     data.encode() if isinstance(data, str) else data)
            cgroup_procs = None
            if config.memory_bytes >= 0:
                memory_group = state
                cgroup_procs = hardening.acquire_memory_cgroup(
                    state, config.memory_bytes or hardening.physical_memory_bytes() // 2)
            opts = instance_options(path, config.workspace_in_sandbox, network,
                                    config.extra_ro_binds, binds, limits=limits,
                                    minimal_view=config.host_view == "minimal",
                                    cgroup_limits=config.memory_bytes >= 0
                                    and cgroup_limits_possible(),
                                    as_root=os.geteuid() == 0)
            # Started by us, not spython: its calls wait without a deadline, and the instance's
            # processes must start under the same rlimits and memory cgroup as every launch.
            argv = [*launch_prefix(limits, cgroup_procs), exe, "instance", "start", *opts,
                    image, name]
            started = subprocess.run(argv, capture_output=True, text=True, check=False,
                                     timeout=START_TIMEOUT_S)
            if started.returncode != 0 or not _instance_running(exe, name):
                raise SandboxError(
                    f"`singularity instance start` of {image} failed (exit "
                    f"{started.returncode}): {(started.stderr or started.stdout)[-1500:]}",
                    "SANDBOX_START_FAILED")
            sb_env = {} if own_image else {"PATH": _DEFAULT_PATH}
            sb_env.update({"HOME": "/tmp/home", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
                           "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg", "TERM": "dumb", **env})
            sb = cls(config, sid, path, lock_fd, exe, sb_env, network, limits, memory_group,
                     cgroup_procs)
            register_live(sb)
            return sb
        except BaseException:
            _stop_instance(exe, name)
            if lock_fd >= 0:
                os.close(lock_fd)
            hostfs.rmtree(path)
            if memory_group is not None:
                hardening.release_memory_cgroup(memory_group)
            raise

    def command_argv(self, argv: Sequence[str], *, cwd: str | None = None,
                     env: Mapping[str, str] | None = None, tty: bool = False) -> list[str]:
        self._check_alive()
        return [*self._prefix, self.exe, "exec", "--cleanenv", *self._privs,
                "--pwd", cwd or self.workspace_in_sandbox, f"instance://{self.instance_name}",
                *argv]

    def spawn_env(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """Host environment of the CLI (it needs HOME etc. to find its instances) plus the
        sandbox env as SINGULARITYENV_*/APPTAINERENV_*: ``--cleanenv`` lets only those
        through into the container, so the server's own variables stay outside."""
        merged = {**self.env, **(env or {})}
        host = {k: v for k, v in os.environ.items()
                if not k.startswith(("SINGULARITYENV_", "APPTAINERENV_"))}
        for k, v in merged.items():
            host[f"SINGULARITYENV_{k}"] = v
            host[f"APPTAINERENV_{k}"] = v
        return host

    def control_dir(self) -> tuple[Path, str]:
        return self.path / "ctl", CTL_IN_SANDBOX

    async def exec(self, cmd: str | Sequence[str], *, timeout: float | None = None,  # noqa: ASYNC109
                   cwd: str | None = None, env: Mapping[str, str] | None = None,
                   stdin: bytes | None = None, max_output: int = 1 << 20) -> ExecResult:
        argv = ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        return await procs.run_collect(
            self.command_argv(argv, cwd=cwd), env=self.spawn_env(env),
            timeout=timeout if timeout is not None else self.limits.default_timeout_s,
            stdin=stdin, max_output=max_output, on_spawn=self.track, on_exit=self.untrack)

    def _kill_runtime_processes(self) -> None:
        # Processes a launch left behind live on inside the instance (its own PID namespace
        # under --containall): kill(-1) from inside reaches all of them but the instance's init.
        # Only when the command really runs in another PID namespace than ours: on the host
        # (a stand-in CLI, an instance without --pid) kill(-1) would hit every process there.
        if self.destroyed:  # destroy stops the whole instance anyway
            return
        guard = '[ "$(readlink /proc/self/ns/pid)" != "$1" ] && exec kill -KILL -1'
        with contextlib.suppress(Exception):
            subprocess.run(self.command_argv(["sh", "-c", guard, "guard",
                                              os.readlink("/proc/self/ns/pid")]),
                           env=self.spawn_env(), capture_output=True, timeout=CLI_TIMEOUT_S,
                           check=False)

    def _teardown_runtime(self) -> None:
        _stop_instance(self.exe, self.instance_name)
        group, self._memory_group = self._memory_group, None
        try:
            self._release_host_side(self.path, group)
        finally:
            if self.image_lease is not None:
                self.image_lease.release()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


START_TIMEOUT_S = 300.0
"""``instance start`` of a large SIF (mounting it, running its start script) may be slow."""
CLI_TIMEOUT_S = 30.0
"""Every other call of the CLI (list, stop, the in-instance kill sweep)."""


def launch_prefix(limits: SandboxLimits, cgroup_procs: Path | None) -> list[str]:
    """What every process of an Apptainer sandbox starts under, as with bwrap: the aggregate
    memory cgroup of the state dir (joined before anything forks; fails closed), then the
    rlimits (prlimit, soft = hard)."""
    return [*hardening.launch_wrapper(cgroup_procs, None), "prlimit",
            *limits.prlimit_args(), "--"]


def _instance_running(exe: str, name: str) -> bool:
    try:
        listed = subprocess.run([exe, "instance", "list", "--json", name], capture_output=True,
                                text=True, timeout=CLI_TIMEOUT_S, check=False)
        found = json.loads(listed.stdout or "{}").get("instances") or []
    except (subprocess.TimeoutExpired, OSError, ValueError, AttributeError):
        return False
    return any(isinstance(i, dict) and i.get("instance") == name for i in found)


def _stop_instance(exe: str, name: str) -> None:
    """``instance stop``, bounded; a stuck CLI is killed (subprocess.run does) and the
    start-up sweep stops the instance later from the name in meta.json."""
    with contextlib.suppress(Exception):
        subprocess.run([exe, "instance", "stop", name], capture_output=True,
                       timeout=CLI_TIMEOUT_S, check=False)


# -- image cache (``rollout tasks prepare``) -------------------------------------------------

ImageAction = Literal["pulled", "built", "cached", "local"]


@dataclass(frozen=True)
class PreparedImage:
    """What :func:`ensure_image` did for one image reference."""

    ref: str
    """The reference as the task names it (``docker://...``, ``oras://...`` or a path)."""
    path: str
    """What a sandbox starts: the cached SIF, or the local image itself."""
    action: ImageAction
    """``pulled`` / ``built`` now, ``cached`` from an earlier run, ``local`` used in place."""
    seconds: float = 0.0


def is_remote(ref: str) -> bool:
    return ref.split("://", 1)[0] in REMOTE_SCHEMES and "://" in ref


def needs_cache(ref: str) -> bool:
    """A registry reference is pulled and a ``.def`` recipe is built into the cache; a SIF
    file or sandbox directory is started where it lies."""
    return is_remote(ref) or ref.endswith(".def")


def cached_sif(ref: str, cache: Path) -> Path:
    """The cache file of ``ref``. A recipe's key covers its content, so an edited ``.def``
    is built again instead of reusing the old image."""
    key = ref
    if not is_remote(ref):
        key += "\0" + hashlib.sha256(Path(ref).read_bytes()).hexdigest()
    return cache / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.sif"


def ensure_image(ref: str, cache: Path, *, timeout: float = 3600.0) -> PreparedImage:
    """Pull or build ``ref`` into ``cache`` unless it is there already (blocking; one pull
    per image even across processes, under a lock file). Raises :class:`SandboxError` with
    the CLI's own message when the pull or build fails."""
    if not needs_cache(ref):
        return PreparedImage(ref, ref, "local")
    final = cached_sif(ref, cache)
    if final.is_file():
        return PreparedImage(ref, str(final), "cached")
    exe = find_singularity()
    cache.mkdir(parents=True, exist_ok=True)
    lock = os.open(cache / f".{final.stem}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_file():  # another process pulled it while we waited
            return PreparedImage(ref, str(final), "cached")
        # Written under a temporary name and renamed: an interrupted pull never looks done.
        tmp = cache / f".{final.stem}.{uuid.uuid4().hex[:8]}.sif"
        action: ImageAction
        if is_remote(ref):
            argv, action = [exe, "pull", str(tmp), ref], "pulled"
        else:
            # Building from a recipe needs root inside the build; unprivileged users get it
            # from a user namespace.
            fakeroot = [] if os.geteuid() == 0 else ["--fakeroot"]
            argv, action = [exe, "build", *fakeroot, str(tmp), ref], "built"
        started = time.monotonic()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                  check=False)
            if proc.returncode != 0 or not tmp.is_file():
                raise SandboxError(f"`{' '.join(argv[1:2])}` of {ref} failed (exit "
                                   f"{proc.returncode}): {(proc.stderr or proc.stdout)[-1500:]}",
                                   "ENV_BUILD_FAILED")
            os.rename(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return PreparedImage(ref, str(final), action, round(time.monotonic() - started, 2))
    finally:
        os.close(lock)
