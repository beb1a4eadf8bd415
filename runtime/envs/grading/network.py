"""A verifier's way out: one command of a sandbox run behind an allow-listing HTTP(S) proxy.

A sandbox has no network (its network namespace holds only a loopback), and the policy's
commands never get one. But a task's verifier is the task author's code, and many install
their test tools when they run: Harbor's own tasks start ``tests/test.sh`` with
``curl ... astral.sh/uv/install.sh | sh`` and ``uvx pytest``, or ``pip install pytest``. With
the server's ``sandbox.verifier_hosts`` those commands reach the hosts listed there, and
nothing else:

- on the host, :class:`~rollout.runtime.sandbox.images.egress.AllowListProxy` (the one the
  build network uses) serves a Unix socket of the job's own folder; it connects only to the
  listed hosts (never to this machine's own addresses unless a listed entry names one) and
  answers every other request with ``403``, naming the host and the setting;
- inside, the verifier's launch (its own network namespace, as every launch has) runs
  ``in_sandbox/harness_launch.py`` with the server's interpreter (``-I``): it relays
  ``127.0.0.1:3128`` to that socket, bound into this launch alone at a name nobody could
  plant, and runs the command with ``HTTP_PROXY`` / ``HTTPS_PROXY`` (and the lower-case
  spellings) pointing there, which ``curl``, ``pip``, ``uv`` and Python's ``urllib`` honour.
  A program that ignores them has no route anywhere.

With no hosts listed the proxy still runs (for a task that does not set ``allow_internet =
false``) and refuses everything: the reward's info then names each host the verifier tried,
which is what to add to ``sandbox.verifier_hosts`` (``rollout tasks check-harbor`` prints it).
Only the verifier's own launch gets the relay: the agent's processes are gone by then (they
end with RUN), and nothing started in that launch outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.runtime.envs.common import IN_SANDBOX
from rollout.runtime.sandbox.base import python_argv
from rollout.runtime.sandbox.images.egress import (
    HEAD_LIMIT,
    AllowList,
    AllowListProxy,
    proxy_env,
)

SETTING = "sandbox.verifier_hosts"
PORT = 3128
"""The proxy's port on the launch's own loopback (squid's, which tools' docs use)."""
LAUNCH_SOURCE = IN_SANDBOX / "harness_launch.py"
MAX_SOCKET_PATH = 100
"""``sun_path`` holds 108 bytes; a longer socket path goes to a fresh folder under /tmp."""


@dataclass
class NetworkRun:
    """What :func:`exec_networked` ran: the command's result and the hosts refused."""

    run: Any
    refused: tuple[str, ...]
    """``host:port`` of every request the allow-list refused, first time each, in order."""
    failed: tuple[str, ...] = ()
    """``host:port: why`` of every listed host the proxy could not reach, first time each."""


def verifier_hosts(sandbox: Any) -> tuple[str, ...] | None:
    """The allow-list ``sandbox``'s runtime was configured with; None where the runtime cannot
    relay one command's connections (it has no per-launch socket binds)."""
    config = getattr(sandbox, "config", None)
    if getattr(config, "runtime", None) != "bwrap":  # Apptainer's exec binds nothing per call
        return None
    return tuple(getattr(config, "verifier_hosts", ()))


async def exec_networked(sandbox: Any, argv: Sequence[str], *, hosts: Sequence[str],
                         folder: Path, timeout: float,  # noqa: ASYNC109 - the command's deadline
                         env: Mapping[str, str],
                         cwd: str | None = None, user: Any = None,
                         max_output: int = 1 << 20) -> NetworkRun:
    """Run ``argv`` in ``sandbox`` (as ``user``) with its connections allowed to ``hosts``
    only; the proxy's socket lives in ``folder`` (a host folder of the job's; a folder of its
    own under /tmp where that path is too long for a socket) and is gone when this returns."""
    proxy = AllowListProxy(AllowList(tuple(hosts)), "rollout verifier network",
                           f"only the hosts of {SETTING}" if hosts else
                           f"{SETTING} lists none")
    name = f"proxy-{secrets.token_hex(6)}.sock"
    short = None
    if len(str(folder / name).encode()) > MAX_SOCKET_PATH:  # a long $TMPDIR
        short = Path(tempfile.mkdtemp(prefix="rollout-vnet-", dir="/tmp"))
    host_socket = (short or folder) / name
    server = None
    try:
        server = await asyncio.start_unix_server(proxy.handle, path=str(host_socket),
                                                 limit=HEAD_LIMIT)
        os.chmod(host_socket, 0o600)
        # The launch's user (a root server's sandbox uid, an image uid in a rootless server's
        # mapped namespace) connects to it; nobody else on the host can.
        await asyncio.to_thread(sandbox.hand_over, [host_socket], user)
        inside = f"/.rollout-proxy-{secrets.token_hex(8)}.sock"
        spec = {"socket": inside, "port": PORT, "argv": list(argv), "cwd": cwd or "",
                "env": {**env, **proxy_env(PORT)}, "files": {}, "label": "verifier network"}
        run = await sandbox.exec([*python_argv(sandbox), "-I", "-c", LAUNCH_SOURCE.read_text()],
                                 stdin=json.dumps(spec).encode(), cwd=cwd, timeout=timeout,
                                 max_output=max_output, file_binds=[(str(host_socket), inside)],
                                 **({"user": user} if user is not None else {}))
    finally:
        if server is not None:
            server.close()
            # Whatever the command left open (an upstream that never closes) ends with it.
            proxy.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 5)
        with contextlib.suppress(OSError):
            host_socket.unlink()
        if short is not None:
            shutil.rmtree(short, ignore_errors=True)
    return NetworkRun(run, tuple(dict.fromkeys(proxy.refused)),
                      tuple(dict.fromkeys(proxy.failed)))
