"""What of the host a bwrap sandbox sees: by default only what a job needs.

A policy under RL reads whatever it can reach: a sandbox that saw the host's root read-only
could ``find /`` the shipped task files (gold patches, hidden tests) and any full clone a task
was imported from (the fix as a later commit). So the default view (``host_view="minimal"``)
builds the sandbox's root from nothing:

- an empty tmpfs ``/`` with the system trees bound read-only (``/usr``; ``/bin``, ``/sbin``,
  ``/lib*`` as the links or directories the host has);
- ``/etc`` rebuilt from an allow-list of entries (name service, loader cache, certificates,
  alternatives, shell profiles; no ``shadow``, no ``ssh``, no package-manager credentials),
  copied once per process into ``<state_dir>/sandbox-etc.<pid>`` and bound as one directory
  (one bind: a bind per entry made every launch slower);
- the interpreter the sandbox runs (the server's venv and the installation it points to), bound
  alone at its own path even when it lies inside a checkout: the checkout around it stays out;
- ``visible_paths`` the operator adds, and the per-job binds (a task's prepared environment);
- ``/proc``, ``/dev``, and the sandbox's own ``/tmp``, ``/workspace`` and ``/.sandbox``.

Never visible, even where they lie inside a bound tree (a wheel install keeps the shipped data
inside the venv): the state directory, the service's own package (its task sets included) and
the configured ``hide_paths``. Home directories, other jobs' files, task files and data sets
are simply never bound.

``host_view="host"`` is the former behaviour, kept for trusted workloads: every top-level entry
of the host root bound read-only, with ``hide_paths`` and the state directory covered.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""Host trees a minimal view binds read-only (links such as ``/bin -> usr/bin`` stay links)."""

ETC_ENTRIES = (
    "passwd", "group", "hosts", "host.conf", "nsswitch.conf", "resolv.conf", "gai.conf",
    "networks", "protocols", "services", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
    "localtime", "timezone", "os-release", "debian_version", "alternatives", "ssl/certs",
    "ssl/openssl.cnf", "ca-certificates", "ca-certificates.conf", "bash.bashrc", "profile",
    "inputrc", "shells", "terminfo", "magic", "magic.mime", "mime.types", "locale.alias",
    "fonts", "python3*", "xml")
"""``/etc`` entries (globs, relative to ``/etc``) a minimal view copies in; everything else of
the host's ``/etc`` (``shadow``, ``ssh/``, ``ssl/private``, ``pip.conf``, ``npmrc``,
``gitconfig``, ``environment``) stays out."""

_SKIP_TOP = {"proc", "dev", "sys", "tmp"}
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
"""The service's own code: a checkout's root, or the installed ``rollout`` package (whose
``runtime/envs/data`` holds the shipped task sets)."""


def _is_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def ro_bind_below(path: str, mount_point: str) -> list[str]:
    """Bind ``path`` read-only below ``mount_point`` (a tmpfs or a bind), creating its
    missing parents 0755: bwrap would create them 0700, unreachable for a sandbox uid."""
    if not os.path.isdir(path):
        return []
    args: list[str] = []
    parent = os.path.dirname(path)
    chain: list[str] = []
    while parent.rstrip("/") + "/" != mount_point.rstrip("/") + "/" and parent != "/":
        chain.append(parent)
        parent = os.path.dirname(parent)
    for d in reversed(chain):
        args += ["--perms", "0755", "--dir", d]
    return [*args, "--ro-bind", path, path]


@functools.lru_cache(maxsize=16)
def python_prefixes(extra: str) -> tuple[str, ...]:
    """The server's interpreter (venv and base installation) and ``extra``'s (a venv's python
    is a symlink: the venv itself and what it points to). Resolved once per process and
    interpreter, like the curated ``/etc``: every sandbox creation asks for it, and its
    ``realpath`` walks were a visible part of a cold creation (a restart picks up a venv
    pointed elsewhere)."""
    paths = {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix),
             os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    if extra:
        paths.add(os.path.dirname(os.path.dirname(os.path.abspath(extra))))
        paths.add(os.path.dirname(os.path.dirname(os.path.realpath(extra))))
    return tuple(sorted(paths))


def interpreter_binds(python: str, system: Iterable[str] = SYSTEM_PATHS
                      ) -> list[tuple[str, str, bool]]:
    """Per-sandbox binds that make the interpreter ``python`` (a host path) reachable in a
    minimal view: its installation's prefix, unless a system tree or the server's own
    interpreter (which every sandbox has) already holds it."""
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    if any(_is_under(prefix, p) for p in (*system, *python_prefixes(""))):
        return []
    return [(prefix, prefix, False)] if os.path.isdir(prefix) else []


