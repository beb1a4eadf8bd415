"""Run by a rootless server inside an image sandbox's mapped user namespace (as its root, the
server's own user), before the sandbox's first launch and at its teardown: ownership there
can name the image's uids, which the server cannot chown to from outside.

Reads one JSON object on stdin:
- ``chown``: [path, uid, gid] the image's layers gave an owner (never followed: a link
  itself keeps its owner);
- ``dirs``: [path, uid, gid] directories to create (0755) when missing, then chown;
- ``trees``: [path, uid, gid] host folders of the sandbox (its workspace) chowned with all
  they hold;
- ``remove``: folders to delete (teardown: what the image's users own there cannot be
  removed by the server outside the namespace).
Prints the number of paths it could not change. Run with ``python -I -S -c`` (standard
library only, read as text by ``runtime/sandbox/bwrap.py``).
"""

import json
import os
import shutil
import sys


def main():
    job = json.loads(sys.stdin.read())
    failed = 0
    for path in job.get("remove", ()):
        shutil.rmtree(path, ignore_errors=True)
    for path, uid, gid in job.get("dirs", ()):
        try:
            if not os.path.lexists(path):
                os.mkdir(path, 0o755)
            if os.path.isdir(path) and not os.path.islink(path):
                os.chown(path, uid, gid, follow_symlinks=False)
        except OSError:
            failed += 1
    for path, uid, gid in job.get("chown", ()):
        try:
            os.chown(path, uid, gid, follow_symlinks=False)
        except OSError:
            failed += 1
    for top, uid, gid in job.get("trees", ()):
        for dirpath, dirnames, filenames in os.walk(top):
            for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                try:
                    os.chown(name, uid, gid, follow_symlinks=False)
                except OSError:
                    failed += 1
    print(failed)


main()
