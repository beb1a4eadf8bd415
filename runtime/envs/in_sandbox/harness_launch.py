"""Runs INSIDE a harness job's sandbox (standard library only): the way to the gateway, then
the harness.

The sandbox has a network namespace of its own with nothing but loopback, and the job's gateway
socket bound in as a file. Harnesses speak HTTP to a URL, not to a Unix socket, so this
listens on ``127.0.0.1:PORT`` of the sandbox's namespace and relays every connection, byte for
byte, to the socket. The relay and the harness share one launch (one network namespace: each
launch of a bwrap sandbox gets its own, so a relay started by another launch would be
unreachable) and one PID namespace, whose end kills everything the harness left behind.

Reads one JSON object on stdin: ``{"socket", "port", "argv", "env", "files", "cwd"}`` (and
``label``, how its lines name it: ``harness`` unless given); writes ``files`` (path -> text),
starts the relay, runs ``argv`` with ``env`` added to its own environment and exits with the
harness's status. A verifier with an allow-listed network runs through it too (the relay then
leads to the job's proxy: ``grading/network.py``).
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

_CHUNK = 65536
MAX_CONNECTIONS = 128
"""Connections relayed at once. Each holds two descriptors of the sandbox's RLIMIT_NOFILE,
which the harness shares; past this the relay stops accepting and the kernel's backlog holds
the rest until a slot frees."""
_BUFFER = 4 * _CHUNK
"""Bytes one direction of one connection holds for a slow reader before it stops reading."""
_CONNECT_TIMEOUT_S = 30.0


class _Pipe:
    """One relayed connection: the harness's TCP socket and the gateway's Unix socket, a
    bounded buffer towards each, and which directions have ended."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        self.outbox = {client: bytearray(), upstream: bytearray()}  # bytes to send TO it
        self.eof = {client: False, upstream: False}  # it sent all it will send
        self.shut = {client: False, upstream: False}  # it was told the peer's end

    def peer(self, sock: socket.socket) -> socket.socket:
        return self.upstream if sock is self.client else self.client

    def wants(self, sock: socket.socket) -> int:
        mask = 0
        if not self.eof[sock] and len(self.outbox[self.peer(sock)]) < _BUFFER:
            mask |= selectors.EVENT_READ
        if self.outbox[sock]:
            mask |= selectors.EVENT_WRITE
        return mask

    def done(self) -> bool:
        return all(self.shut.values())


class Relay:
    """``127.0.0.1:PORT`` -> the gateway's Unix socket: every connection relayed byte for byte
    by one thread with one selector (a thread per connection ran the sandbox out of its
    process limit in a burst, and the relay died for good). Half-closes pass through, so a
    client that finished sending still reads the whole answer."""

    def __init__(self, listener: socket.socket, path: str,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.listener, self.path, self.max_connections = listener, path, max_connections
        self.selector = selectors.DefaultSelector()
        self.pipes: dict[socket.socket, _Pipe] = {}
        self.masks: dict[socket.socket, int] = {}
        self.accepting = False
        listener.setblocking(False)

    def serve_forever(self) -> None:
        self._accepting(True)
        while True:
            for key, mask in self.selector.select():
                sock = key.fileobj
                if sock is self.listener:
                    self._accept()
                elif sock in self.pipes:  # not closed by an earlier event of this round
                    self._step(self.pipes[sock], sock, mask)  # type: ignore[index]

    def connections(self) -> int:
        return len(self.pipes) // 2

    def _accepting(self, on: bool) -> None:
        if on != self.accepting:
            if on:
                self.selector.register(self.listener, selectors.EVENT_READ)
            else:
                self.selector.unregister(self.listener)
            self.accepting = on

    def _accept(self) -> None:
        while self.connections() < self.max_connections:
            try:
                client, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno == errno.ECONNABORTED:
                    continue
                # Out of descriptors or memory: the rest wait in the backlog until a
                # connection closes (with none open, a moment).
                if self.pipes:
                    self._accepting(False)
                else:
                    time.sleep(0.05)
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.settimeout(_CONNECT_TIMEOUT_S)
                upstream.connect(self.path)
            except OSError:
                client.close()
                upstream.close()
                continue
            pipe = _Pipe(client, upstream)
            for sock in (client, upstream):
                sock.setblocking(False)
                self.pipes[sock] = pipe
                self.masks[sock] = 0
                self._update(pipe, sock)
        self._accepting(False)

    def _update(self, pipe: _Pipe, sock: socket.socket) -> None:
        want, had = pipe.wants(sock), self.masks[sock]
        if want != had:
            if not had:
                self.selector.register(sock, want)
            elif not want:
                self.selector.unregister(sock)
            else:
                self.selector.modify(sock, want)
            self.masks[sock] = want

    def _step(self, pipe: _Pipe, sock: socket.socket, mask: int) -> None:
        peer = pipe.peer(sock)
        try:
            if mask & selectors.EVENT_READ:
                data = sock.recv(_CHUNK)
                if data:
                    pipe.outbox[peer] += data
                else:
                    pipe.eof[sock] = True
            if mask & selectors.EVENT_WRITE and pipe.outbox[sock]:
                sent = sock.send(pipe.outbox[sock])
                del pipe.outbox[sock][:sent]
            for s in (sock, peer):
                # All of the other side's bytes delivered after its end: pass the end on.
                if pipe.eof[pipe.peer(s)] and not pipe.outbox[s] and not pipe.shut[s]:
                    pipe.shut[s] = True
                    s.shutdown(socket.SHUT_WR)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close(pipe)
            return
        if pipe.done():
            self._close(pipe)
            return
        self._update(pipe, sock)
        self._update(pipe, peer)

    def _close(self, pipe: _Pipe) -> None:
        for sock in (pipe.client, pipe.upstream):
            if self.masks.pop(sock, 0):
                self.selector.unregister(sock)
            self.pipes.pop(sock, None)
            sock.close()
        self._accepting(True)


def main() -> int:
    spec = json.loads(sys.stdin.buffer.read())
    for path, text in spec.get("files", {}).items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", int(spec["port"])))
    listener.listen(1024)
    relay = Relay(listener, spec["socket"])
    threading.Thread(target=relay.serve_forever, name="relay", daemon=True).start()
    env = dict(os.environ)
    env.update(spec.get("env", {}))
    label = spec.get("label", "harness")
    print(f"[{label}] relay 127.0.0.1:{spec['port']} -> {spec['socket']}; running "
          f"{spec['argv'][0]}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.Popen(spec["argv"], env=env, cwd=spec.get("cwd") or None,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        print(f"[{label}] cannot start {spec['argv'][0]}: {e}", file=sys.stderr, flush=True)
        return 127
    code = proc.wait()
    # What the harness left in its own session goes with it; the end of this launch's PID
    # namespace takes the rest.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    print(f"[{label}] exited with {code}", file=sys.stderr, flush=True)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