def curated_etc(state_dir: str, entries: tuple[str, ...], source: str = "/etc") -> str:
    """The allow-listed ``/etc`` as a directory under ``state_dir`` (built once per process
    and configuration; a restart picks up host changes)."""
    with _ETC_LOCK:  # sandboxes are created in worker threads, many at once
        return _curated_etc(os.path.abspath(state_dir), entries, source)


_ETC_LOCK = threading.Lock()


@functools.lru_cache(maxsize=8)
def _curated_etc(state_dir: str, entries: tuple[str, ...], source: str) -> str:
    # One directory per process: another process on the same state dir (``rollout tasks
    # prepare`` beside a server) must never swap the /etc of sandboxes it does not own.
    root = Path(state_dir)
    root.mkdir(parents=True, exist_ok=True)
    for old in [*root.glob("sandbox-etc.*"), *root.glob(".sandbox-etc.*")]:
        if not _alive(old.name.rpartition(".")[2]):
            shutil.rmtree(old, ignore_errors=True)
    final = root / f"sandbox-etc.{os.getpid()}"
    staging = root / f".sandbox-etc.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(mode=0o755)
    for pattern in entries:
        for src in sorted(glob.glob(os.path.join(source, pattern))):
            rel = os.path.relpath(src, source)
            dst = staging / rel
            dst.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            try:
                if os.path.islink(src):
                    os.symlink(os.readlink(src), dst)
                elif os.path.isdir(src):
                    shutil.copytree(src, dst, symlinks=True)
                elif os.path.isfile(src):
                    shutil.copy2(src, dst)
                    os.chmod(dst, 0o644)
            except OSError:  # unreadable (a 0600 file): it is not for the sandbox anyway
                continue
    _files_only_accounts(staging / "nsswitch.conf")
    os.chmod(staging, 0o755)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    return str(final)


ACCOUNT_DATABASES = ("passwd", "group", "shadow", "gshadow", "initgroups")
"""nsswitch databases whose lookups a sandbox answers from its copied ``/etc`` files alone."""


def _files_only_accounts(conf: Path) -> None:
    """Make the sandbox's user and group lookups read only its copied ``passwd``/``group``.

    Why: every launch's uid drop (``setpriv``) and every ``id`` or ``getpwuid`` inside looks
    the sandbox uid up; a host line such as ``passwd: files systemd`` makes each of them load
    ``libnss_systemd`` and its libraries and probe ``/run/systemd/userdb``, which a sandbox
    never has, before answering from the files anyway. Other databases (``hosts``...) keep
    the host's sources."""
    try:
        lines = conf.read_text().splitlines()
    except OSError:
        return  # no nsswitch.conf: glibc's default reads the files
    out = []
    for line in lines:
        name, sep, _ = line.partition(":")
        if sep and name.strip() in ACCOUNT_DATABASES and not line.lstrip().startswith("#"):
            line = f"{name.strip()}: files"
        out.append(line)
    conf.write_text("\n".join(out) + "\n")


def _alive(pid: str) -> bool:
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def never_visible(state_dir: str, hide: Iterable[str]) -> tuple[str, ...]:
    """Paths covered by an empty tmpfs wherever a bound tree holds them."""
    paths = {os.path.realpath(state_dir), os.path.abspath(state_dir), str(PACKAGE_ROOT)}
    paths.update(p.rstrip("/") or "/" for p in hide)
    return tuple(sorted(paths))


