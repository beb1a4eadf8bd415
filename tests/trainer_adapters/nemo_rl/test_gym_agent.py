"""The NeMo Gym agent server against a live service, checked with nemo-gym's own models, and the
message-log conversion against a fixture derived by hand from NeMo RL's Gym flattening
(``two_turn_message_log.json``: per model call, the new prompt tokens as a non-trained message,
then the generation with its logprobs; the observation joins the next call's prompt).

The service runs here; the agent runs in .venv-nemo-gym (``drive_gym_agent.py``), because
nemo-gym and its stack do not belong in the server's environment.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.trainer_adapters.nemo_rl.nemo_rl_advantage import nemo_rl_advantages
from tests.trainer_adapters.venvs import GYM_PY, ROOT
from tests.trainer_adapters.verl.episodes import (
    episode_harness,
    expected_flat,
    two_turn_tool_episode,
)

FIXTURE = Path(__file__).with_name("two_turn_message_log.json")
pytestmark = [pytest.mark.usefixtures("gym_venv"), pytest.mark.timeout(180)]


async def run_agent(address: str, rows: list[dict[str, Any]], tmp: Path,
                    reward_components: list[str] | None = None,
                    max_total_sequence_length: int = 0,
                    max_response_tokens: int = 0) -> dict[str, Any]:
    (tmp / "req.json").write_text(json.dumps({
        "address": address, "rows": rows, "scaffold_root": str(tmp / "gym"),
        "reward_components": reward_components or [],
        "max_total_sequence_length": max_total_sequence_length,
        "max_response_tokens": max_response_tokens}))
    proc = await asyncio.create_subprocess_exec(
        str(GYM_PY), str(Path(__file__).with_name("drive_gym_agent.py")), str(tmp / "req.json"),
        str(tmp / "out.json"), cwd=str(ROOT), env=dict(os.environ),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 170)
    assert proc.returncode == 0, out.decode()[-6000:]
    return json.loads((tmp / "out.json").read_text())


def row(task: dict[str, Any], index: int) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "user", "content": "2+2?"}],
                                        "temperature": 0.7},
            "rollout_task": task, "_ng_task_index": index, "_ng_rollout_index": 0}


async def test_run_answers_with_gym_models_and_nemo_rl_flattening(tmp_path: Path) -> None:
    ok = two_turn_tool_episode(base=100, version=3, reward=1.0)
    sums = two_turn_tool_episode(base=200, version=1, reward=1.5)
    sums["components"] = {"exact": 1.0, "format": 0.5}  # parts that add up to the reward
    failed = two_turn_tool_episode(base=300, version=1, reward=1.0, fail="eval")
    early = two_turn_tool_episode(base=400, version=1, reward=1.0, fail="init")
    too_long = two_turn_tool_episode(base=500, prompt_fills_budget=700)
    h = episode_harness(tmp_path / "state")
    await h.start()
    try:
        res = await run_agent(h.address, [row(ok, 0), row(sums, 1), row(failed, 2), {
            "responses_create_params": {"input": "no task here"}}, row(early, 4),
            row(too_long, 5)], tmp_path, reward_components=["exact", "format"],
            max_total_sequence_length=640, max_response_tokens=96)
    finally:
        await h.stop()
    r_ok, r_sums, r_failed, r_bad, r_early, r_long = res["results"]

    # NeMo RL's masking (restated in the driver from its code: it reads instance_config only)
    # trains the succeeded jobs and neither failed one.
    assert [r["loss_multiplier"] for r in (r_ok, r_sums, r_failed, r_early)] == [1, 1, 0, 0]
    # The job's token budget is NeMo RL's policy.max_total_sequence_length...
    assert r_ok["budget"] == 640
    # ...and its response budget the agent's max_response_tokens.
    assert r_ok["response_budget"] == 96
    # ...and a prompt that alone fills it is an error naming the job and the prompt's length.
    assert r_long["status"] == 422
    assert "700-token" not in r_long["body"] and "700 tokens" in r_long["body"]
    assert "job gym/" in r_long["body"] and "max_total_sequence_length" in r_long["body"]

    # The two-turn tool episode: NeMo RL's flattening of the /run answer, our converter on the
    # stored trajectory, and the hand-derived fixture all agree.
    fixture = json.loads(FIXTURE.read_text())
    assert r_ok["nemo_flatten"] == fixture
    assert r_ok["message_log"] == fixture
    # ...and hold exactly the episode's tokens, mask and logprobs, minus nothing but the
    # trailing observation (in no model call's prompt).
    exp = expected_flat(ok)
    flat_ids = [t for m in fixture for t in m["token_ids"]]
    flat_mask = [t for m in fixture for t in m["token_loss_mask"]]
    assert flat_ids == exp["ids"][:len(flat_ids)] and len(flat_ids) == len(exp["ids"])
    assert flat_mask == exp["mask"]
    lps = [lp for m in fixture for lp in m.get("generation_logprobs", [])]
    assert lps == [lp for lp, m in zip(exp["logprobs"], exp["mask"], strict=True) if m]

    body = r_ok["body"]
    items = body["response"]["output"]
    # The tool call carries turn 0's tokens, its output carries none (its tokens open the next
    # call's prompt), and the answer carries turn 1's: whole prompts, each extending the last.
    assert [i["type"] for i in items] == ["function_call", "function_call_output", "message"]
    assert items[0]["name"] == "python"
    assert "generation_token_ids" not in items[1]
    assert items[2]["prompt_token_ids"] == exp["ids"][:len(items[2]["prompt_token_ids"])]
    assert items[2]["prompt_token_ids"][:len(items[0]["prompt_token_ids"])] == (
        items[0]["prompt_token_ids"])
    assert body["reward"] == 1.0 and body["mask_sample"] is False
    # The service's components (exact, format) are measurements, not parts of the reward:
    # they travel beside it, and reward_components has the same single key in every answer,
    # whether the components happen to add up (r_sums) or the job failed (r_failed, r_early).
    assert body["reward_components"] == {"reward": 1.0}
    assert body["rollout_reward_components"] == {"exact": 1.0, "format": 0.5}
    assert r_sums["body"]["reward_components"] == {"reward": 1.5}
    assert r_sums["body"]["rollout_reward_components"] == {"exact": 1.0, "format": 0.5}
    for r in (r_failed, r_early):
        assert r["body"]["reward_components"] == {"reward": 0.0}
        assert r["body"]["rollout_reward_components"] == {"exact": 0.0, "format": 0.0}

    # A job that failed before any turn still answers with a token-carrying item, so NeMo
    # RL's post-processing (which runs before it reads mask_sample) has a message log; the
    # placeholder is masked out.
    eb = r_early["body"]
    assert eb["mask_sample"] is True and eb["rollout_state"] == "FAILED"
    assert [i["generation_token_ids"] for i in eb["response"]["output"]] == [[0]]
    assert [m["role"] for m in r_early["nemo_flatten"]] == ["user", "assistant"]

    # A failed job is masked out, with a failure kind from nemo-gym's vocabulary.
    fb = r_failed["body"]
    assert fb["mask_sample"] is True and fb["reward"] == 0.0
    assert fb["failure_kind"] == "agent_run_error" and "SCRIPTED_FAILURE" in fb["failure_reason"]
    assert fb["rollout_state"] == "FAILED"

    # A row with neither a rollout_task nor an expected answer is refused, saying what to fix.
    assert r_bad["status"] == 422 and "rollout_task" in r_bad["body"]

    assert res["responses"]["output"][0]["generation_token_ids"] == [110, 111, 112]
    # The server directory NeMo Gym launches: its config is the agent's config.
    # Its config passes nemo-gym's parser with agents lacking an environment server made an
    # error (the deprecated form), the agent starts no Ray cluster, and requirements.txt
    # names what pip can install (this checkout; the name alone is not on PyPI).
    assert res["scaffold"] == {"address": h.address, "environment": "episode",
                               "entrypoint": "app.py", "runs_agent": True,
                               "requirements": [str(ROOT)],
                               "parsed_servers": ["rollout_service_agent",
                                                  "rollout_service_environment_server"],
                               "uses_ray": False}
    # Gym's aggregation read the answers, keyed by the row indices they echo.
    assert [r["body"]["_ng_task_index"] for r in (r_ok, r_sums, r_failed, r_early)] == [
        0, 1, 2, 4]
    assert res["aggregate"] is not None


GROUPS: list[list[float | str | None]] = [  # rewards; None: the job fails (after its turns,
    [1.0, None, 0.0, 1.0],                     # or "init": before any)
    [1.0, None, "init", 0.0],
    [0.2, None, 1.0, 0.5, None, 0.7],
]


async def test_failed_samples_leave_nemo_rls_group_statistics(tmp_path: Path) -> None:
    """Three prompt groups posted at once, interleaved, with jobs that fail after their turns
    or before any. NeMo RL (restated in nemo_rl_advantage.py: rows grouped by their answer's
    first prompt tokens, baseline and std over every row of a group) gives each valid row,
    in all four estimator settings (leave-one-out or not, normalised or not), exactly the
    advantage it gets over its group's valid rows alone; the masked rows answer the
    placeholder, so they share no group with a valid row, and get advantage 0."""
    rows, members = [], []
    for g, rewards in enumerate(GROUPS):
        for r in rewards:
            fail = {"fail": "eval"} if r is None else {"fail": "init"} if r == "init" else {}
            task = two_turn_tool_episode(base=100 + 200 * g,
                                         reward=r if isinstance(r, float) else 1.0, **fail)
            rows.append(row(task, 7 + g))
            members.append((g, isinstance(r, float)))
    order = sorted(range(len(rows)), key=lambda i: (i % 3, i))  # interleave the groups
    rows, members = [rows[i] for i in order], [members[i] for i in order]
    h = episode_harness(tmp_path / "state")
    await h.start()
    try:
        res = await run_groups(h.address, rows, tmp_path)
    finally:
        await h.stop()
    valid = [ok for _, ok in members]
    assert res["loss_multiplier"] == [1 if ok else 0 for ok in valid]
    for setting, advantages in res["advantages"].items():
        loo, norm = (part == "True" for part in setting.split("-"))
        for g in range(len(GROUPS)):
            mine = [i for i, (h_, ok) in enumerate(members) if h_ == g and ok]
            alone = nemo_rl_advantages([g] * len(mine), [res["rewards"][i] for i in mine],
                                       leave_one_out=loo, normalize=norm)
            assert [advantages[i] for i in mine] == pytest.approx(alone, abs=1e-6), setting
            assert any(abs(a) > 0.1 for a in alone)  # the check has something to see
        assert [a for a, ok in zip(advantages, valid, strict=True) if not ok] == [0.0] * (
            valid.count(False))
    # A masked sample's answer is the placeholder alone: its prompt is no group's.
    group_keys = {g: res["keys"][i] for i, (g, ok) in enumerate(members) if ok}
    for i, (g, ok) in enumerate(members):
        assert res["keys"][i] == (group_keys[g] if ok else [0])
    assert len(set(map(tuple, group_keys.values()))) == len(GROUPS)


async def run_groups(address: str, rows: list[dict[str, Any]], tmp: Path) -> dict[str, Any]:
    (tmp / "groups.json").write_text(json.dumps({"address": address, "rows": rows,
                                                 "groups": True}))
    proc = await asyncio.create_subprocess_exec(
        str(GYM_PY), str(Path(__file__).with_name("drive_gym_agent.py")),
        str(tmp / "groups.json"), str(tmp / "groups-out.json"), cwd=str(ROOT),
        env=dict(os.environ), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 170)
    assert proc.returncode == 0, out.decode()[-6000:]
    return json.loads((tmp / "groups-out.json").read_text())
