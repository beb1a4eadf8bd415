"""`rollout quickstart` end to end with the real embedded model (a small mix, so it is quick)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_quickstart_runs_the_embedded_defaults(tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-m", "rollout.client.cli", "quickstart", "--mix", "math=1,code=1,swe=1",
         "--out-dir", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "rollout summary" in res.stdout
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    ids = " ".join(t["job_id"] for t in trajs)
    assert len(trajs) == 3 and all(env in ids for env in ("math-", "code-", "rollout__"))
    for t in trajs:
        turn = t["turns"][0]
        assert turn["output_ids"], "SmolLM2 generated tokens"
        assert len(turn["output_logprobs"]) == len(turn["output_ids"])
        assert turn["backend"].startswith("transformers")
    png = (out / "timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert (tmp_path / ".rollout" / "jobs.sqlite3").exists(), "state under ./.rollout"
