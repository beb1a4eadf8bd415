"""The sandbox interface every runtime implements, its configuration, and the factory.

A sandbox is one job's private machine: a read-only root, a writable workspace, its own ``/tmp``,
no network, resource limits, and processes that cannot outlive it. Runtimes (bubblewrap,
Apptainer) differ only in how they start processes; everything a handler or tool needs goes
through :class:`Sandbox`, so the scheduler can swap runtimes by configuration.

Cleanup is the contract that matters most: ``destroy()`` is idempotent and kills every process
the sandbox started, then removes its directory; ``async with`` calls it on any exit (success,
exception, cancellation). A crash of the server is covered by ``--die-with-parent`` plus
:func:`rollout.runtime.sandbox.reaper.reap_stale` at the next start-up.
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from rollout.runtime.sandbox import hardening, hostfs, view

if TYPE_CHECKING:
    from rollout.runtime.sandbox.pool import SandboxPool

Network = Literal["none", "loopback"]
SandboxT = TypeVar("SandboxT", bound="Sandbox")
log = logging.getLogger(__name__)


class SandboxError(RuntimeError):
    """A sandbox could not be created or used (runtime missing, spawn failed, destroyed)."""

    def __init__(self, message: str, reason: str = "SANDBOX_ERROR") -> None:
        super().__init__(message)
        self.reason = reason


class SandboxUnavailable(SandboxError):
    """The configured runtime cannot run on this machine; the message says what to install."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "SANDBOX_RUNTIME_MISSING")


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits applied (as rlimits) to every process started inside the sandbox."""

    cpu_seconds: int = 600
    """RLIMIT_CPU per process: CPU time, not wall time."""
    address_space_bytes: int = 4 << 30
    """RLIMIT_AS per process: big enough for numpy/ipykernel thread arenas, small enough to
    stop a memory hog long before the host swaps."""
    processes: int = 256
    """RLIMIT_NPROC: processes+threads of the sandbox user (per sandbox when the server runs
    as root, since each sandbox gets its own uid)."""
    open_files: int = 1024
    """RLIMIT_NOFILE."""
    file_size_bytes: int = 1 << 30
    """RLIMIT_FSIZE: largest file a process may write."""
    default_timeout_s: float = 60.0
    """Wall-clock timeout of ``exec`` when the caller passes none."""

    def prlimit_args(self) -> list[str]:
        """Arguments for util-linux ``prlimit`` (soft=hard so the sandbox cannot raise them)."""
        def pair(value: int) -> str:
            return f"{value}:{value}"
        return [f"--cpu={pair(self.cpu_seconds)}", f"--as={pair(self.address_space_bytes)}",
                f"--nproc={pair(self.processes)}", f"--nofile={pair(self.open_files)}",
                f"--fsize={pair(self.file_size_bytes)}"]

    def ulimit_script(self) -> str:
        """The same limits as ``dash`` ``ulimit`` builtins (soft and hard, for a launch line's
        ``sh`` prologue), so a launch needs no ``prlimit`` exec. dash counts RLIMIT_AS in KiB
        and RLIMIT_FSIZE in 512-byte blocks; a value between units is rounded down (stricter,
        never looser). Fails closed: a limit that cannot be set stops the launch."""
        flags = (("t", self.cpu_seconds), ("v", self.address_space_bytes // 1024),
                 ("p", self.processes), ("n", self.open_files),
                 ("f", self.file_size_bytes // 512))
        return "; ".join(f"ulimit -{flag} {value} || exit 125" for flag, value in flags)

    def above(self, ceilings: SandboxLimits) -> list[str]:
        """The rlimits of these limits that exceed ``ceilings`` ('name value > ceiling')."""
        return [f"{name} {getattr(self, name)} > {getattr(ceilings, name)}"
                for name in RAISABLE_LIMITS if getattr(self, name) > getattr(ceilings, name)]


RAISABLE_LIMITS = ("address_space_bytes", "processes", "open_files")
"""The limits a job may ask to change (a harness preset's ``[limits]``), within the server's
:attr:`SandboxConfig.max_limits`."""
DEFAULT_MAX_LIMITS = SandboxLimits(address_space_bytes=32 << 30, processes=4096,
                                   open_files=65536)
"""The ceilings a server has unless configured: what a job may raise its limits to. An address
space limit is not memory use (a JIT runtime reserves tens of GiB it never touches); the
sandboxes' memory cgroup bounds what they really use."""


@dataclass(frozen=True)
class ImageSettings:
    """Where and how container images become sandbox roots (:mod:`rollout.runtime.sandbox.images`,
    docs/images.md). Shared by ``rollout serve`` and ``rollout tasks prepare``, so an image
    prepared ahead of time is the one INIT finds."""

    cache_dir: str = ""
    """The image cache ('' = ``$ROLLOUT_IMAGE_CACHE``, else ``~/.cache/rollout/images``)."""
    budget_bytes: int = 32 << 30
    """Total unpacked size the cache keeps; least recently used images no sandbox holds are
    evicted past it."""
    max_image_bytes: int = 8 << 30
    """Largest unpacked size of one image (a bigger one, a tar bomb say, is refused)."""
    setuid: Literal["strip", "refuse"] = "strip"
    """setuid/setgid files in a layer: stripped of the bits (default) or refused."""
    authfile: str = ""
    """skopeo ``--authfile`` (default: skopeo's own lookup, ``REGISTRY_AUTH_FILE`` first)."""
    registries_conf: str = ""
    """A registries.conf instead of the user's (``CONTAINERS_REGISTRIES_CONF``)."""
    tls_verify: bool = True
    """False: talk to every registry without TLS verification (prefer registries.conf's
    per-registry ``insecure = true``)."""
    timeout_s: float = 1800.0
    """Deadline of one fetch, one unpack, one build."""
    build_timeout_s: float = 3600.0
    """Deadline of one Dockerfile build."""
    build_network: Literal["host", "allowlist"] = "host"
    """The network of a Dockerfile's ``RUN`` steps: the host's (``host``, the default), or
    only the image registries of ``registries.conf`` and :attr:`build_hosts`
    (``allowlist``: :mod:`rollout.runtime.sandbox.images.egress`; a rootless server needs
    its subordinate ids for it)."""
    build_hosts: tuple[str, ...] = ()
    """With ``build_network = "allowlist"``: the package registries a build may reach
    (``deb.debian.org``, ``pypi.org:443``, ``*.pythonhosted.org``)."""
    rootless_root: Literal["auto", "overlay", "copy"] = "auto"
    """How a rootless server gives each image sandbox its writable root: ``overlay`` (a
    copy-on-write overlay mounted in a user namespace: Linux 5.11+, and a filesystem the
    kernel accepts as its upper layer), ``copy`` (a private copy of the cached root, ``cp -a
    --reflink=auto``: any kernel, but INIT copies the image and the job's disk holds it), or
    ``auto`` (the default: the overlay, falling back to the copy for good once the kernel
    refuses the mount). A root server always mounts the overlay itself."""
    apptainer_pulls: Literal["apptainer", "cache"] = "apptainer"
    """Apptainer runtime, ``docker://`` images: pulled by Apptainer into SIF files
    (``apptainer``, the default: a SIF is one squashfs file, which Apptainer runs best) or
    taken from this image cache like every other reference (``cache``)."""

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir)
        env = os.environ.get("ROLLOUT_IMAGE_CACHE")
        if env:
            return Path(env)
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
        return Path(base) / "rollout" / "images"


