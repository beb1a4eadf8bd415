"""Run inside a Harbor job's sandboxes (standard library only) to hand a separate verifier the
task's artifacts, as Harbor's separate verifier mode does: regular files (alone or in folders)
copied out of the agent's sandbox at their absolute paths, and put back at the same paths in
the verifier's fresh sandbox. Nothing else of the agent's environment reaches the verifier.

    harbor_artifacts.py collect DEST MAX_BYTES MAX_ENTRIES PATH...
    harbor_artifacts.py restore SRC [ROOT]

``collect`` runs in the agent's sandbox once every process of the agent is gone and writes
``DEST/<path>`` for each ``PATH`` (a missing one is skipped, as Harbor skips it). Links are
never followed below a path and a path that is itself a link is skipped (Harbor takes regular
files and folders of them); FIFOs, sockets and devices are skipped; modes keep their
permission bits only (no setuid). Past ``MAX_BYTES`` or ``MAX_ENTRIES`` it stops with exit 3:
``DEST`` is a host folder, and what a policy left must not fill the host's disk; a tree
deeper than ``MAX_DEPTH`` below its path stops it the same way (the server walks the copy).
``restore`` runs in the verifier's sandbox and copies ``SRC``'s tree to ``/`` (or ``ROOT``).
Each prints one JSON line: ``{"files": N, "bytes": N, "skipped": [...]}`` or
``{"error": "..."}``.
"""

import json
import os
import stat
import sys

CHUNK = 1 << 20
MAX_DEPTH = 64


class Budget(Exception):
    pass


def _copy_file(src, dst, mode, budget):
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    fd_in = os.open(src, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd_in).st_mode):
            return 0  # swapped for something else since the walk saw it
        if os.path.islink(dst):
            os.unlink(dst)
        fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0),
                         0o600)
        copied = 0
        try:
            while True:
                data = os.read(fd_in, CHUNK)
                if not data:
                    break
                budget["bytes"] -= len(data)
                if budget["bytes"] < 0:
                    raise Budget("the artifacts are over the size this server hands a verifier")
                os.write(fd_out, data)
                copied += len(data)
            os.fchmod(fd_out, mode & 0o777)
        finally:
            os.close(fd_out)
        return copied
    finally:
        os.close(fd_in)


def _entry(budget):
    budget["entries"] -= 1
    if budget["entries"] < 0:
        raise Budget("the artifacts hold more files than this server hands a verifier")


def copy_tree(src, dst, budget, skipped):
    """Copy ``src`` (a regular file or a folder) to ``dst``; returns (files, bytes)."""
    st = os.lstat(src)
    if stat.S_ISREG(st.st_mode):
        _entry(budget)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        return 1, _copy_file(src, dst, st.st_mode, budget)
    if not stat.S_ISDIR(st.st_mode):
        skipped.append(src)
        return 0, 0
    files = size = 0
    for dirpath, dirnames, filenames in os.walk(src, followlinks=False):
        rel = os.path.relpath(dirpath, src)
        if rel.count(os.sep) >= MAX_DEPTH:
            raise Budget(f"an artifact's folders nest deeper than {MAX_DEPTH} levels")
        target = os.path.normpath(os.path.join(dst, rel))
        _entry(budget)
        os.makedirs(target, exist_ok=True)
        for name in list(dirnames):
            if os.path.islink(os.path.join(dirpath, name)):
                skipped.append(os.path.join(dirpath, name))
                dirnames.remove(name)
        for name in filenames:
            path = os.path.join(dirpath, name)
            mode = os.lstat(path).st_mode
            if not stat.S_ISREG(mode):
                skipped.append(path)
                continue
            _entry(budget)
            files += 1
            size += _copy_file(path, os.path.join(target, name), mode, budget)
    return files, size


def main(argv):
    skipped = []
    try:
        if argv[0] == "collect":
            dest, budget = argv[1], {"bytes": int(argv[2]), "entries": int(argv[3])}
            files = size = 0
            for path in argv[4:]:
                path = os.path.normpath(path)
                if not os.path.isabs(path) or not os.path.lexists(path):
                    continue
                if os.path.islink(path):
                    skipped.append(path)
                    continue
                got = copy_tree(path, os.path.join(dest, path.lstrip("/")), budget, skipped)
                files, size = files + got[0], size + got[1]
        else:
            src, budget = argv[1], {"bytes": 1 << 62, "entries": 1 << 62}
            root = argv[2] if len(argv) > 2 else "/"
            files = size = 0
            for name in sorted(os.listdir(src)):
                got = copy_tree(os.path.join(src, name), os.path.join(root, name), budget,
                                skipped)
                files, size = files + got[0], size + got[1]
    except Budget as e:
        print(json.dumps({"error": str(e)}))
        return 3
    except OSError as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 2
    print(json.dumps({"files": files, "bytes": size, "skipped": skipped[:50]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
