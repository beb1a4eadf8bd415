"""A DAPO run keeps the last ``run.keep_weights`` pushed weight directories, not one per step
(a 135M model's weights are hundreds of MB each)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from rollout.trainer_adapters.dapo.trainer import DapoTrainer


def _steps(run_dir: Path, keep: int, steps: int) -> list[str]:
    trainer = SimpleNamespace(cfg=SimpleNamespace(run=SimpleNamespace(keep_weights=keep)),
                              run_dir=run_dir, version=0)
    for version in range(1, steps + 1):
        path = run_dir / "weights" / f"v{version}"
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"w" * 64)
        trainer.version = version
        DapoTrainer._prune_weights(trainer)  # type: ignore[arg-type]
    return sorted(p.name for p in (run_dir / "weights").iterdir())


@pytest.mark.parametrize("keep, left", [(2, ["v4", "v5"]), (1, ["v5"]),
                                        (0, ["v1", "v2", "v3", "v4", "v5"])])
def test_only_the_last_versions_stay(tmp_path: Path, keep: int, left: list[str]) -> None:
    assert _steps(tmp_path, keep, 5) == left
