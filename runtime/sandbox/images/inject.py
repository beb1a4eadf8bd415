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
  IPython kernel, run through the host loader: the ``python`` tool works in every image, and
  its code sees the image's files. Only where that path does not exist in the image; never
  below a system tree.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

HELPER_DIR = "/.rollout"
LIB_IN = f"{HELPER_DIR}/lib"
BIN_IN = f"{HELPER_DIR}/bin"
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


def loader_argv() -> list[str]:
    """The prefix that runs a host program inside an image root."""
    _, name = host_loader()
    return [f"{LIB_IN}/{name}", "--library-path", LIB_IN]


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
