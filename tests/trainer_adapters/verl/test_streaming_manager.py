"""The streaming manager (batcher underneath) over four steps against a live server: dynamic
sampling drops a group whose rewards are all equal, the policy version taken from verl's step
(step k generates on weights labelled k - 1) makes older samples stale (dropped, never batched)
and new jobs ask the service for it, the batch holds each kept sample's tokens, masks and
logprobs in verl's padded layout, a step whose groups all tie still returns them (flagged), and
a step with nothing usable raises instead of returning an empty batch."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from rollout.client.aio import RolloutClient
from tests.trainer_adapters.venvs import ROOT, VERL_PY
from tests.trainer_adapters.verl.episodes import (
    episode_harness,
    expected_flat,
    two_turn_tool_episode,
)

pytestmark = [pytest.mark.usefixtures("verl_venv"), pytest.mark.timeout(300)]
PROMPT_LEN, RESPONSE_LEN = 8, 12


def group(uid: str, base: int, version: int, rewards: list[float], **extra: Any
          ) -> dict[str, Any]:
    task = two_turn_tool_episode(base=base, version=version)
    # Both turns of a sample come from one policy version here (staleness is per sample).
    task["turns"][1]["version"] = version
    task["rewards"] = rewards
    task.update(extra)
    return {"uid": uid, "task": task}


async def test_two_steps_of_streaming_batches(tmp_path: Path) -> None:
    a, b, c = (group("A", 100, 0, [1.0, 0.0]), group("B", 200, 0, [1.0, 1.0]),
               group("C", 300, 0, [0.0, 1.0]))
    d, e, f = (group("D", 400, 0, [1.0, 0.0]), group("E", 500, 1, [0.0, 1.0]),
               group("F", 600, 1, [0.0, 0.0]))
    ties = [group(u, 700 + 10 * k, 2, [r, r]) for k, (u, r) in enumerate(
        [("G", 1.0), ("H", 0.0), ("J", 1.0)])]
    broken = [group(u, 800 + 10 * k, 3, [1.0, 0.0], fail="run") for k, u in enumerate("KLM")]
    # verl's global_steps count from 1; step k's weights carry the label k - 1.
    req = {"n": 2, "groups_per_batch": 3, "prompt_length": PROMPT_LEN,
           "response_length": RESPONSE_LEN,
           "steps": [{"global_steps": 1, "groups": [a, b, c]},
                     {"global_steps": 2, "groups": [d, e, f]},
                     {"global_steps": 3, "groups": ties},
                     {"global_steps": 4, "groups": broken}]}
    h = episode_harness(tmp_path / "state")
    await h.start()
    try:
        req["address"] = h.address
        (tmp_path / "req.json").write_text(json.dumps(req))
        proc = await asyncio.create_subprocess_exec(
            str(VERL_PY), str(Path(__file__).with_name("drive_streaming.py")),
            str(tmp_path / "req.json"), str(tmp_path / "out.json"), cwd=str(ROOT),
            env=dict(os.environ), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 280)
        assert proc.returncode == 0, out.decode()[-6000:]
        async with RolloutClient(h.address) as client:
            jobs = [j async for j in client.list_jobs(client_id="verl-streaming-test")]
    finally:
        await h.stop()
    step1, step2, step3, step4 = json.loads((tmp_path / "out.json").read_text())["steps"]

    # Step 1: B's rewards are all equal (no advantage anywhere): dropped; A and C kept.
    assert sorted(set(step1["uid"])) == ["A", "C"] and len(step1["uid"]) == 4
    assert step1["stats"]["groups_dropped_equal"] == 1 and step1["stats"]["partial"] is True
    assert step1["policy_version"] == 0
    t = step1["tensors"]
    for row, uid in enumerate(step1["uid"]):
        task = {"A": a, "C": c}[uid]["task"]
        exp = expected_flat(task)
        p = exp["prompt_len"][0]
        n = len(exp["ids"]) - p
        assert t["prompts"][row] == [0] * (PROMPT_LEN - p) + exp["ids"][:p]
        assert t["responses"][row] == exp["ids"][p:] + [0] * (RESPONSE_LEN - n)
        assert t["response_mask"][row] == exp["mask"][p:] + [0] * (RESPONSE_LEN - n)
        assert t["rollout_log_probs"][row] == pytest.approx(
            exp["logprobs"][p:] + [0.0] * (RESPONSE_LEN - n))
        assert t["rm_scores"][row][n - 1] == step1["reward"][row]
    # Rewards per sample, as the tasks assign them: each kept group has a 0 and a 1.
    for uid in ("A", "C"):
        assert sorted(r for r, u in zip(step1["reward"], step1["uid"], strict=True)
                      if u == uid) == [0.0, 1.0]

    # Step 2, after the weight update to version 1 (max_staleness 0): D's samples were made by
    # version 0 and are dropped; F's rewards are all equal; only E is batched.
    assert step2["policy_version"] == 1
    assert step2["uid"] == ["E", "E"] and step2["min_global_steps"] == [1, 1]
    assert step2["stats"]["stale_samples"] == 2
    assert step2["stats"]["groups_dropped_equal"] == 1
    # ...and every job of step 2 asked the service for the new version; step 1's for version
    # 0, the label of the weights verl syncs before its first step (asking for 1 would wait
    # for weights that never come, and fail BACKEND_UNAVAILABLE).
    by_uid = {j.spec.metadata["uid"]: j.spec.min_policy_version for j in jobs}
    assert by_uid["D"] == by_uid["E"] == by_uid["F"] == 1
    assert by_uid["A"] == by_uid["B"] == by_uid["C"] == 0

    # Step 3: every group tied. They come back (zero advantage: the update does nothing
    # with them) and say so, rather than an empty batch.
    assert step3["policy_version"] == 2 and step3["stats"]["all_tied"] is True
    assert sorted(set(step3["uid"])) == ["G", "H", "J"] and len(step3["tensors"]["responses"]) == 6
    assert step1["stats"]["all_tied"] is False

    # Step 4: every sample failed. Nothing to train on is an error that names the counts.
    assert step4["error"] == "NoUsableGroups"
    assert "6 samples failed" in step4["message"]


V1_SCRIPT = """
from omegaconf import OmegaConf
from rollout.trainer_adapters.verl.async_manager import StreamingRolloutManager
cfg = OmegaConf.create({"trainer": {"use_v1": True}, "actor_rollout_ref": {"rollout": {}}})
try:
    StreamingRolloutManager.create(cfg)
except ValueError as exc:
    print("REFUSED", exc)
"""


async def test_v1_trainer_path_is_refused_with_what_to_set() -> None:
    """verl 0.9.1's default V1 trainer wants TransferQueue output, which this manager does not
    write: building it there fails at once, naming the two supported set-ups."""
    proc = await asyncio.create_subprocess_exec(
        str(VERL_PY), "-c", V1_SCRIPT, cwd=str(ROOT), env=dict(os.environ),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 280)
    text = out.decode()
    assert proc.returncode == 0, text[-3000:]
    assert "REFUSED" in text and "trainer.use_v1=false" in text
    assert "default_agent_loop=rollout_service" in text
