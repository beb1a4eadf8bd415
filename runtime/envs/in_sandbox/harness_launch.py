"""Runs INSIDE a harness job's sandbox (standard library only): the way to the gateway, then
the harness.

The sandbox has a network namespace of its own with nothing but loopback, and the job's gateway
socket bound in as a file. Harnesses speak HTTP to a URL, not to a Unix socket, so this
listens on ``127.0.0.1:PORT`` of the sandbox's namespace and relays every connection, byte for
byte, to the socket. The relay and the harness share one launch (one network namespace: each
launch of a bwrap sandbox gets its own, so a relay started by another launch would be
unreachable) and one PID namespace, whose end kills everything the harness left behind.

Reads one JSON object on stdin: ``{"socket", "port", "argv", "env", "files", "cwd"}``; writes
``files`` (path -> text), starts the relay, runs ``argv`` with ``env`` added to its own
environment and exits with the harness's status.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

_CHUNK = 65536


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(_CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        # Half-close, so a client that finished sending still reads the whole answer.
        for sock, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                sock.shutdown(how)
            except OSError:
                pass


def _serve(listener: socket.socket, path: str) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(path)
        except OSError:
            client.close()
            upstream.close()
            continue
        pair = [
            threading.Thread(target=_pump, args=(client, upstream), daemon=True),
            threading.Thread(target=_pump, args=(upstream, client), daemon=True),
        ]
        for t in pair:
            t.start()
        threading.Thread(target=_close_after, args=(pair, client, upstream), daemon=True).start()


def _close_after(pumps: list[threading.Thread], *socks: socket.socket) -> None:
    for t in pumps:
        t.join()
    for s in socks:
        s.close()


def main() -> int:
    spec = json.loads(sys.stdin.buffer.read())
    for path, text in spec.get("files", {}).items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", int(spec["port"])))
    listener.listen(64)
    threading.Thread(target=_serve, args=(listener, spec["socket"]), daemon=True).start()
    env = dict(os.environ)
    env.update(spec.get("env", {}))
    print(f"[harness] relay 127.0.0.1:{spec['port']} -> {spec['socket']}; running "
          f"{spec['argv'][0]}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.Popen(spec["argv"], env=env, cwd=spec.get("cwd") or None,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        print(f"[harness] cannot start {spec['argv'][0]}: {e}", file=sys.stderr, flush=True)
        return 127
    code = proc.wait()
    # What the harness left in its own session goes with it; the end of this launch's PID
    # namespace takes the rest.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    print(f"[harness] exited with {code}", file=sys.stderr, flush=True)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
