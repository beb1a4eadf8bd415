"""Run by a rootless server inside an image sandbox's mapped user namespace (as its root),
appended to the source of ``runtime/sandbox/hostfs.py``: one workspace file written or
removed with hostfs's own rules (no link followed on the way, regular files only), where the
workspace belongs to an image user the server cannot write for from outside.

Reads one JSON object on stdin: ``op`` ("write" or "unlink"), ``root``, ``rel``, and for a
write ``data`` (base64), ``mode`` and ``owner`` ([uid, gid], also of the folders it makes).
Prints ``{}`` or ``{"error": [type name, errno, message]}``.
"""

import base64 as _base64
import json as _json
import sys as _sys


def _main():
    hostfs = globals()  # hostfs's source precedes this file's text when it runs
    job = _json.loads(_sys.stdin.read())
    root = hostfs["Path"](job["root"])
    try:
        if job["op"] == "write":
            hostfs["write_beneath"](root, job["rel"], _base64.b64decode(job["data"]),
                                    job["mode"], tuple(job["owner"]))
        else:
            hostfs["unlink_beneath"](root, job["rel"])
    except OSError as e:
        print(_json.dumps({"error": [type(e).__name__, e.errno, str(e)]}))
        return
    print("{}")


_main()
