"""The GPU benchmark's CPU dry run: ``benchmarks/gpu_run.sh --dry-run`` checks itself, then
runs the driver on both paths (the engine called directly, and behind a real server process)
at each concurrency; every session's turns come back and every job finishes once. No speed is
asserted; the scripted engine's fixed reply makes the token counts exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.benchmarks import gpu

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]


def test_gpu_run_dry_run_measures_both_paths(tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = subprocess.run(
        ["bash", "benchmarks/gpu_run.sh", "--dry-run", "--out", str(out), "--concurrency",
         "3,5", "--turns", "2"], cwd=ROOT, capture_output=True, text=True, timeout=200,
        env={**os.environ, "PYTHON": sys.executable})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "check passed" in res.stdout
    assert "behind the service" in res.stdout and "direct (baseline)" in res.stdout
    data = json.loads((out / "bench.json").read_text())
    assert data["dry_run"] is True
    rows = {(r["path"], r["concurrency"]): r for r in data["rows"]}
    assert set(rows) == {(p, c) for p in ("direct", "service") for c in (3, 5)}
    max_tokens = data["args"]["max_tokens"]
    for (_, c), r in rows.items():
        # Each turn returns max_tokens tokens (the reply + the end-of-turn token).
        assert r["finished"] == c and r["turns"] == 2
        assert r["output_tokens"] == c * 2 * max_tokens and r["tokens_per_s"] > 0
        assert 0 < r["turn_p50_ms"] <= r["turn_p99_ms"]
    assert (out / "env.txt").exists() and "not run in --dry-run" in (out / "dapo.log").read_text()


async def test_the_session_loop_grows_the_prompt_by_output_and_observation() -> None:
    seen: list[int] = []

    async def generate(req: gpu.GenerateRequest) -> gpu.GenerateResult:
        seen.append(len(req.prompt_ids))
        return gpu.GenerateResult(output_ids=[7] * 5, logprobs=[0.0] * 5, finish_reason="stop",
                                  policy_version=0, backend="test")

    res = await gpu.session(generate, "s", 3, 10, 5)
    step = 5 + len(gpu.OBSERVATION)
    assert seen == [10, 10 + step, 10 + 2 * step]
    assert res.output_tokens == 15 and len(res.turn_ms) == 3