@dataclass(frozen=True)
class SandboxConfig:
    """Server-wide sandbox settings (one per server); per-job options go to ``create_sandbox``."""

    runtime: Literal["bwrap", "apptainer"] = "bwrap"
    state_dir: Path = Path(".rollout")
    """Server state; sandboxes live in ``<state_dir>/sandboxes/<id>`` and the whole state dir
    is hidden inside every sandbox."""
    rootfs: Path | None = None
    """bwrap: a directory used read-only as ``/``; None builds the root from the host as
    ``host_view`` says. When
    the server runs as root the rootfs must contain ``setpriv`` (util-linux), which drops
    each command to the sandbox uid, and ``bash`` for string commands and the bash tool."""
    image: str | None = None
    """apptainer: a SIF file or sandbox directory, or (both runtimes) an image reference
    (``docker://``, ``oci:``, ``oci-archive:``, ``docker-archive:``) that becomes the root of
    every sandbox; a job's own ``image=`` option wins (docs/images.md)."""
    images: ImageSettings = field(default_factory=ImageSettings)
    """The image cache and registry settings for image references."""
    workspace_in_sandbox: str = "/workspace"
    host_view: Literal["minimal", "host"] = "minimal"
    """bwrap without ``rootfs``: ``minimal`` binds only what a job needs (``system_paths``,
    an ``/etc`` of ``etc_entries``, the interpreter, ``visible_paths``); ``host`` binds the
    whole host root read-only but ``hide_paths`` (task files, data sets and checkouts
    included: only for trusted workloads). See :mod:`rollout.runtime.sandbox.view`."""
    system_paths: tuple[str, ...] = view.SYSTEM_PATHS
    """Minimal view: host trees bound read-only at the same path."""
    etc_entries: tuple[str, ...] = view.ETC_ENTRIES
    """Minimal view: the ``/etc`` entries (globs) a sandbox sees."""
    visible_paths: tuple[str, ...] = ()
    """Minimal view: more host paths bound read-only at the same path (a toolchain in
    ``/opt``, say); the state dir and the service's own package stay covered inside them."""
    hide_paths: tuple[str, ...] = ("/root", "/run", "/var/run", "/home", "/mnt", "/media")
    """Paths covered by an empty tmpfs wherever a bound tree holds them (in host mode: the
    secrets and host sockets of the host root). The Python installation of the server stays
    visible even if it lies below one of them."""
    extra_ro_binds: tuple[tuple[str, str], ...] = ()
    """(host path, sandbox path) pairs bound read-only, e.g. a dataset directory."""
    uid_base: int = 200_000
    """First uid handed to sandboxes when the server runs as root (one uid per sandbox)."""
    uid_count: int = 10_000
    uid_lock_dir: Path = Path("/run/lock/rollout-sandbox-uids")
    """Host-wide (not per state dir) so two servers on one host never share a uid."""
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    max_limits: SandboxLimits = DEFAULT_MAX_LIMITS
    """The most a sandbox's own ``limits`` (``create_sandbox(limits=...)``) may ask for in
    :data:`RAISABLE_LIMITS`; a request above them is refused."""
    python: str = ""
    """Interpreter used inside the sandbox for the IPython kernel ('' = the server's own)."""
    disk_bytes: int = 2 << 30
    """Both runtimes: size of the tmpfs that holds one sandbox's /workspace, /tmp and
    /.sandbox, so a job cannot fill the state dir's filesystem (ENOSPC inside the sandbox
    instead). Needs the server to run as root; 0 = no quota."""
    memory_bytes: int = 0
    """Both runtimes: memory cap of all sandboxes together (one memory cgroup; tmpfs pages
    their processes write count too). 0 = half of the machine's physical memory; -1 = no cap
    (under Apptainer also no ``--memory``/``--pids-limit`` per instance). Without a writable
    memory controller (a rootless server, usually) it still bounds the sum of the live image
    sandboxes' tmpfs upper layers' sizes (``bwrap._LayerBudget``)."""
    seccomp: bool = True
    """bwrap: load the seccomp filter of ``runtime.sandbox.hardening`` (needs pyseccomp)."""
    verifier_hosts: tuple[str, ...] = ()
    """Hosts a task's verifier (a Harbor task's ``tests/test.sh``) may reach through an
    allow-listing proxy (``host``, ``host:port``, ``*.domain``; checked by
    :func:`~rollout.runtime.sandbox.images.egress.check_entries`); the policy's own commands
    never get a network. See :mod:`rollout.runtime.envs.grading.network`."""

    @property
    def sandboxes_dir(self) -> Path:
        return Path(os.path.abspath(self.state_dir)) / "sandboxes"


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one non-interactive command."""

    exit_code: int
    """The command's status; 128+N when killed by signal N, -1 when it never ran."""
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    """True when output beyond the cap was dropped (the text then says so)."""
    duration_s: float = 0.0

    @property
    def output(self) -> str:
        """stdout followed by stderr, for showing to a model."""
        return self.stdout + self.stderr

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class Sandbox(abc.ABC):
    """One job's sandbox. Create it with :func:`create_sandbox`; always destroy it."""

    id: str
    workspace: Path
    """Host path of the workspace directory."""
    workspace_in_sandbox: str
    env: dict[str, str]
    network: Network

    def __init__(self) -> None:
        self._bash: Any = None
        self._ipython: Any = None
        self._tool_lock = asyncio.Lock()
        self.destroyed = False
        self._pids: set[int] = set()
        self._destroy_task: asyncio.Future[None] | None = None

    # -- processes ---------------------------------------------------------------------------
    @abc.abstractmethod
    async def exec(self, cmd: str | Sequence[str], *, timeout: float | None = None,  # noqa: ASYNC109
                   cwd: str | None = None, env: Mapping[str, str] | None = None,
                   stdin: bytes | None = None, max_output: int = 1 << 20) -> ExecResult:
        """Run a command to completion (``str`` goes through ``bash -c``)."""

    @abc.abstractmethod
    def command_argv(self, argv: Sequence[str], *, cwd: str | None = None,
                     env: Mapping[str, str] | None = None, tty: bool = False) -> list[str]:
        """The host argv that runs ``argv`` inside this sandbox (for long-lived processes that
        a tool manages itself, e.g. the pty bash or the IPython kernel)."""

    @abc.abstractmethod
    def spawn_env(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The host environment to start ``command_argv`` with."""

    def track(self, pid: int) -> None:
        """Register a long-lived process the sandbox must kill on destroy."""
        self._pids.add(pid)

    def untrack(self, pid: int) -> None:
        """Forget a tracked process that has exited (its pid may be reused)."""
        self._pids.discard(pid)

    @property
    def tracked_pids(self) -> frozenset[int]:
        """The long-lived processes (launchers) the sandbox kills on destroy."""
        return frozenset(self._pids)

    def control_dir(self) -> tuple[Path, str]:
        """(host path, sandbox path) of a private directory for sockets (kernel ipc)."""
        raise SandboxError("this runtime has no control directory")

    # -- files -------------------------------------------------------------------------------
    def _rel(self, path: str) -> str:
        prefix = self.workspace_in_sandbox.rstrip("/") + "/"
        if path.startswith(prefix):
            return path[len(prefix):]
        if path == self.workspace_in_sandbox:
            return ""
        return path

    async def put_file(self, rel_path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write a workspace file (never following symlinks the sandbox may have planted)."""
        raw = data.encode() if isinstance(data, str) else data
        await asyncio.to_thread(hostfs.write_beneath, self.workspace, self._rel(rel_path), raw,
                                mode, self._owner())

    async def get_file(self, rel_path: str) -> bytes:
        """Read a workspace file; FileNotFoundError when it does not exist."""
        return await asyncio.to_thread(hostfs.read_beneath, self.workspace, self._rel(rel_path))

    async def remove_file(self, rel_path: str) -> None:
        """Delete a workspace file (a symlink is removed itself, never its target)."""
        await asyncio.to_thread(hostfs.unlink_beneath, self.workspace, self._rel(rel_path))

    def _owner(self) -> tuple[int, int] | None:
        return None

    def owner(self) -> tuple[int, int] | None:
        """(uid, gid) the sandbox's processes run as, when not the server's own (root mode);
        a host directory bound writable into the sandbox must belong to it."""
        return self._owner()

    def hand_over(self, paths: Sequence[Path | str], user: Any = None) -> None:
        """Give host folders (or files) bound writable into the sandbox, with all they hold,
        to the user whose processes write them (``user``: a user of the image from
        ``user_for``; None: the sandbox's own): a root server's sandbox uid (every user of
        its sandbox shares it); on a rootless server with a subordinate range, that user's
        uid inside the sandbox's user namespace (:class:`~rollout.runtime.sandbox.bwrap.
        BwrapSandbox`). Elsewhere the server's user is every user already. Blocking; call it
        while no process of the sandbox runs (before the first launch, or after
        :meth:`stop_processes`). Raises :class:`SandboxError` when a path could not be
        given."""
        owner = self._owner()
        if owner is None:
            return
        failed = sum(hostfs.chown_tree(p, *owner) for p in paths)
        if failed:
            raise SandboxError(f"sandbox {self.id}: {failed} entries of {list(map(str, paths))} "
                               "could not be given to its user")

    def take_back(self, paths: Sequence[Path | str]) -> None:  # noqa: B027 - optional hook
        """Give folders :meth:`hand_over` gave back to the server's user, so that the server
        reads, empties and removes what the sandbox's users wrote there (a rootless server
        cannot, from outside the sandbox's user namespace, for files a subordinate uid owns).
        Blocking; after :meth:`stop_processes`. A no-op where the server is root or the
        sandbox's users are the server's own user."""

    async def copy_workspace_from(self, other: Sandbox, *,
                                  skip: frozenset[str] = frozenset()) -> int:
        """Copy ``other``'s workspace into this (empty) one, owned by this sandbox's user;
        returns the bytes copied. ``other`` must have no running processes
        (:meth:`stop_processes`), so what is copied is what it left, not a moving target."""
        return await asyncio.to_thread(hostfs.copy_tree, other.workspace, self.workspace,
                                       owner=self._owner(), skip=skip)

    # -- tools -------------------------------------------------------------------------------
    async def bash(self) -> Any:
        """The sandbox's persistent bash session (created on first use, cached, and replaced
        by a fresh one if it died or was killed at a timeout)."""
        from rollout.runtime.tools.bash import BashSession
        async with self._tool_lock:
            self._check_alive()
            if self._bash is None or not self._bash.alive:
                if self._bash is not None:
                    await self._bash.close()
                self._bash = await BashSession.start(self)
            return self._bash

    async def ipython(self) -> Any:
        """The sandbox's IPython kernel (started on first use, then cached)."""
        from rollout.runtime.tools.ipython import IPythonKernel
        async with self._tool_lock:
            self._check_alive()
            if self._ipython is None:
                self._ipython = await IPythonKernel.start(self)
            return self._ipython

    async def _close_tools(self) -> None:
        bash, kernel, self._bash, self._ipython = self._bash, self._ipython, None, None
        for tool in (bash, kernel):
            if tool is not None:
                try:
                    await tool.close()
                except Exception:  # destroy must go on; the process kill below is the backstop
                    pass

    async def stop_processes(self) -> None:
        """Close the tools and kill every process running in the sandbox (anything the agent
        left in the background included), keeping its files; later launches work again.

        Why: a grader must not share the sandbox with processes of the policy it grades (a
        background loop that rewrites the solution or the report while the tests run)."""
        self._check_alive()
        async with self._tool_lock:
            # Kill first, close after: a process must not see its tool die and act on it
            # (rewrite a file) before it is killed itself.
            await asyncio.to_thread(self._kill_all_sync)
            await self._close_tools()

    def _kill_all_sync(self) -> None:
        from rollout.runtime.sandbox import procs
        for pid in list(self._pids):
            procs.kill_pid(pid)
        self._pids.clear()
        self._kill_runtime_processes()

    def _kill_runtime_processes(self) -> None:  # noqa: B027 - optional hook
        """The runtime's sweep of whatever escaped the tracked launches (by uid, by tag)."""

    def _check_alive(self) -> None:
        if self.destroyed:
            raise SandboxError(f"sandbox {self.id} is destroyed", "SANDBOX_DESTROYED")

    # -- lifetime ----------------------------------------------------------------------------
    async def destroy(self) -> None:
        """Kill every process and remove every file of the sandbox. Idempotent; never raises
        for an already-dead sandbox; safe to call from a cancelled task (the teardown runs as
        one shielded task that every caller awaits, so a cancelled caller never cuts it short)."""
        if self._destroy_task is None:
            self.destroyed = True
            self._destroy_task = asyncio.ensure_future(self._destroy())
        await asyncio.shield(self._destroy_task)

    async def _destroy(self) -> None:
        try:
            await self._close_tools()
        finally:
            # Also when cancelled: ``asyncio.run`` cancels every task at its end, this shielded
            # one included, and a teardown cut short there left the sandbox's quota mount on
            # the host. The thread runs to its end whatever happens to this await.
            await asyncio.to_thread(self._teardown_sync)

    def _teardown_sync(self) -> None:
        """Blocking teardown (runs in a worker thread, or at interpreter exit): tracked
        processes first, then whatever the runtime owns. The runtime's part runs even when
        killing failed, since it is what frees host resources (mounts, uids, cgroups)."""
        try:
            self._kill_all_sync()
        except Exception:
            log.exception("killing the processes of sandbox %s failed; removing it anyway",
                          self.id)
        finally:
            try:
                self._teardown_runtime()
            finally:
                _LIVE.pop(id(self), None)

    def _release_host_side(self, path: Path, memory_group: str | None) -> None:
        """Remove the sandbox directory ``path`` (unmounting what is left below it when removal
        fails) and release its share of the memory cgroup: the host-side part every runtime's
        teardown ends with. Each step on its own, so one that raises never keeps the quota
        mount from going."""
        try:
            hostfs.rmtree(path)
        except Exception:
            log.exception("could not remove sandbox %s at %s", self.id, path)
            hardening.unmount_below(path)
        if memory_group is not None:
            hardening.release_memory_cgroup(memory_group)

    @abc.abstractmethod
    def _teardown_runtime(self) -> None:
        """The runtime's own blocking cleanup after the tracked processes are dead (stop an
        instance, sweep leftovers, remove the directory, release locks). Must not raise."""

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await asyncio.shield(self.destroy())


_LIVE: dict[int, Sandbox] = {}
"""Sandboxes created and not yet torn down, for :func:`_destroy_leftovers`."""


def register_live(sandbox: Sandbox) -> None:
    """Called by a runtime once a sandbox is fully created: from then on, an exit of the
    interpreter that nobody destroyed it before still tears it down."""
    _LIVE[id(sandbox)] = sandbox


@atexit.register
def _destroy_leftovers() -> None:
    """Last resort at interpreter exit for sandboxes nobody destroyed (a job whose cleanup
    was still running when the event loop closed, a creation that finished after its caller
    was cancelled and the loop had stopped). Only SIGKILL escapes this; the start-up sweep
    (:func:`rollout.runtime.sandbox.reaper.reap_stale`) covers that."""
    for sb in list(_LIVE.values()):
        try:
            sb._teardown_sync()
        except Exception:
            log.exception("sandbox %s: teardown at exit failed", getattr(sb, "id", "?"))


async def finish_creation(create: Callable[[], SandboxT]) -> SandboxT:
    """Run a blocking ``create()`` in a worker thread and return its sandbox; if the caller
    is cancelled meanwhile, the creation is waited for (at most ``CANCEL_SETTLE_S``) and its
    sandbox torn down before the cancel goes on, so a cancelled INIT ends with nothing left.

    Past that wait, an abandoned sandbox is torn down in a thread, never in a task of the
    caller's event loop: the cancel may be the loop's own shutdown (``asyncio.run`` cancelling
    every task of a stopping server), after which no task runs any more, and the sandbox's
    quota mount then stayed on the host until the process exited. Such a sandbox has no tool
    processes yet, so the blocking teardown alone frees everything."""
    lock = threading.Lock()
    handover: dict[str, Any] = {"abandoned": False, "sandbox": None}

    def run() -> SandboxT:
        sandbox = create()
        with lock:
            if not handover["abandoned"]:
                handover["sandbox"] = sandbox
                return sandbox
        sandbox.destroyed = True
        sandbox._teardown_sync()
        raise SandboxError("sandbox creation was cancelled", "SANDBOX_DESTROYED")

    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(None, run)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        # Let the creation finish and tear it down before the cancel goes on, so a cancelled
        # job's INIT ends with its sandbox gone, not going. Bounded: past that (or on a second
        # cancel), the thread is left to tear down on its own.
        try:
            made_now = await asyncio.wait_for(asyncio.shield(fut), CANCEL_SETTLE_S)
        except BaseException:
            pass
        else:
            made_now.destroyed = True
            teardown = loop.run_in_executor(None, made_now._teardown_sync)
            _abandoned(teardown)
            with contextlib.suppress(BaseException):
                await asyncio.shield(teardown)
            raise
        with lock:
            handover["abandoned"] = True
            made: Sandbox | None = handover["sandbox"]
        if made is not None:  # finished just before the cancel reached us: nobody has it
            made.destroyed = True
            # The default executor, which a closing asyncio.run still waits for; a plain
            # thread (which the interpreter waits for) where that is shut down already.
            try:
                _abandoned(loop.run_in_executor(None, made._teardown_sync))
            except RuntimeError:
                threading.Thread(target=made._teardown_sync, name=f"teardown-{made.id}").start()
        _abandoned(fut)
        raise


_ABANDONED: set[asyncio.Future[Any]] = set()
CANCEL_SETTLE_S = 30.0
"""How long a cancelled creation is waited for (so its sandbox can be removed) before the
cancel goes on and leaves the removal to the creating thread."""


def _abandoned(fut: asyncio.Future[Any]) -> None:
    _ABANDONED.add(fut)
    fut.add_done_callback(_retrieve)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark an abandoned creation's outcome as seen (no "exception never retrieved")."""
    _ABANDONED.discard(fut)
    if not fut.cancelled():
        fut.exception()


async def settle_abandoned(timeout: float = 30.0) -> int:  # noqa: ASYNC109
    """Wait (at most ``timeout``) until the creations whose callers were cancelled have torn
    their sandboxes down; returns how many are still going. A stopping server calls it, so
    that "stopped" means no sandbox of it is left on the host, not "soon none"."""
    loop = asyncio.get_running_loop()
    mine = [f for f in _ABANDONED if f.get_loop() is loop]
    if not mine:
        return 0
    _, pending = await asyncio.wait(mine, timeout=timeout)
    return len(pending)


def python_argv(sandbox: Any) -> list[str]:
    """The argv prefix that runs the server's interpreter inside ``sandbox``: in an image root
    the host's loader and the interpreter where the root has it (its own path, or
    ``/.rollout/python``), elsewhere the interpreter itself."""
    return [*getattr(sandbox, "python_launcher", ()),
            getattr(sandbox, "python_inside", "") or getattr(sandbox, "python", "python3")]


def check_binds(binds: Sequence[tuple[str, str, bool]], workspace: str,
                control: str) -> tuple[tuple[str, str, bool], ...]:
    """Per-sandbox (host dir, sandbox path, writable) mounts, checked: never over the
    sandbox's own directories (root, ``/tmp``, ``/proc``, ``/dev``, the control dir, the
    workspace), and only existing host directories."""
    checked = []
    reserved = ("/", "/tmp", "/proc", "/dev", control, workspace)
    for host, inside, writable in binds:
        inside_norm = os.path.normpath(inside)
        if not inside.startswith("/") or inside_norm in reserved or inside_norm.startswith(
                tuple(r.rstrip("/") + "/" for r in reserved if r != "/")):
            raise SandboxError(f"cannot bind over {inside!r} in the sandbox",
                               "INVALID_SANDBOX_OPTIONS")
        if not os.path.isdir(host):
            raise SandboxError(f"bind source {host} is not a directory",
                               "INVALID_SANDBOX_OPTIONS")
        checked.append((os.path.abspath(host), inside_norm, bool(writable)))
    return tuple(checked)


def config_of(factory: Any) -> SandboxConfig | None:
    """The config of a ``functools.partial(create_sandbox, cfg)`` factory, else None."""
    if isinstance(factory, functools.partial) and factory.func is create_sandbox:
        return factory.args[0] if factory.args else factory.keywords.get(
            "config") or SandboxConfig()
    return None


def limits_of(factory: Any) -> tuple[SandboxLimits, SandboxLimits]:
    """A factory's default limits and its ceilings (another factory, a test's own: the
    defaults), so a handler can ask for more within what the server allows."""
    config = config_of(factory)
    if config is None:
        return SandboxLimits(), DEFAULT_MAX_LIMITS
    return config.limits, config.max_limits


def runtime_of(factory: Any) -> str | None:
    """The runtime (``bwrap`` / ``apptainer``) a ``functools.partial(create_sandbox, cfg)``
    factory starts, or None for any other factory (a test's own), so a handler can refuse an
    option the runtime cannot honour with a message instead of a failed start."""
    if isinstance(factory, functools.partial) and factory.func is create_sandbox:
        config = factory.args[0] if factory.args else factory.keywords.get("config")
        return str((config or SandboxConfig()).runtime)
    return None


async def create_sandbox(config: SandboxConfig | None = None, *,
                         workspace_files: Mapping[str, bytes | str] | None = None,
                         env: Mapping[str, str] | None = None, network: Network = "none",
                         limits: SandboxLimits | None = None, pool: SandboxPool | None = None,
                         **options: Any) -> Sandbox:
    """Create a started sandbox. Use ``functools.partial(create_sandbox, cfg)`` as
    ``JobContext.sandbox_factory``. If anything fails half-way, what was made is removed.

    ``network="none"`` (default): a private network namespace with only its own loopback, so
    nothing outside the sandbox is reachable. ``"loopback"``: the host's network namespace,
    for jobs that must reach a service on the host's 127.0.0.1 (e.g. a local grader); it
    reaches whatever the host reaches, so use it only for trusted environments.
    Per-sandbox options: ``binds=`` ((host dir, sandbox path, writable) triples) on both
    runtimes; bwrap ``rootfs=``; apptainer ``image=`` (this sandbox's own image).
    ``pool``: a :class:`~rollout.runtime.sandbox.pool.SandboxPool` to take a ready sandbox
    from when it holds one of this shape; otherwise the sandbox is made here."""
    config = config or SandboxConfig()
    if limits is not None and (above := limits.above(config.max_limits)):
        raise SandboxError(f"sandbox limits above this server's ceilings ({', '.join(above)}); "
                           "the server's sandbox.max_* settings raise them",
                           "INVALID_SANDBOX_OPTIONS")
    if network not in ("none", "loopback"):
        raise SandboxError(f"network must be 'none' or 'loopback', got {network!r}",
                           "INVALID_SANDBOX_OPTIONS")
    if pool is not None:
        pooled = await pool.take(config, **options, network=network,
                                 limits=limits or config.limits,
                                 workspace_files=workspace_files or {}, env=env or {})
        if pooled is not None:
            return pooled
    if config.runtime == "bwrap":
        from rollout.runtime.sandbox.bwrap import BwrapSandbox
        return await BwrapSandbox.create(config, workspace_files=workspace_files or {},
                                         env=env or {}, network=network,
                                         limits=limits or config.limits, **options)
    if config.runtime == "apptainer":
        from rollout.runtime.sandbox.apptainer import ApptainerSandbox
        return await ApptainerSandbox.create(config, workspace_files=workspace_files or {},
                                             env=env or {}, network=network,
                                             limits=limits or config.limits, **options)
    raise SandboxError(f"unknown sandbox runtime {config.runtime!r} (use bwrap or apptainer)",
                       "INVALID_SANDBOX_OPTIONS")
