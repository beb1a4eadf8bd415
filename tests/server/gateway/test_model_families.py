"""The gateway over other chat-template families: tools in the template (Llama 3.1, calls as
bare JSON, results in the ipython role), no tool role and strict alternation (Gemma: results
come back as one user message), and a generation prompt that opens reasoning (Qwen3-style
ChatML). In each, a tool-call exchange stays one sequence with the scripted ids exact."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from rollout.runtime.types import JobSpec, Limits, SamplingParams, Trajectory
from rollout.server.gateway import Gateway
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.scripted import ScriptedEngine
from tests.runtime.chat_families import (
    gemma_tokenizer,
    llama31_tokenizer,
    thinking_chatml_tokenizer,
)
from tests.server.gateway.conftest import openai_client
from tests.server.gateway.test_chat_completions import TASK, TOOLS, assistant_echo, call

pytestmark = pytest.mark.timeout(60)

FAMILIES = {
    "llama31": (llama31_tokenizer, 'Listing.\n{"name": "bash", "parameters": {"command": "ls"}}',
                "<|start_header_id|>ipython<|end_header_id|>"),
    "gemma": (gemma_tokenizer, "Listing.\n" + call("bash", command="ls"),
              "<start_of_turn>user\n[bash result]"),
    "thinking": (thinking_chatml_tokenizer,
                 "I should list.\n</think>\n\nListing.\n" + call("bash", command="ls"),
                 "<|im_start|>tool\n"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_a_tool_exchange_is_one_exact_sequence(family: str, tmp_path: Path) -> None:
    make_tok, first_reply, observation_marker = FAMILIES[family]
    # Where the generation prompt opens reasoning, the model closes it before it answers.
    second_reply = "Seen it.\n</think>\n\nDone." if family == "thinking" else "Done."
    tok = make_tok()
    engine = ScriptedEngine(tok, {"job": [first_reply, second_reply]})
    pool = BackendPool([engine], health_interval_s=0)
    gateway = await Gateway(tmp_path).start()
    try:
        lease = await gateway.open(JobSpec("job", "harness", {}, sampling=SamplingParams(seed=1),
                                           limits=Limits(max_turns=4)), pool)
        client = openai_client(lease)
        a1 = (await client.chat.completions.create(model="m", messages=TASK, tools=TOOLS)
              ).choices[0].message
        assert a1.content == "Listing."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in a1.tool_calls] == [
            ("bash", {"command": "ls"})]
        history = [*TASK, assistant_echo(a1),
                   {"role": "tool", "tool_call_id": a1.tool_calls[0].id, "content": "a.txt"}]
        a2 = (await client.chat.completions.create(model="m", messages=history, tools=TOOLS)
              ).choices[0].message
        assert a2.content == "Done." and not a2.tool_calls
        capture = await gateway.close(lease)
    finally:
        await gateway.stop()
        with contextlib.suppress(Exception):
            await pool.close()
    scripted = [[*tok.encode(r, add_special_tokens=False), tok.eos_token_id]
                for r in (first_reply, second_reply)]
    assert len(capture.segments) == 1
    assert [t.output_ids for t in capture.turns] == scripted
    traj = Trajectory(job_id="job", turns=capture.turns)
    assert traj.token_ids == list(engine.requests[1].prompt_ids) + scripted[1]
    assert [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m] == [
        *scripted[0], *scripted[1]]
    observation = tok.decode(capture.turns[0].observation_ids)
    assert observation_marker in observation and "a.txt" in observation
