"""The inside half of a rootless server's confined build network (standard library only: run
by path with the server's interpreter, ``python -I -S netns_listen.py CTRL PORT... -- ARGV``,
never imported by the package).

A process that is not root cannot ``setns`` into a network namespace (the kernel wants
``CAP_SYS_ADMIN`` in the caller's own user namespace too), so the listening sockets of the
build's proxy cannot be made from outside as a root server makes them. This script makes
them from inside:

1. moves into a new user, network and mount namespace (``unshare(2)`` itself: the capabilities it
   gets there would be lost by an ``execve`` while its uid is not yet mapped, which is why it is
   not started by ``unshare(1)``), says ``mapme`` on the control socket ``CTRL`` (an inherited
   descriptor) and waits for ``go``: meanwhile the server writes the user namespace's maps with
   ``newuidmap`` / ``newgidmap`` (0 the server's user, 1.. its subordinate ranges, as rootless
   buildah maps its own namespace), so this process is root in a namespace that owns its
   network;
2. brings the namespace's loopback up and listens on ``127.0.0.1:PORT`` for each ``PORT``;
3. sends those listening sockets to the server over ``CTRL`` (``SCM_RIGHTS``) and waits for
   ``run``: the server serves them from its own network (the allow-listing proxy, the
   forwarded loopback registry);
4. closes its copies and becomes ``ARGV`` (buildah), whose only exits are those sockets.

Exit status 97: a step failed (the reason is on stderr, which is the build log).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import sys

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = "16sH14x"
_NAMESPACES = 0x10000000 | 0x40000000 | 0x00020000
"""CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS."""


def _expect(ctrl: socket.socket, word: bytes) -> None:
    got = b""
    while not got.endswith(b"\n"):
        chunk = ctrl.recv(64)
        if not chunk:
            raise OSError(f"the server went away before {word.decode()!r}")
        got += chunk
    if got.strip() != word:
        raise OSError(f"expected {word.decode()!r} from the server, got {got!r}")


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack(_IFREQ, b"lo", 0)
        flags = struct.unpack(_IFREQ, fcntl.ioctl(s, _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


def main(args: list[str]) -> int:
    split = args.index("--")
    ctrl_fd, ports, argv = int(args[0]), [int(p) for p in args[1:split]], args[split + 1:]
    ctrl = socket.socket(fileno=ctrl_fd)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(_NAMESPACES) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"unshare: {os.strerror(err)}")
        ctrl.sendall(b"mapme\n")
        _expect(ctrl, b"go")
        _loopback_up()
        listeners = []
        for port in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(128)
            listeners.append(sock)
        socket.send_fds(ctrl, [b"fds\n"], [s.fileno() for s in listeners])
        _expect(ctrl, b"run")
        for sock in listeners:
            sock.close()
        ctrl.close()
    except OSError as e:
        print(f"rollout build network (rootless): {e}", file=sys.stderr, flush=True)
        return 97
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
