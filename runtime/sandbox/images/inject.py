"""What of the host an image sandbox needs, bound read-only at a private path, ``/.rollout``.

An image's root has its own ``/usr``, its own libc (or none: a busybox image), and maybe no
``bash`` and no ``setpriv``. The launch chain and the tools must work in any of them without
ever putting the host's ``/usr`` over the image's:

- ``/.rollout/lib``: the host's library directory with its dynamic loader. Host programs run
  inside as ``/.rollout/lib/ld-linux-*.so.* --library-path /.rollout/lib PROGRAM``: the loader
  is named explicitly, so the image's libc (another version, musl, or none) is never mixed in,
  and whatever the program execs afterwards is the image's own.
- ``/.rollout/bin/setpriv`` (root servers): the uid drop every launch ends with.
- ``/.rollout/bin/bash``: a static bash (Debian's ``bash-static``), last on ``PATH``, so the
  bash tool and ``exec("...")`` work in images without bash and the image's bash wins in the
  others.
- the server's interpreter (its venv and base installation) at its own host path, for the
  IPython kernel and the in-sandbox scripts, run through the host loader: the ``python`` tool
  works in every image, and its code sees the image's files. Only where that path does not
  exist in the image and is not below a system tree; otherwise (a venv of the system's
  ``/usr/bin/python3``, an interpreter in ``/opt`` of an image that has ``/opt/...``) the
  interpreter is bound at ``/.rollout/python`` instead (:func:`relocated_python`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

HELPER_DIR = "/.rollout"
LIB_IN = f"{HELPER_DIR}/lib"
BIN_IN = f"{HELPER_DIR}/bin"
PY_IN = f"{HELPER_DIR}/python"
_LOADERS = ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1",
            "/lib64/ld64.so.2", "/lib/ld64.so.1", "/lib/ld-linux-riscv64-lp64d.so.1",
            "/lib/ld-linux.so.2")
_STATIC_BASH = ("/bin/bash-static", "/usr/bin/bash-static")
_SYSTEM_TOPS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc",
                "/proc", "/dev", "/sys", "/tmp", "/var", "/opt")


@functools.lru_cache(maxsize=1)
def host_loader() -> tuple[str, str]:
    """(host directory of the dynamic loader and libc, the loader's file name)."""
    for cand in _LOADERS:
        if os.path.exists(cand):
            real = os.path.realpath(cand)
            return os.path.dirname(real), os.path.basename(real)
    raise FileNotFoundError("no dynamic loader found on the host (looked for "
                            + ", ".join(_LOADERS) + ")")


def loader_argv(library_path: str = LIB_IN) -> list[str]:
    """The prefix that runs a host program inside an image root."""
    _, name = host_loader()
    return [f"{LIB_IN}/{name}", "--library-path", library_path]


def static_bash() -> str | None:
    return next((p for p in _STATIC_BASH if os.path.isfile(p)), None)


def helper_binds(root_mode: bool, *, nested: bool = False) -> list[str]:
    """bwrap arguments that bind the helpers below ``/.rollout``; ``nested``: bwrap itself as
    well (a root server's image user runs in a second, unprivileged bwrap)."""
    libdir, _ = host_loader()
    args = ["--perms", "0755", "--dir", HELPER_DIR, "--perms", "0755", "--dir", BIN_IN,
            "--ro-bind", libdir, LIB_IN]
    if root_mode:
        setpriv = shutil.which("setpriv")
        if setpriv:
            args += ["--ro-bind", setpriv, f"{BIN_IN}/setpriv"]
        bwrap = shutil.which("bwrap")
        if nested and bwrap:
            args += ["--ro-bind", bwrap, f"{BIN_IN}/bwrap"]
    bash = static_bash()
    if bash:
        args += ["--ro-bind", bash, f"{BIN_IN}/bash"]
    return args


def python_binds(prefixes: tuple[str, ...], rootfs: Path) -> tuple[list[str], bool]:
    """(bwrap arguments binding the server's interpreter prefixes at their own paths, whether
    all of them could be bound): a prefix below a system tree, or one whose path the image
    has, is not bound (the image's files win)."""
    args: list[str] = []
    ok = True
    for prefix in prefixes:
        if prefix == "/" or any(prefix == t or prefix.startswith(t + "/") for t in _SYSTEM_TOPS):
            ok = False
            continue
        if os.path.lexists(os.path.join(rootfs, prefix.lstrip("/"))) or through_link(
                rootfs, prefix):
            ok = False
            continue
        parent = os.path.dirname(prefix)
        chain = []
        while parent != "/":
            chain.append(parent)
            parent = os.path.dirname(parent)
        for d in reversed(chain):
            if not os.path.lexists(os.path.join(rootfs, d.lstrip("/"))):
                args += ["--perms", "0755", "--dir", d]
        args += ["--ro-bind", prefix, prefix]
    return args, ok


@dataclass(frozen=True)
class Relocated:
    """The server's interpreter bound below ``/.rollout/python``: its bwrap arguments, the
    interpreter's path inside, and the library path its loader needs."""

    binds: tuple[str, ...]
    python: str
    library_path: str


@functools.lru_cache(maxsize=8)
def relocated_python(python: str, state_dir: str) -> Relocated | None:
    """The interpreter ``python`` (a venv's, or a base installation) at a path no image has:
    the base's binary and standard library at ``/.rollout/python/base/{bin,lib}`` (found there
    by CPython's own landmark search, ``lib/pythonX.Y/os.py`` beside ``bin/``), its shared
    ``libpythonX.Y`` if it has one, and for a venv ``/.rollout/python/venv`` with the venv's
    ``site-packages`` and a ``pyvenv.cfg`` whose ``home`` names the relocated base. None where
    the layout is not CPython's (then the image's own ``python3`` stands in, as before).
    Worked out once per process and interpreter, as :func:`view.python_prefixes` is: every
    image sandbox's creation asks (a restart picks up a changed venv)."""
    exe = os.path.abspath(python)
    real = os.path.realpath(exe)
    name = os.path.basename(real)
    if not re.fullmatch(r"python\d+\.\d+", name):
        return None
    base = os.path.dirname(os.path.dirname(real))
    stdlib = os.path.join(base, "lib", name)
    if not os.path.isfile(os.path.join(stdlib, "os.py")):
        return None
    home = f"{PY_IN}/base"
    args = ["--perms", "0755", "--dir", PY_IN, "--perms", "0755", "--dir", home,
            "--perms", "0755", "--dir", f"{home}/bin", "--perms", "0755", "--dir", f"{home}/lib",
            "--ro-bind", real, f"{home}/bin/{name}", "--ro-bind", stdlib, f"{home}/lib/{name}"]
    library_path = LIB_IN
    shared = sorted(n for n in _listdir(os.path.join(base, "lib"))
                    if n.startswith(f"lib{name}") and ".so" in n)
    for lib in shared:
        args += ["--ro-bind", os.path.join(base, "lib", lib), f"{home}/lib/{lib}"]
    if shared:
        library_path = f"{LIB_IN}:{home}/lib"
    venv = os.path.dirname(os.path.dirname(exe))
    cfg = os.path.join(venv, "pyvenv.cfg")
    site = os.path.join(venv, "lib", name, "site-packages")
    if not (os.path.isfile(cfg) and os.path.isdir(site)):
        return Relocated(tuple(args), f"{home}/bin/{name}", library_path)
    inside = f"{PY_IN}/venv"
    args += ["--perms", "0755", "--dir", inside, "--perms", "0755", "--dir", f"{inside}/bin",
             "--perms", "0755", "--dir", f"{inside}/lib", "--perms", "0755",
             "--dir", f"{inside}/lib/{name}",
             "--ro-bind", _venv_cfg(state_dir, cfg, f"{home}/bin"), f"{inside}/pyvenv.cfg",
             "--ro-bind", real, f"{inside}/bin/{name}",
             "--ro-bind", site, f"{inside}/lib/{name}/site-packages"]
    return Relocated(tuple(args), f"{inside}/bin/{name}", library_path)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _venv_cfg(state_dir: str, cfg: str, home: str) -> str:
    """A copy of the venv's ``pyvenv.cfg`` whose ``home`` is ``home``, below ``state_dir``
    (written once per process: :func:`relocated_python` is cached)."""
    with open(cfg, encoding="utf-8") as f:
        lines = [ln for ln in f.read().splitlines()
                 if ln.partition("=")[0].strip() not in ("home", "executable", "command")]
    os.makedirs(state_dir, exist_ok=True)
    for old in os.listdir(state_dir):  # a dead server's
        pid = old.removeprefix("sandbox-pyvenv.").partition(".")[0]
        if old.startswith("sandbox-pyvenv.") and pid.isdigit() and not os.path.exists(
                f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(state_dir, old))
    out = os.path.join(state_dir, f"sandbox-pyvenv.{os.getpid()}.{abs(hash((cfg, home))):x}")
    tmp = f"{out}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join([f"home = {home}", *lines]) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, out)
    return out


def through_link(rootfs: Path, path: str) -> bool:
    """Whether a parent of ``path`` is a symlink in the image (bwrap would follow it)."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts)):
        if os.path.islink(os.path.join(rootfs, *parts[:i])):
            return True
    return False


def image_path(image_env_path: str) -> str:
    """The ``PATH`` of an image sandbox: the image's own, with the static bash last."""
    base = image_env_path or "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return f"{base}:{BIN_IN}"


IMAGE_CAPS = ("CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_CHOWN")
"""What a root server's sandbox uid keeps in an image root (bwrap ``--cap-add``, then
setpriv's inheritable and ambient sets): the image's files belong to root, and a job must
be able to change them (its copy-on-write layer takes the change) as it would as the
image's root user. Nothing else: no CAP_SYS_ADMIN, no CAP_KILL, no CAP_SETUID once dropped;
every mount but the overlay is read-only or the sandbox's own, and seccomp still applies."""


def image_caps_args() -> list[str]:
    caps = ",".join("+" + c.removeprefix("CAP_").lower() for c in IMAGE_CAPS)
    return [f"--inh-caps=-all,{caps}", f"--ambient-caps={caps}"]
