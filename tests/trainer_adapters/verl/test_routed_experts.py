"""Routing replay (R3): a tiny random Qwen2-MoE's routed experts go from the in-process engine,
through the trajectory proto and the client's flat view, into a verl row in the form verl's
router replay reads (``AgentLoopOutput.routed_experts``: ``[position][layer][k]`` over prompt
and response, made into its tensor by verl's own ``as_dict``). The expected routing is
recomputed here by one plain forward over the whole sequence."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollout.client.trajectory import flatten
from rollout.runtime.llm import GenerateRequest
from rollout.runtime.types import SamplingParams
from rollout.server.api.proto_convert import turn_to_proto
from rollout.server.llm.transformers_engine import TransformersEngine
from rollout.trainer_adapters.verl.job_mapping import to_verl_sample
from rollout.v1 import job_pb2, trajectory_pb2
from tests.fixtures.tiny_model import tiny_moe_model_dir
from tests.trainer_adapters.venvs import ROOT, VERL_PY, require

pytestmark = pytest.mark.timeout(600)

VERL_SCRIPT = """
import json, sys
import numpy as np
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
d = json.load(sys.stdin)
routed = np.asarray(d["routed"], dtype=np.int16)
out = AgentLoopOutput(prompt_ids=d["prompt"], response_ids=d["response"],
                      response_mask=d["mask"], routed_experts=routed,
                      metrics=AgentLoopMetrics()).as_dict()
print(json.dumps(out["routed_experts"].tolist()))
"""


def expected_routing(model_dir: Path, tokens: list[int]) -> list[list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), output_router_logits=True)
    per_layer = [layer.topk(2, dim=-1).indices for layer in out.router_logits]  # [T, k]
    return [[per_layer[layer][p].tolist() for layer in range(len(per_layer))]
            for p in range(len(tokens))]


async def test_routed_experts_round_trip_to_a_verl_row() -> None:
    model_dir = tiny_moe_model_dir()
    engine = TransformersEngine(model_dir, num_threads=1)
    try:
        prompt = engine.tokenizer.encode("The agent runs a command in the sandbox")
        result = await engine.generate(GenerateRequest(
            prompt_ids=prompt, sampling=SamplingParams(temperature=1.0, seed=3),
            max_tokens=6, session_id="s"))
    finally:
        await engine.close()
    n = len(result.output_ids)
    assert (result.routed_expert_layers, result.routed_expert_top_k) == (2, 2)
    assert len(result.routed_experts) == n * 2 * 2
    # Output token i was sampled at position len(prompt) - 1 + i: the engine's routing there
    # is what one forward over the whole sequence routes there (sets: order within the top-k
    # of equal logits aside).
    want = expected_routing(model_dir, prompt + result.output_ids)
    got = [[result.routed_experts[(i * 2 + layer) * 2:(i * 2 + layer) * 2 + 2]
            for layer in range(2)] for i in range(n)]
    for i in range(n):
        assert [sorted(x) for x in got[i]] == [sorted(x) for x in want[len(prompt) - 1 + i]]

    # Engine -> trajectory proto -> the client's flat view -> a verl row.
    from rollout.runtime.types import Turn

    turn = Turn(prompt_ids=prompt, output_ids=result.output_ids,
                output_logprobs=result.logprobs, routed_experts=result.routed_experts,
                routed_expert_top_k=2, routed_expert_layers=2)
    traj = trajectory_pb2.Trajectory(job_id="moe", state=job_pb2.Job.State.STATE_SUCCEEDED,
                                     turns=[turn_to_proto(turn)], reward=1.0)
    traj = trajectory_pb2.Trajectory.FromString(traj.SerializeToString())
    flat = flatten(traj)
    assert flat is not None and flat.routed_expert_layers == 2
    row = to_verl_sample(SimpleNamespace(trajectory=traj, state=traj.state, error=None),
                         prompt_length=len(prompt), response_length=n)
    assert row.routed_experts is not None
    assert len(row.routed_experts) == len(prompt) + n
    for i in range(n):
        assert row.routed_experts[len(prompt) - 1 + i] == got[i]
    assert row.routed_experts[0] == [[0, 0], [0, 0]]  # not produced by the engine: zeros

    # verl's own conversion keeps it position for position.
    require(VERL_PY)
    proc = subprocess.run(
        [str(VERL_PY), "-c", VERL_SCRIPT], cwd=str(ROOT), env=dict(os.environ),
        input=json.dumps({"prompt": row.prompt_ids, "response": row.response_ids,
                          "mask": row.response_mask, "routed": row.routed_experts}),
        capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == row.routed_experts
