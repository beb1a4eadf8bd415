"""verl's own AgentLoopWorker.generate_sequences, with the rollout_service agent loop, against a
live server: the padded batch verl trains on must hold exactly the tokens, masks, logprobs,
rewards and policy versions that the tasks spell out.

The server runs here (main environment); verl runs in .venv-verl (its transformers pin conflicts
with the server's), driven by ``drive_worker.py`` in a subprocess. Expected tensors are worked out
from the task payloads (``episodes.expected_flat``) and verl's documented padding layout, not from
the adapter's code.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.tiny_model import tiny_model_dir
from tests.trainer_adapters.venvs import ROOT, VERL_PY
from tests.trainer_adapters.verl.episodes import (
    episode_harness,
    expected_flat,
    two_turn_tool_episode,
)

pytestmark = [pytest.mark.usefixtures("verl_venv"), pytest.mark.timeout(300)]

PROMPT_LEN, RESPONSE_LEN = 8, 12


def overlong_episode() -> dict[str, Any]:
    """Prompt 4 tokens, response 3 turns of 6 outputs + 2 observations = 24 > RESPONSE_LEN."""
    turns = [{"prompt": [200, 201, 202, 203] if k == 0 else [],
              "output": [210 + 10 * k + i for i in range(6)],
              "logprobs": [-0.1 * (i + 1) - k for i in range(6)],
              "obs": [250 + k, 251 + k], "version": 7} for k in range(3)]
    return {"turns": turns, "reward": 0.5, "components": {"exact": 0.0}}


def sample(task: dict[str, Any], uid: str) -> dict[str, Any]:
    return {"raw_prompt": [{"role": "user", "content": "what is two plus two?"}],
            "extra_info": {"rollout_task": task}, "uid": uid}


async def run_verl(address: str, samples: list[dict[str, Any]], tmp: Path, *,
                   environment: str = "episode", prompt_length: int = PROMPT_LEN,
                   response_length: int = RESPONSE_LEN, n: int = 2,
                   neutral_wait_s: float = 60) -> dict[str, Any]:
    req = {"address": address, "model_dir": str(tiny_model_dir()), "n": n,
           "neutral_wait_s": neutral_wait_s,
           "prompt_length": prompt_length, "response_length": response_length,
           "components": ["exact", "format"], "samples": samples, "environment": environment}
    (tmp / "req.json").write_text(json.dumps(req))
    env = {**os.environ, "VERL_LOGGING_LEVEL": "WARN", "RAY_DEDUP_LOGS": "0"}
    proc = await asyncio.create_subprocess_exec(
        str(VERL_PY), str(Path(__file__).with_name("drive_worker.py")), str(tmp / "req.json"),
        str(tmp / "out.json"), cwd=str(ROOT), env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 280)
    assert proc.returncode == 0, out.decode()[-6000:]
    return json.loads((tmp / "out.json").read_text())


def chat_prompt_ids(messages: list[dict[str, str]]) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


async def test_generate_sequences_against_live_server(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    pad = AutoTokenizer.from_pretrained(str(tiny_model_dir())).pad_token_id
    ok = two_turn_tool_episode(base=100, version=3, reward=1.0)
    long = overlong_episode()
    # EVAL fails after RUN produced turns: the tokens are there, and must not be trained on.
    failed = two_turn_tool_episode(base=300, version=9, reward=1.0, fail="eval")
    other = two_turn_tool_episode(base=400, version=5, reward=0.0)
    # INIT fails: no turn at all, so verl's own rendering of the prompt fills the row.
    no_turns = two_turn_tool_episode(base=500, version=1, reward=1.0, fail="init")
    ok2 = two_turn_tool_episode(base=600, version=2, reward=1.0)
    h = episode_harness(tmp_path / "state")
    await h.start()
    try:
        res = await run_verl(h.address, [
            sample(ok, "g1"), sample(long, "g1"), sample(failed, "g2"), sample(other, "g2"),
            sample(no_turns, "g3"), sample(ok2, "g3")], tmp_path)
    finally:
        await h.stop()
    t, nt = res["tensors"], res["non_tensors"]
    assert len(t["prompts"]) == 6
    assert all(len(r) == PROMPT_LEN for r in t["prompts"])
    assert all(len(r) == RESPONSE_LEN for r in t["responses"])

    for row, task, reward in ((0, ok, 1.0), (3, other, 0.0), (5, ok2, 1.0)):
        exp = expected_flat(task)
        p = exp["prompt_len"][0]
        prompt, resp = exp["ids"][:p], exp["ids"][p:]
        n = len(resp)
        # verl's layout: prompt left-padded, response right-padded.
        assert t["prompts"][row] == [pad] * (PROMPT_LEN - p) + prompt
        assert t["responses"][row] == resp + [pad] * (RESPONSE_LEN - n)
        assert t["input_ids"][row] == t["prompts"][row] + t["responses"][row]
        assert t["attention_mask"][row] == [0] * (PROMPT_LEN - p) + [1] * (p + n) + [0] * (
            RESPONSE_LEN - n)
        assert t["response_mask"][row] == exp["mask"][p:] + [0] * (RESPONSE_LEN - n)
        assert t["rollout_log_probs"][row] == pytest.approx(
            exp["logprobs"][p:] + [0.0] * (RESPONSE_LEN - n))
        # The reward sits on the last response token, nowhere else.
        assert t["rm_scores"][row] == pytest.approx(
            [0.0] * (n - 1) + [reward] + [0.0] * (RESPONSE_LEN - n))
        versions = [turn["version"] for turn in task["turns"]]
        assert (nt["min_global_steps"][row], nt["max_global_steps"][row]) == (
            min(versions), max(versions))
        assert nt["rollout_valid"][row] is True and nt["truncated"][row] is False
        # prompt message + 2 assistant turns + 1 tool observation
        assert nt["__num_turns__"][row] == 4

    # The over-long trajectory is flagged and did not crash the batch. Its third turn's model
    # tokens were cut, and the reward may have come from them, so by default (overlong =
    # "mask") none of it is trained on: the row holds its prompt alone (no response token),
    # which verl's score metrics leave out as aborted.
    exp = expected_flat(long)
    p = exp["prompt_len"][0]
    assert any(exp["mask"][p + RESPONSE_LEN:])
    assert t["prompts"][1] == [pad] * (PROMPT_LEN - p) + exp["ids"][:p]
    assert t["responses"][1] == [pad] * RESPONSE_LEN
    assert t["attention_mask"][1] == [0] * (PROMPT_LEN - p) + [1] * p + [0] * RESPONSE_LEN
    assert t["response_mask"][1] == [0] * RESPONSE_LEN
    # Its reward (0.5) would still count in g1's statistics: it takes the fill that keeps the
    # group's mean that of its one valid row as verl sees a group of one (0): -1.0.
    assert t["rm_scores"][1][-1] == pytest.approx(-1.0) and sum(t["rm_scores"][1]) == -1.0
    assert nt["truncated"][1] is True and nt["rollout_valid"][1] is False
    assert (nt["min_global_steps"][1], nt["max_global_steps"][1]) == (7, 7)

    # A failed sample is masked out (not scored 0 and trained on): its prompt alone; its
    # tokens stay in the service's trajectory, named by rollout_job_id.
    exp = expected_flat(failed)
    p = exp["prompt_len"][0]
    assert t["prompts"][2] == [pad] * (PROMPT_LEN - p) + exp["ids"][:p]
    assert t["responses"][2] == [pad] * RESPONSE_LEN
    assert t["response_mask"][2] == [0] * RESPONSE_LEN
    assert nt["rollout_valid"][2] is False and nt["rollout_state"][2] == "FAILED"
    assert sum(t["rm_scores"][2]) == 0.0
    # A job that produced no turn gets verl's own prompt and an empty, masked response.
    fallback = chat_prompt_ids(sample(no_turns, "g3")["raw_prompt"])[-PROMPT_LEN:]
    assert t["prompts"][4][PROMPT_LEN - len(fallback):] == fallback
    assert t["response_mask"][4] == [0] * RESPONSE_LEN
    # Failed rows take the group_fill fill, not 0 (g2: 0.0, g3: -1.0). Every group here has
    # one valid row, which verl alone would give its reward as advantage; two rows allow only
    # 0 or +-1/sqrt(2), with the mean kept (Dr.GRPO: exactly the reward).
    assert sum(t["rm_scores"][4]) == -1.0
    top = 1 / (2 ** 0.5 + 1e-6)
    assert res["advantages"]["True"] == pytest.approx([top, 0, 0, 0, 0, top], abs=1e-6)
    assert res["advantages"]["False"] == pytest.approx([1.0, 0, 0, 0, 0, 1.0], abs=1e-6)
    assert nt["rollout_valid"][4] is False
    # verl's own step metrics see the valid rollouts' scores only ([1, 0, 1]), not the fills
    # (-1.0, 0.0, -1.0 here, outside the reward range).
    m = res["data_metrics"]
    assert m["critic/score/mean"] == pytest.approx(2 / 3)
    assert (m["critic/score/min"], m["critic/score/max"]) == (0.0, 1.0)
    assert m["critic/rewards/mean"] == pytest.approx(2 / 3)

    # Fixed reward-info keys in every sample; components reported per sample.
    assert res["reward_extra_keys"] == ["reward", "rollout_valid", "truncated", "exact", "format"]
    assert nt["exact"] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert nt["format"] == [0.5, 0.0, 0.0, 0.5, 0.0, 0.5]
    assert nt["rollout_valid"] == [True, False, False, True, False, True]
    # The sample's uid reached the service as the job's group.
    assert all(jid.startswith("verl/g1/") for jid in nt["rollout_job_id"][:2])
    assert all(jid.startswith("verl/g2/") for jid in nt["rollout_job_id"][2:4])


@pytest.mark.slow
async def test_a_failed_rollout_leaves_the_legacy_group_mean(tmp_path: Path) -> None:
    """A group of four, rewards [1, failed, 0, 1], through verl's own worker and its own GRPO
    advantage: the failed row takes the valid rows' mean (2/3), so verl's uid group mean is
    the mean over valid rollouts. Without the std (Dr.GRPO) every valid advantage is exactly
    the one over valid rollouts; with it, verl's sample std spans four rows, one of them on
    the mean (sqrt(2/9) instead of sqrt(1/3)), so the valid advantages keep their signs and
    ratios at sqrt(3/2) times the scale."""
    rewards = [1.0, None, 0.0, 1.0]
    tasks = [two_turn_tool_episode(base=100 * (k + 1), reward=r if r is not None else 1.0,
                                   **({"fail": "eval"} if r is None else {}))
             for k, r in enumerate(rewards)]
    h = episode_harness(tmp_path / "state")
    await h.start()
    try:
        res = await run_verl(h.address, [sample(t, "g") for t in tasks], tmp_path, n=4)
        off = await run_verl(h.address, [sample(t, "h") for t in tasks], tmp_path, n=4,
                             neutral_wait_s=0)
    finally:
        await h.stop()
    t = res["tensors"]
    assert t["response_mask"][1] == [0] * RESPONSE_LEN
    assert sum(t["rm_scores"][1]) == pytest.approx(2 / 3)
    # Dr.GRPO: r - mean over the valid rollouts [1, 0, 1].
    assert res["advantages"]["False"] == pytest.approx([1 / 3, 0.0, -2 / 3, 1 / 3], abs=1e-6)
    # GRPO: verl's unbiased std over [1, 2/3, 0, 1] is sqrt(2/9).
    s = (2 / 9) ** 0.5
    assert res["advantages"]["True"] == pytest.approx(
        [(1 / 3) / s, 0.0, (-2 / 3) / s, (1 / 3) / s], abs=1e-5)
    # Turned off, the failed row's 0 pulls the mean to 1/2 (what the fix removes).
    assert sum(off["tensors"]["rm_scores"][1]) == 0.0
    assert off["advantages"]["False"] == pytest.approx([0.5, 0.0, -0.5, 0.5], abs=1e-6)


async def test_a_masked_succeeded_rollout_is_left_out_of_the_legacy_group_mean(
        tmp_path: Path) -> None:
    """A group of four through verl's own worker: rewards 1, an overlong answer that
    SUCCEEDED with reward 1 (its row is cut, so wholly masked), a failed job, 0. The valid
    rollouts are the two rows verl trains, [1, 0] (not the overlong sibling with its own
    reward): the two untrainable rows take fills that keep the group's mean and std those of
    [1, 0], so verl's GRPO advantages, with and without the std, are exactly those over the
    valid rollouts."""
    long = {**overlong_episode(), "reward": 1.0}
    tasks = [two_turn_tool_episode(base=100, reward=1.0), long,
             two_turn_tool_episode(base=300, reward=1.0, fail="eval"),
             two_turn_tool_episode(base=400, reward=0.0)]
    h = episode_harness(tmp_path / "state")
    await h.start()
    try:
        res = await run_verl(h.address, [sample(t, "g") for t in tasks], tmp_path, n=4)
    finally:
        await h.stop()
    t, nt = res["tensors"], res["non_tensors"]
    assert [nt["rollout_state"][k] for k in range(4)] == [
        "SUCCEEDED", "SUCCEEDED", "FAILED", "SUCCEEDED"]
    assert t["response_mask"][1] == [0] * RESPONSE_LEN and nt["truncated"][1] is True
    assert t["response_mask"][2] == [0] * RESPONSE_LEN
    # verl's score metrics average the two valid rollouts, not the fills beside them.
    m = res["data_metrics"]
    assert m["critic/score/mean"] == pytest.approx(0.5)
    assert (m["critic/score/min"], m["critic/score/max"]) == (0.0, 1.0)
    # Two fills keep the group's mean and std those of [1, 0]: 0.5 +- sqrt(1/2).
    assert sorted([sum(t["rm_scores"][1]), sum(t["rm_scores"][2])]) == pytest.approx(
        [0.5 - 0.5 ** 0.5, 0.5 + 0.5 ** 0.5], abs=1e-6)
    assert res["advantages"]["False"] == pytest.approx([0.5, 0.0, 0.0, -0.5], abs=1e-6)
    # GRPO: exactly verl's advantages over [1, 0] alone, (r - 0.5) / (sqrt(1/2) + eps).
    top = 0.5 / (0.5 ** 0.5 + 1e-6)
    assert res["advantages"]["True"] == pytest.approx([top, 0.0, 0.0, -top], abs=1e-6)
