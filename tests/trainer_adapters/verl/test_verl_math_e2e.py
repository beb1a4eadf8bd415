"""verl's AgentLoopWorker through the real ``math`` environment and agent loop: the service renders
the prompt with the chat template, the scripted policy (a backend of the real pool) answers, EVAL
grades. verl's rows must hold the service's tokens unchanged (no re-tokenization), the loss mask
on exactly the policy's tokens, and the grader's reward on the last token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollout.client.aio import RolloutClient
from rollout.runtime.envs.math.handler import MathHandler
from rollout.runtime.handler import HandlerRegistry
from rollout.server.app import Server
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.scripted import ScriptedEngine
from tests.client.conftest import make_config
from tests.fixtures.tiny_model import tiny_model_dir
from tests.trainer_adapters.verl.test_verl_worker import run_verl

pytestmark = [pytest.mark.usefixtures("verl_venv"), pytest.mark.timeout(300)]
RIGHT, WRONG = "\\boxed{391}", "\\boxed{7}"
QUESTION = "What is 17 \\times 23?"


async def _no_sandbox(**options: Any) -> Any:
    raise RuntimeError("math tasks without tools open no sandbox")


async def test_math_episode_reaches_verl_token_exact(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))

    def policy(session_id: str, turn: int) -> str:
        # verl's uid is part of the job id (verl/<uid>/...): one group answers right.
        return RIGHT if "/right/" in session_id else WRONG

    pool = BackendPool([ScriptedEngine(tok, policy, policy_version=5)])
    await pool.start()
    registry = HandlerRegistry()
    registry.register("math", MathHandler)
    server = await Server(make_config(tmp_path / "state"), registry=registry, llm=pool,
                          sandbox_factory=_no_sandbox).start()
    address = f"127.0.0.1:{server.port}"
    task = {"question": QUESTION, "answer": "391", "tools": []}
    samples = [{"raw_prompt": [{"role": "user", "content": QUESTION}],
                "extra_info": {"rollout_task": task, "rollout_environment": "math"}, "uid": uid}
               for uid in ("right", "right", "wrong", "wrong")]
    try:
        # The rendered math prompt (system prompt, tool descriptions, question) is long in
        # the tiny tokenizer's 512-token vocabulary.
        res = await run_verl(address, samples, tmp_path, environment="math",
                             prompt_length=4096, response_length=64)
        t, nt = res["tensors"], res["non_tensors"]
        async with RolloutClient(address) as client:
            stored = [(await client.get_job(jid, include_trajectory=True)).trajectory
                      for jid in nt["rollout_job_id"]]
    finally:
        await server.stop(0.2)
        await pool.close()

    assert len(stored) == 4 and nt["rollout_valid"] == [True] * 4
    for row, traj in enumerate(stored):
        right = row < 2
        assert sum(t["rm_scores"][row]) == (1.0 if right else 0.0)
        # The service's token sequence, exactly: prompt + model answer, nothing re-tokenized.
        ids = [i for turn in traj.turns
               for i in (*turn.prompt_ids, *turn.output_ids, *turn.observation_ids)]
        p = len(traj.turns[0].prompt_ids)
        attn = t["attention_mask"][row]
        kept = [i for i, a in zip(t["input_ids"][row], attn, strict=True) if a]
        assert kept == ids
        # The loss mask covers exactly what the policy emitted: its message and end of turn.
        answer = tok.encode(RIGHT if right else WRONG, add_special_tokens=False)
        masked = [i for i, m in zip(t["responses"][row], t["response_mask"][row], strict=True)
                  if m]
        assert masked == [*answer, tok.convert_tokens_to_ids("<|im_end|>")]
        # The prompt is the chat template's rendering of the task, with the question in it.
        assert QUESTION in tok.decode(ids[:p]) and "<|im_start|>assistant" in tok.decode(ids[:p])
        # A scripted policy emits each token with probability 1: logprob 0 on every position.
        assert t["rollout_log_probs"][row] == [0.0] * len(t["rollout_log_probs"][row])
        assert (nt["min_global_steps"][row], nt["max_global_steps"][row]) == (5, 5)
        assert t["prompts"][row][-p:] == ids[:p]
