"""Makes an installed harness carry its own C runtime (run by scripts/setup_harnesses.sh).

A harness's native programs (Claude Code's and OpenCode's Bun executables, a Python harness's
interpreter and extension modules) need the host's glibc and, for Python, its libssl, libffi
and friends. A job whose sandbox runs a task's own image has another /lib, or none that fits.
So the set-up copies every shared library those programs load from outside the install into
``<install>/runtime/lib`` (the dynamic loader included) and rewrites the entry programs to use
that loader and directory where the install is bound in every sandbox
(``/.rollout-harness``). The libraries' search path is the entry program's DT_RPATH, which
glibc also applies to what the program loads later (extension modules), and which no child
process inherits: the shell a harness starts is the image's own.

    python3 scripts/harness_runtime.py INSTALL_DIR MOUNT PATCHELF ENTRY:ARG...

ENTRY: programs (relative to INSTALL_DIR) to rewrite; ARG: an argument with which each must
then start and exit 0 in a bubblewrap root that holds nothing but the install at MOUNT (no
/usr, no /lib): the proof that it needs nothing of an image. After this they run only where
the install is bound at MOUNT.

patchelf (0.14 to 0.17) writes some Bun executables that crash at start, depending on the
length of what it inserts; the check catches that, and a search lengthens the search path by a
no-op ``/.`` at a time until the program starts.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

_LDD_LINE = re.compile(r"^\s*(\S+)\s+=>\s+(/\S+)\s+\(0x[0-9a-f]+\)$|^\s*(/\S+)\s+\(0x[0-9a-f]+\)$")
PRELOAD = ("libstdc++.so.6", "libgcc_s.so.1")
"""Loaded with the entry program when bundled: an extension module whose own RUNPATH (a
wheel's ``$ORIGIN/../x.libs``) hides the entry's search path still finds them, by name, as
already loaded."""


def is_elf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def dependencies(path: Path) -> dict[str, str]:
    """soname -> host path of what ``path`` loads (the loader under its own path)."""
    out = subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=False)
    found: dict[str, str] = {}
    for line in out.stdout.splitlines():
        m = _LDD_LINE.match(line)
        if m is None:
            continue
        if m.group(3):  # the loader: "/lib64/ld-linux-x86-64.so.2 (0x...)"
            found[os.path.basename(m.group(3))] = m.group(3)
        else:
            found[m.group(1)] = m.group(2)
    return found


PADS = 16


def starts_alone(root: Path, mount: str, program: str, args: str) -> bool:
    """Whether ``program args`` exits 0 where the root holds only the install at ``mount``."""
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--tmpfs", "/", "--ro-bind",
            str(root), mount, "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--setenv", "HOME", "/tmp", program, *shlex.split(args)]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def local_search_path(path: Path, root: Path, patchelf: str) -> None:
    """Drop the host directories from a library's own search path (a pyenv build names its
    prefix in every extension module): a library with one ignores the entry program's, and
    would look for libssl where the host had it."""
    own = subprocess.run([patchelf, "--print-rpath", str(path)], capture_output=True,
                         text=True, check=False).stdout.strip()
    if not own:
        return
    keep = [p for p in own.split(":") if p.startswith("$ORIGIN")
            or os.path.realpath(p).startswith(str(root) + os.sep)]
    if keep == own.split(":"):
        return
    if keep:
        subprocess.run([patchelf, "--set-rpath", ":".join(keep), str(path)], check=True)
    else:
        subprocess.run([patchelf, "--remove-rpath", str(path)], check=True)


def main() -> int:
    install, mount, patchelf, *entries = sys.argv[1:]
    root = Path(install).resolve()
    lib = root / "runtime" / "lib"
    lib.mkdir(parents=True, exist_ok=True)
    needed: dict[str, str] = {}
    elves = [Path(d) / n for d, _, names in os.walk(root) for n in names
             if not (Path(d) / n).is_symlink() and is_elf(Path(d) / n)]
    for path in elves:
        for soname, host in dependencies(path).items():
            if not os.path.realpath(host).startswith(str(root) + os.sep):
                needed.setdefault(soname, host)
    loader = next((s for s in needed if s.startswith("ld-linux")), None)
    if loader is None:
        print(f"harness_runtime: no dynamic loader among {sorted(needed)}", file=sys.stderr)
        return 1
    for soname, host in needed.items():
        shutil.copy2(os.path.realpath(host), lib / soname)
    for path in elves:
        local_search_path(path, root, patchelf)
    inside = f"{mount}/runtime/lib"
    for spec in entries:
        entry, _, check = spec.partition(":")
        exe = root / entry
        original = exe.with_name(exe.name + ".orig")
        shutil.copy2(exe, original)
        own = subprocess.run([patchelf, "--print-rpath", str(exe)], capture_output=True,
                             text=True, check=True).stdout.strip()
        has = subprocess.run([patchelf, "--print-needed", str(exe)], capture_output=True,
                             text=True, check=True).stdout.split()
        for pad in range(PADS):
            rpath = ":".join([inside + "/." * pad, *(p for p in own.split(":") if p)])
            preload = [n for n in PRELOAD if n in needed and n not in has]
            shutil.copy2(original, exe)
            if preload:  # a call of its own: with --set-rpath, 0.14 writes a wrong path
                subprocess.run([patchelf, *(a for n in preload for a in ("--add-needed", n)),
                                str(exe)], check=True)
            subprocess.run([patchelf, "--set-interpreter", f"{inside}/{loader}",
                            "--force-rpath", "--set-rpath", rpath, str(exe)], check=True)
            if starts_alone(root, mount, f"{mount}/{entry}", check):
                break
        else:
            print(f"harness_runtime: {entry} does not start with its own runtime",
                  file=sys.stderr)
            return 1
        original.unlink()
    print(f"harness_runtime: {len(needed)} libraries in {lib}; {', '.join(entries)} rewritten "
          f"for {mount}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
