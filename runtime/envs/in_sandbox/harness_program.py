"""Whether a harness's program can start in this sandbox's root, checked from inside it (stdlib
only; run by the harness environment's INIT in an image sandbox, read as text, never
imported).

argv[1:] is the harness command. Its program is the first word after ``env`` (with its options
and ``NAME=value`` words) or ``exec``; a bare name is looked up on this sandbox's ``PATH`` as
the kernel's exec would. Prints one JSON object: ``{}``
when the kernel can start it as far as a look at the file can tell, else ``{"missing": PATH,
"needed_by": WHAT}``: the program itself, the dynamic loader its ELF header names
(``PT_INTERP``: glibc's ``/lib64/ld-linux-x86-64.so.2`` for most Linux programs, which a
busybox or musl image does not have), or the interpreter its ``#!`` line names. Paths resolve
in the sandbox's own root, so a symlink out of the harness's install is followed as the
kernel will follow it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from typing import BinaryIO

PT_INTERP = 3


def elf_interpreter(f: BinaryIO, head: bytes) -> str:
    """The PT_INTERP path of an ELF file ('' when it has none: a static program)."""
    wide, little = head[4] == 2, head[5] == 1
    order = "<" if little else ">"
    if wide:
        phoff, = struct.unpack_from(order + "Q", head, 32)
        phentsize, phnum = struct.unpack_from(order + "HH", head, 54)
    else:
        phoff, = struct.unpack_from(order + "I", head, 28)
        phentsize, phnum = struct.unpack_from(order + "HH", head, 42)
    for i in range(min(phnum, 256)):
        f.seek(phoff + i * phentsize)
        entry = f.read(phentsize)
        if len(entry) < phentsize or struct.unpack_from(order + "I", entry, 0)[0] != PT_INTERP:
            continue
        if wide:
            offset, = struct.unpack_from(order + "Q", entry, 8)
            size, = struct.unpack_from(order + "Q", entry, 32)
        else:
            offset, = struct.unpack_from(order + "I", entry, 4)
            size, = struct.unpack_from(order + "I", entry, 16)
        f.seek(offset)
        return f.read(min(size, 4096)).split(b"\0", 1)[0].decode("utf-8", "replace")
    return ""


ENV_OPTIONS_WITH_VALUE = {"-u", "--unset", "-C", "--chdir", "-S", "--split-string"}


def program_of(words: list[str]) -> str:
    """The program a command starts: past ``exec``, ``env`` and its options, and ``NAME=value``
    words; a bare name resolved on ``PATH`` (returned as given when it is not found, so the
    caller reports the command itself)."""
    i = 0
    while i < len(words):
        word = words[i]
        if word in ("exec", "env", "/usr/bin/env", "/bin/env"):
            i += 1
        elif word in ENV_OPTIONS_WITH_VALUE:
            i += 2
        elif (word.startswith("-") and i > 0) or ("=" in word and not word.startswith("/")
                                                    and word.split("=", 1)[0].isidentifier()):
            i += 1
        else:
            break
    program = words[i] if i < len(words) else ""
    if program and "/" not in program:
        return shutil.which(program) or program
    return program


def main() -> None:
    program = program_of(sys.argv[1:])
    if not program or "{" in program:
        print("{}")
        return
    try:
        with open(program, "rb") as f:
            head = f.read(512)
            if head[:4] == b"\x7fELF" and len(head) >= 64:
                needed = elf_interpreter(f, head)
            elif head[:2] == b"#!":
                words = head[2:].split(b"\n", 1)[0].split()
                needed = words[0].decode("utf-8", "replace") if words else ""
            else:
                needed = ""
    except OSError:
        print(json.dumps({"missing": program, "needed_by": "the harness command"}))
        return
    if needed and not os.path.exists(needed):
        print(json.dumps({"missing": needed, "needed_by": program}))
        return
    print("{}")


main()
