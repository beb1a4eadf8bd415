"""The command of a parked launch (the sandbox pool's warm sandboxes): it waits on stdin for
the real command and execs it, so the launch chain (prlimit, bwrap's namespaces and mounts,
seccomp, setpriv) has already run when a job asks for its first command.

Writes ``R`` to the file descriptor named by its argument (then closes it) once it is up;
reads one length line, then that many bytes of JSON ``{"argv", "env", "cwd"}``; what follows
on stdin is the command's own stdin. Run with ``python -I -S -c`` (standard library only, read
as text by ``runtime/sandbox/bwrap.py``). Its own ``ROLLOUT_LAUNCH`` stays in the command's
environment, as every launch has it. Exit 127 when the command cannot be started, as bash does.
"""

import json
import os
import sys


def read_exact(n):
    chunks = []
    while n > 0:
        chunk = os.read(0, n)
        if not chunk:
            sys.exit(0)  # the pool closed the pipe: the sandbox goes without a command
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def main():
    if len(sys.argv) > 1:  # the pool's readiness pipe: up and about to wait
        ready = int(sys.argv[1])
        os.write(ready, b"R")
        os.close(ready)
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(0, 1)
        if not byte:
            sys.exit(0)
        line += byte
    request = json.loads(read_exact(int(line)))
    env = dict(request["env"])
    if "ROLLOUT_LAUNCH" in os.environ:
        env["ROLLOUT_LAUNCH"] = os.environ["ROLLOUT_LAUNCH"]
    argv = request["argv"]
    try:
        if request["cwd"]:
            os.chdir(request["cwd"])
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        os.write(2, f"{argv[0]}: {e.strerror}\n".encode())
        os._exit(127 if isinstance(e, FileNotFoundError) else 126)


main()
