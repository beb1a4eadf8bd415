"""The trainer environments the adapter cross-checks run in, and what happens when one is absent.

``scripts/setup_adapters.sh`` builds ``.venv-verl`` and ``.venv-nemo-gym`` beside the checkout.
On a developer machine without them the cross-checks skip, saying how to build them. In CI
(``CI`` set to true/1/yes, as CI services do) a missing environment fails the test instead: a
cross-check that silently skips checks nothing, and CI's set-up is supposed to have built it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERL_PY = ROOT / ".venv-verl" / "bin" / "python"
GYM_PY = ROOT / ".venv-nemo-gym" / "bin" / "python"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require(python: Path) -> None:
    """Skip (on a developer machine) or fail (in CI) unless ``python`` exists."""
    if python.exists():
        return
    message = (f"{python.parent.parent.name} is missing: run scripts/setup_adapters.sh "
               "(ROLLOUT_SKIP_ADAPTERS must not be set)")
    if in_ci():
        pytest.fail(f"{message}; CI must run the adapter cross-checks", pytrace=False)
    pytest.skip(message)


@pytest.fixture
def verl_venv() -> Path:
    require(VERL_PY)
    return VERL_PY


@pytest.fixture
def gym_venv() -> Path:
    require(GYM_PY)
    return GYM_PY
