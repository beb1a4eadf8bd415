"""TEST-ONLY: run by test_rootless_images.py as a user with a range in /etc/subuid and
/etc/subgid, from an interpreter installed outside the system trees (as a rootless server
runs from its own venv): the IPython tool in an image sandbox of ``app``, whose image has no
Python (the kernel is the server's interpreter through the host loader); prints what the
kernel saw as one JSON line."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from rollout.runtime.sandbox import SandboxConfig, create_sandbox
from rollout.runtime.sandbox.base import ImageSettings

CELL = ("import os\n"
        "print(os.getuid(), os.getgid(), open('/app/owned.txt').read().strip())\n"
        "open('/workspace/k', 'w').write('k'); print('kernel-ws-ok')\n"
        "open('/app/owned.txt', 'a').write('k'); print('kernel-own-ok')\n"
        "try:\n    open('/rootfile', 'a').write('k')\nexcept PermissionError:\n"
        "    print('kernel-root-denied')\n")


async def _gateway(sb: Any, top: Path) -> list[object]:
    path = str(top / "gw.sock")
    got: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await reader.read(100))
        writer.close()

    server = await asyncio.start_unix_server(serve, path)
    try:
        os.chmod(path, 0o600)
        await asyncio.to_thread(sb.hand_over, [path])
        r = await sb.exec([*sb.python_launcher, sb.python, "-c",
                           "import socket; s = socket.socket(socket.AF_UNIX); "
                           "s.connect('/.gw.sock'); s.sendall(b'hello'); print('sent')"],
                          file_binds=[(path, "/.gw.sock")])
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.05)
        return [r.exit_code, r.stdout.split(), r.stderr[-300:], [g.decode() for g in got]]
    finally:
        server.close()
        await server.wait_closed()


async def main(top: Path, site: str) -> dict[str, object]:
    # The packages the server's venv adds from the test's venv (ipykernel): bound read-only.
    cfg = SandboxConfig(state_dir=top / "state", images=ImageSettings(
        cache_dir=str(top / "cache")), extra_ro_binds=((site, site),))
    async with await create_sandbox(cfg, image=f"oci:{top}/layout:owned") as sb:
        kernel = await sb.ipython()
        cell = await kernel.execute(CELL)
        seen: dict[str, object] = {"cell": [cell.status, cell.output.split()]}
        await kernel.restart()  # a second kernel binds its sockets in the same folder
        cell = await kernel.execute("import os; print(os.getuid())")
        seen["restarted"] = [cell.status, cell.output.split()]
        # A harness's gateway socket (the server's, mode 0600): handed to the image's user,
        # whose relay (the server's interpreter) connects to it through a file bind.
        seen["gateway"] = await _gateway(sb, top)
    seen["sandboxes_left"] = [p.name for p in cfg.sandboxes_dir.iterdir()]
    return seen


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))))
