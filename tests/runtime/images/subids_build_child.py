"""TEST-ONLY: run by test_build_network.py as a user with a range in /etc/subuid and
/etc/subgid (no root, no capabilities): Dockerfile builds of a rootless server with the
allow-listed build network (``TOP/b``: the probe, then a step that needs a host off the list);
prints what it saw as one JSON line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rollout.runtime.sandbox.base import ImageSettings
from rollout.runtime.sandbox.images import BuildSpec, ImageError, build_image, cache_for


def main(top: Path, conf: str, allowed: str) -> dict[str, object]:
    settings = ImageSettings(cache_dir=str(top / "cache"), registries_conf=conf,
                             build_network="allowlist", build_hosts=(allowed,))
    seen: dict[str, object] = {"euid": os.geteuid()}
    try:
        build_image(cache_for(settings), BuildSpec(top / "b", label="needs-other",
                                                   timeout_s=400))
        seen["refused"] = None
    except ImageError as e:
        seen["refused"] = [e.reason, str(e)]
    seen["left"] = sorted(p.name for p in (top / "cache" / "tmp").iterdir()
                          if p.name.startswith("build-"))
    return seen


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])))