@dataclass(frozen=True)
class HostView:
    """What of the host a minimal view holds, as one value: the trees bound read-only and the
    paths covered wherever a bound tree holds them. :meth:`args` is the only place that orders
    them, and it puts every mask after every bind that holds it (a mask emitted before the bind
    of a tree that contains it is undone by that bind: a wheel install in a venv outside
    ``/usr`` keeps the service's package, shipped task data included, inside the interpreter's
    tree, and binding the interpreter after the mask showed it again)."""

    system: tuple[str, ...]
    """Host trees (``/usr``, ``/bin`` ...): bound, or recreated as the links they are."""
    etc_dir: str
    """The curated ``/etc`` (see :func:`curated_etc`)."""
    visible: tuple[str, ...] = ()
    """Operator-added trees (``visible_paths``)."""
    interpreters: tuple[str, ...] = ()
    """Interpreter prefixes (venv, base installation), each bound alone at its own path."""
    masked: tuple[str, ...] = ()
    """Paths covered by an empty tmpfs wherever a bound tree holds them."""

    def binds(self) -> list[tuple[str, str]]:
        """(kind, path) of each tree bound, in the order they are decided: ``symlink``
        (system links), ``bind`` (a tree bound read-only at its own path)."""
        out: list[tuple[str, str]] = []
        bound: list[str] = []
        for path in self.system:
            if os.path.islink(path):
                out.append(("symlink", path))
            elif os.path.isdir(path):
                out.append(("bind", path))
                bound.append(path)
        for path in self.visible:
            real = os.path.realpath(path)
            if os.path.exists(real) and not any(_is_under(real, b) for b in bound):
                out.append(("bind", real))
                bound.append(real)
        for prefix in self.interpreters:
            # Alone, even inside a tree that is bound but masked (the server's venv inside
            # its checkout, the checkout itself bound by ``visible``).
            if os.path.isdir(prefix) and (not any(_is_under(prefix, b) for b in bound) or any(
                    _is_under(prefix, m) for m in self.masked)):
                out.append(("bind", prefix))
                bound.append(prefix)
        return out

    def masks(self) -> list[str]:
        """The masked paths some bound tree holds (a mask over nothing bound is not needed)."""
        bound = [p for kind, p in self.binds() if kind == "bind"]
        return [m for m in self.masked
                if os.path.isdir(m) and any(_is_under(m, b) and m != b for b in bound)]

    def args(self) -> tuple[str, ...]:
        """bwrap arguments: the root tmpfs, ``/etc``, ``/proc``, ``/dev``, the binds, then the
        masks. A bind that lies inside a mask (an interpreter inside a masked checkout) is the
        one exception a mask does not cover, so binds and masks are emitted by depth, a mask
        after the binds of its own depth: every mask comes after every bind that holds it, and
        a bind inside a mask after that mask (and before the masks inside it)."""
        head: list[str] = ["--tmpfs", "/"]
        ops: list[tuple[int, int, str, list[str]]] = []
        for kind, path in self.binds():
            if kind == "symlink":
                head += ["--symlink", os.readlink(path), path]
            elif path in self.system:
                head += ["--ro-bind", path, path]
            else:
                bind = ro_bind_below(path, "/") if os.path.isdir(path) else [
                    "--ro-bind", path, path]
                ops.append((_depth(path), 0, path, bind))
        head += ["--ro-bind", self.etc_dir, "/etc", "--proc", "/proc", "--dev", "/dev"]
        for path in self.masks():
            ops.append((_depth(path), 1, path, ["--tmpfs", path]))
        ops.sort(key=lambda op: op[:3])
        return (*head, *(arg for *_, args in ops for arg in args))


def _depth(path: str) -> int:
    return len([p for p in path.split("/") if p])


@functools.lru_cache(maxsize=16)
def minimal_binds(state_dir: str, etc_dir: str, system: tuple[str, ...],
                  visible: tuple[str, ...], masked: tuple[str, ...],
                  interpreters: tuple[str, ...]) -> tuple[str, ...]:
    """bwrap arguments of a minimal root (cached: the same for every sandbox of a server)."""
    return HostView(system, etc_dir, visible, interpreters, masked).args()


def rebinds_below(prefixes: Iterable[str], under: str, masked: Iterable[str]
                  ) -> list[str]:
    """Bind each of ``prefixes`` that lies below ``under`` (a tree the sandbox replaces, such
    as its own ``/tmp``) back in, then the masks inside them: after the binds, as
    :meth:`HostView.args`."""
    args: list[str] = []
    back = [p for p in prefixes if p.startswith(under)]
    for prefix in back:
        args += ro_bind_below(prefix, under)
    for mask in masked:
        if os.path.isdir(mask) and any(_is_under(mask, p) for p in back):
            args += ["--tmpfs", mask]
    return args


@functools.lru_cache(maxsize=8)
def host_binds(root: str, hide: tuple[str, ...], state_dir: str,
               expose: tuple[str, ...]) -> tuple[str, ...]:
    """bwrap arguments that rebuild ``root`` (the host's, or an image directory) read-only on
    a tmpfs, ``hide`` and the state dir covered, ``expose`` bound back below them."""
    args: list[str] = ["--tmpfs", "/"]
    for name in sorted(os.listdir(root)):
        if name in _SKIP_TOP:
            continue
        src = os.path.join(root, name)
        if os.path.islink(src):
            args += ["--symlink", os.readlink(src), "/" + name]
        elif os.path.isdir(src) or os.path.isfile(src):
            args += ["--ro-bind", src, "/" + name]
    args += ["--proc", "/proc", "--dev", "/dev"]
    hidden: list[str] = []
    for path in (*hide, state_dir):
        host = os.path.join(root, path.lstrip("/"))
        if os.path.isdir(host) and not os.path.islink(host):
            args += ["--tmpfs", path]
            hidden.append(path.rstrip("/") + "/")
    for path in expose:
        under = [h for h in hidden if (path + "/").startswith(h)]
        if under:
            args += ro_bind_below(path, under[0])
    return tuple(args)
