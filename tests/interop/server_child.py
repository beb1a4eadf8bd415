"""A test server in its own process, so a test can SIGKILL it: the scripted environment on
127.0.0.1:PORT with state in STATE_DIR. Prints ``READY <port>`` once it serves (PORT 0: a free
port the server picks, so no other process can take it between choosing and binding).

Usage: python -m tests.interop.server_child STATE_DIR PORT
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tests.client.conftest import ServerHarness


async def main(state_dir: str, port: int) -> None:
    harness = ServerHarness(Path(state_dir))
    harness.port = port
    await harness.start()
    print(f"READY {harness.port}", flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
