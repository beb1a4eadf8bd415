"""Shared by the harbor tests: a sandbox factory on the loopback registry's images, and one
job line run through the harbor handler in-process."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from rollout.runtime.envs.harbor import taskdir
from rollout.runtime.sandbox.base import ImageSettings, SandboxConfig, create_sandbox
from rollout.runtime.tasksets import harbor_import

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "harbor"


def image_factory(state: Path, settings: ImageSettings) -> Any:
    return functools.partial(create_sandbox, SandboxConfig(state_dir=state, images=settings))


def line(name: str, agent: str = "model", folder: Path = FIXTURES) -> dict[str, Any]:
    return harbor_import.job_line(taskdir.load(folder / name), agent=agent,
                                  digest=taskdir.digest(folder / name))
