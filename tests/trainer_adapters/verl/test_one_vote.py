"""One vote per rollout, with verl 0.9.1's own advantage code: groups whose rollouts have
uneven numbers of segments (a harness that rewrote its history), a failed rollout, and a later
segment whose rewritten history outgrew ``prompt_length``. Both adapter paths (the streaming
manager's batch and the per-sample loop's outputs under verl's V1 trainer) give every row its
rollout's GRPO advantage, computed over rollouts; verl's stock per-row grouping (by ``uid``
alone) on the same batch does not."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.trainer_adapters.venvs import ROOT

pytestmark = pytest.mark.timeout(600)
PROMPT_LEN, RESPONSE_LEN = 4, 8


def seg(prompt: int, out: int, base: int = 10) -> dict[str, Any]:
    return {"ids": list(range(base, base + prompt + out)), "prompt": prompt,
            "mask": [0] * prompt + [1] * out}


GROUPS = [
    # Rewards per rollout [1, 0, 0, 0] with 3, 1, 2 and 1 segments.
    [{"reward": 1.0, "segments": [seg(3, 2), seg(4, 1), seg(2, 3)]},
     {"reward": 0.0, "segments": [seg(3, 2)]},
     {"reward": 0.0, "segments": [seg(3, 2), seg(4, 2)]},
     {"reward": 0.0, "segments": [seg(2, 1)]}],
    # [1, failed, 0, 1]; the last rollout's second segment has a 5-token prompt (> 4).
    [{"reward": 1.0, "segments": [seg(3, 2)]},
     {"reward": 0.0, "failed": True, "segments": [seg(3, 2)]},
     {"reward": 0.0, "segments": [seg(3, 2), seg(2, 2)]},
     {"reward": 1.0, "segments": [seg(3, 2), seg(5, 2)]}],
]
# By hand. Group 0 over rollouts: mean 0.25, sample std 0.5 -> +1.5, -0.5, -0.5, -0.5.
# Group 1 over its three usable rollouts [1, 0, 1]: mean 2/3, std sqrt(1/3).
S = math.sqrt(1 / 3)
EXPECTED = {("u0", 0): 1.5, ("u0", 1): -0.5, ("u0", 2): -0.5, ("u0", 3): -0.5,
            ("u1", 0): (1 / 3) / S, ("u1", 2): (-2 / 3) / S, ("u1", 3): (1 / 3) / S}
ROWS = {("u0", 0): 3, ("u0", 1): 1, ("u0", 2): 2, ("u0", 3): 1,
        ("u1", 0): 1, ("u1", 2): 2, ("u1", 3): 1}
"""Rows per rollout: every trainable segment; u1's failed rollout and too-long segment none."""


def by_rollout(jobs: list[str], advs: list[float]) -> dict[tuple[str, int], list[float]]:
    """Each row's advantage under its rollout (job ``job-G-R`` is rollout R of group uG)."""
    out: dict[tuple[str, int], list[float]] = {}
    for job, adv in zip(jobs, advs, strict=True):
        _, g, r = job.split("-")
        out.setdefault((f"u{g}", int(r)), []).append(adv)
    return out


def test_verl_group_advantages_are_per_rollout(verl_venv: Path, tmp_path: Path) -> None:
    (tmp_path / "req.json").write_text(json.dumps(
        {"groups": GROUPS, "prompt_length": PROMPT_LEN, "response_length": RESPONSE_LEN}))
    proc = subprocess.run(
        [str(verl_venv), str(Path(__file__).with_name("drive_one_vote.py")),
         str(tmp_path / "req.json"), str(tmp_path / "out.json")],
        cwd=str(ROOT), env=dict(os.environ), capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    out = json.loads((tmp_path / "out.json").read_text())
    for path in ("streaming", "v1"):
        got = by_rollout(out[path]["jobs"], out[path]["per_rollout"])
        # Rows of one rollout share one key prefix ({uid}_{rollout}), and no two rollouts do.
        prefixes = {j: {k.rsplit("_", 1)[0] for k, jj in zip(out[path]["keys"],
                                                              out[path]["jobs"], strict=True)
                        if jj == j} for j in set(out[path]["jobs"])}
        assert all(len(p) == 1 for p in prefixes.values())
        assert len({next(iter(p)) for p in prefixes.values()}) == len(prefixes)
        assert {k: len(v) for k, v in got.items()} == ROWS, path
        for key, advs in got.items():
            assert advs == pytest.approx([EXPECTED[key]] * len(advs), abs=1e-5), (path, key)
    stream = out["streaming"]
    assert stream["stats"] == {"segments_dropped": 1, "rollouts_untrainable": 0}
    # verl's stock grouping by uid counts rollout 0 of u0 three times: not the per-rollout
    # values (this is what the rollout keys fix).
    per_row = by_rollout(stream["jobs"], stream["per_row"])
    assert per_row[("u0", 0)][0] != pytest.approx(1.5, abs=1e-2)
