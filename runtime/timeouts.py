"""One knob for the start-up waits that a busy machine stretches: ``ROLLOUT_TIMEOUT_SCALE``.

A deadline that only detects a broken start (an IPython kernel that never answers) has to be
generous on a loaded machine, where starting the same kernel can take many times longer than
on an idle one. Rather than a bigger constant everywhere, each such wait multiplies its base
by this factor, read here and nowhere else (the kernel start and the test helpers use it).
Waits the user chose (a tool call's ``timeout``, a job's stage deadlines) are never scaled.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV_VAR = "ROLLOUT_TIMEOUT_SCALE"


def timeout_scale(environ: Mapping[str, str] | None = None) -> float:
    """The factor from ``$ROLLOUT_TIMEOUT_SCALE`` (1 when unset); read on every call, so a
    process can change it at run time."""
    raw = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{ENV_VAR} must be a positive number such as 2 or 0.5, got {raw!r}")
    return value


def scaled(seconds: float, environ: Mapping[str, str] | None = None) -> float:
    """``seconds`` stretched by the configured factor."""
    return seconds * timeout_scale(environ)
