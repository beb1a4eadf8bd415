"""Gives a harness executable that survives no rewrite of its ELF layout its own C runtime, by
changing bytes in place only (run by scripts/setup_harnesses.sh for Claude Code).

Claude Code's Bun executable crashes at start after any patchelf rewrite (a new interpreter
path or search path moves its sections, and Bun finds its embedded program by offsets in its
own file). Changing its PT_INTERP string *in place* works when the new path fits the old one's
bytes, and glibc's loader has nothing else to rewrite: its built-in library directories and
cache path are strings too. So:

- the libraries the program loads are copied into ``<install>/runtime/lib`` (as
  scripts/harness_runtime.py does), reachable as ``<install>/rt``;
- a private copy of the loader, ``<install>/runtime/ld.so`` (reachable as ``<install>/ld.so``),
  gets its multiarch directories (``/lib/<triplet>/``, ``/usr/lib/<triplet>/``) overwritten by
  ``MOUNT//rt/`` padded with slashes to the same length, and its cache path
  ``/etc/ld.so.cache`` by ``/proc/-/ld.cache``, which no sandbox has (an image's cache would
  name its own libc);
- the entry's PT_INTERP becomes ``MOUNT/ld.so``, NUL-padded in place.

The directories a child process searches are its own loader's: nothing is inherited (no
environment variable), so the shell a harness starts is the image's. An image that sets
LD_LIBRARY_PATH would come before the private directories (the loader searches it first).

    python3 scripts/harness_loader.py INSTALL_DIR MOUNT ENTRY:ARG...

ARG: an argument with which ENTRY must then start and exit 0 in a bubblewrap root holding only
the install at MOUNT (the proof that it needs nothing of an image).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import sys
from pathlib import Path

PT_INTERP = 3
NO_CACHE = b"/proc/-/ld.cache"
"""Where the private loader looks for a library cache: /proc never holds ``-``."""


def _runtime_module():  # type: ignore[no-untyped-def]
    """scripts/harness_runtime.py (a script, not a package module), for its ldd and the
    bubblewrap start check."""
    spec = importlib.util.spec_from_file_location(
        "harness_runtime", Path(__file__).with_name("harness_runtime.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def interp_slot(path: Path) -> tuple[int, int]:
    """File offset and size (NUL included) of an ELF64 little-endian program's PT_INTERP."""
    with path.open("rb") as f:
        head = f.read(64)
        if head[:6] != b"\x7fELF\x02\x01":
            raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
        phoff, = struct.unpack_from("<Q", head, 0x20)
        entsize, count = struct.unpack_from("<HH", head, 0x36)
        for i in range(count):
            f.seek(phoff + i * entsize)
            ph = f.read(entsize)
            kind, = struct.unpack_from("<I", ph, 0)
            if kind == PT_INTERP:
                offset, = struct.unpack_from("<Q", ph, 8)
                size, = struct.unpack_from("<Q", ph, 32)
                return offset, size
    raise ValueError(f"{path} has no program interpreter")


def same_length(mount: str, length: int) -> bytes:
    """``MOUNT/rt/`` with slashes after the mount until it is ``length`` bytes long."""
    path = f"{mount}/rt/"
    if len(path) > length:
        raise ValueError(f"{path!r} is longer than the loader's directory ({length} bytes)")
    return f"{mount}{'/' * (length - len(path) + 1)}rt/".encode()


def private_loader(host_loader: str, target: Path, mount: str) -> None:
    """A copy of the host's loader whose built-in directories are the install's."""
    data = bytearray(Path(os.path.realpath(host_loader)).read_bytes())
    triplet_dir = os.path.dirname(os.path.realpath(host_loader))  # /usr/lib/x86_64-linux-gnu
    triplet = os.path.basename(triplet_dir)
    replaced = 0
    for old in (f"/usr/lib/{triplet}/".encode(), f"/lib/{triplet}/".encode()):
        new = same_length(mount, len(old))
        start = 0
        while (at := data.find(old + b"\0", start)) != -1:
            data[at:at + len(old)] = new
            replaced += 1
            start = at + len(new)
    cache = b"/etc/ld.so.cache\0"
    at = data.find(cache)
    if replaced == 0 or at == -1:
        raise ValueError(f"{host_loader}: its library directories or cache path not found")
    data[at:at + len(cache)] = NO_CACHE + b"\0"
    target.write_bytes(bytes(data))
    target.chmod(0o755)


def main() -> int:
    install, mount, *entries = sys.argv[1:]
    runtime = _runtime_module()
    root = Path(install).resolve()
    lib = root / "runtime" / "lib"
    lib.mkdir(parents=True, exist_ok=True)
    programs = [(root / spec.partition(":")[0], spec.partition(":")[2]) for spec in entries]
    needed: dict[str, str] = {}
    for exe, _ in programs:
        for soname, host in runtime.dependencies(exe).items():
            if not os.path.realpath(host).startswith(str(root) + os.sep):
                needed.setdefault(soname, host)
    loader = next((s for s in needed if s.startswith("ld-linux")), None)
    if loader is None:
        print(f"harness_loader: no dynamic loader among {sorted(needed)}", file=sys.stderr)
        return 1
    for soname, host in needed.items():
        shutil.copy2(os.path.realpath(host), lib / soname)
    private_loader(needed[loader], root / "runtime" / "ld.so", mount)
    for name, target in (("rt", "runtime/lib"), ("ld.so", "runtime/ld.so")):
        link = root / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    interpreter = f"{mount}/ld.so".encode()
    for exe, check in programs:
        offset, size = interp_slot(exe)
        if len(interpreter) >= size:
            print(f"harness_loader: {interpreter!r} does not fit {exe}'s interpreter ({size} "
                  "bytes)", file=sys.stderr)
            return 1
        with exe.open("r+b") as f:
            f.seek(offset)
            f.write(interpreter + b"\0" * (size - len(interpreter)))
        if not runtime.starts_alone(root, mount, f"{mount}/{exe.relative_to(root)}", check):
            print(f"harness_loader: {exe} does not start with its own runtime", file=sys.stderr)
            return 1
    print(f"harness_loader: {len(needed)} libraries in {lib}; {', '.join(entries)} use "
          f"{mount}/ld.so")
    return 0


if __name__ == "__main__":
    sys.exit(main())
