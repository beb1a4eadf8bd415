"""TEST-ONLY: run by test_rootless_images.py as a user with a range in /etc/subuid and
/etc/subgid. ``crash``: an image sandbox whose user writes files (owned by a subordinate uid on
the host), then this process SIGKILLs itself, as a crashed server, with no teardown.
``reap``: the start-up sweep of the next server; prints its report as one JSON line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from rollout.runtime.sandbox import SandboxConfig, bwrap, create_sandbox, reap_stale
from rollout.runtime.sandbox.base import ImageSettings


async def crash(top: Path) -> None:
    cfg = SandboxConfig(state_dir=top / "state", images=ImageSettings(
        cache_dir=str(top / "cache")))
    sb = await create_sandbox(cfg, image=f"oci:{top}/layout:owned")
    r = await sb.exec("mkdir -p /workspace/d /app/d && echo x > /workspace/d/f && "
                      "echo y > /app/d/f && chmod 500 /workspace/d && echo ok")
    # The holders made ahead for the next sandboxes, and this sandbox's own: none may
    # outlive this process.
    for _ in range(600):
        pooled = bwrap._HOLDERS.ready()
        if len(pooled) == bwrap._HolderPool.size:
            break
        await asyncio.sleep(0.1)
    print(json.dumps({"sid": sb.id, "written": r.stdout.strip(),
                      "holders": [*pooled, sb._holder.pid]}), flush=True)  # type: ignore[attr-defined]
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    top = Path(sys.argv[1])
    if sys.argv[2] == "crash":
        asyncio.run(crash(top))
    else:
        report = reap_stale(top / "state" / "sandboxes")
        print(json.dumps({"removed": report.removed, "live": report.live}))
