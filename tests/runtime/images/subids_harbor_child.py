"""TEST-ONLY: run by test_rootless_images.py as a user with a range in /etc/subuid and
/etc/subgid (no root, no capabilities): Harbor's oracle check of the task folders below
``TOP/tasks`` through the harbor handler, on image sandboxes whose user namespaces map the
image's uids; prints the results as one JSON line."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from rollout.runtime.sandbox.base import ImageSettings
from rollout.runtime.sandbox.images import subids
from rollout.runtime.tasksets import harbor_import
from tests.runtime.envs.harbor_helpers import image_factory


async def main(top: Path) -> dict[str, object]:
    factory = image_factory(top / "state", ImageSettings(cache_dir=str(top / "cache")))
    results = await harbor_import.check([top / "tasks"], factory)
    return {"euid": os.geteuid(), "subids": str(subids.server_subids()),
            "results": [[r.task, r.oracle, r.noop, list(r.problems)] for r in results]}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(Path(sys.argv[1])))))
