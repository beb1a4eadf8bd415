"""Run by a rootless server inside an image sandbox's mapped user namespace (as its root, the
server's own user), before the sandbox's first launch and at its teardown: ownership there
can name the image's uids, which the server cannot chown to from outside.

Reads one JSON object on stdin:
- ``chown``: [path, uid, gid] the image's layers gave an owner (never followed: a link
  itself keeps its owner);
- ``dirs``: [path, uid, gid] directories to create (0755) when missing, then chown;
- ``trees``: [path, uid, gid] host folders bound into the sandbox (its workspace, a Harbor
  task's ``/logs/verifier``) chowned with all they hold (a missing one counts as failed);
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
        failed += tree(top, uid, gid)
    print(failed)


def tree(top, uid, gid):
    """Chown ``top`` and all below it; directories are opened relative to their parent's fd
    without following links, so a link in place of a directory cannot lead the walk out."""
    failed = 0
    try:
        os.chown(top, uid, gid, follow_symlinks=False)
    except OSError:
        return 1
    if os.path.islink(top) or not os.path.isdir(top):
        return 0
    for _, dirs, files, dfd in os.fwalk(top, follow_symlinks=False):
        for name in dirs + files:
            try:
                os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                failed += 1
    return failed


main()
