"""Runs inside .venv-verl: verl 0.9.1's own GRPO advantage code on the rows the adapters build
for groups whose rollouts have uneven numbers of segments.

Usage: drive_one_vote.py REQUEST.json RESULT.json. The request lists groups of rollouts, each a
reward and its segments (token ids and loss masks) and optionally ``failed``. Two paths:

- ``streaming``: the streaming manager's batch (``StreamingRolloutManager._to_dataproto`` on
  batcher groups), then verl's ``compute_advantage_for_multi_trajectories`` keyed by the rows'
  ``rollout_key``, and, for contrast, verl's stock ``compute_advantage`` keyed by ``uid`` alone;
- ``v1``: the per-sample agent loop's outputs under ``trainer.use_v1`` (``to_verl_samples``, the
  trainable rows as ``AgentLoopOutput``s), put into rows with V1's own ``AgentLoopOutput.as_dict``
  and keys ``{uid}_{session}_{index}`` as ``AgentLoopWorkerTQ._agent_loop_postprocess`` names
  them, then the same verl function.

It records each row's advantage (at its first trained token) with its rollout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def flats_of(rollout: dict[str, Any], job: str) -> tuple[Any, ...]:
    from rollout.client.trajectory import Flat

    segs = rollout["segments"]
    return tuple(Flat(job_id=job, group_id="g", token_ids=s["ids"], loss_mask=s["mask"],
                      logprobs=[-0.5 * m for m in s["mask"]], prompt_length=s["prompt"],
                      reward=rollout["reward"], segment=n, num_segments=len(segs),
                      logprobs_kind="PROCESSED") for n, s in enumerate(segs))


def advantages(data: Any, keys: list[str] | None) -> list[float]:
    import torch
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.ray_trainer import compute_advantage
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    data.batch["token_level_rewards"] = data.batch["rm_scores"]
    if keys is None:
        out = compute_advantage(data, adv_estimator=AdvantageEstimator.GRPO)
    else:
        out = compute_advantage_for_multi_trajectories(
            data, batch_keys=keys, adv_estimator=AdvantageEstimator.GRPO)
    mask = out.batch["response_mask"]
    first = mask.argmax(dim=1)
    return out.batch["advantages"][torch.arange(len(first)), first].tolist()


def streaming(req: dict[str, Any]) -> dict[str, Any]:
    from rollout.client.batcher import Group, Sample
    from rollout.trainer_adapters.verl.agent_loop import ServiceSettings
    from rollout.trainer_adapters.verl.async_manager import StreamingRolloutManager

    groups = []
    for g, group in enumerate(req["groups"]):
        samples = []
        for r, rollout in enumerate(group):
            if rollout.get("failed"):
                continue  # the batcher leaves a failed job out of its group
            flats = flats_of(rollout, f"job-{g}-{r}")
            samples.append(Sample(job_id=f"job-{g}-{r}", delivery_id=0, flat=flats[-1],
                                  turn_versions=(0,), finish_reasons=("stop",),
                                  segments=flats if len(flats) > 1 else ()))
        groups.append(Group(f"verl/u{g}", {"metadata": {"uid": f"u{g}"}}, tuple(samples)))
    manager = StreamingRolloutManager(
        settings=ServiceSettings(), prompt_length=req["prompt_length"],
        response_length=req["response_length"], pad_token_id=0, group_size=4)
    try:
        data = manager._to_dataproto(groups, {"wait_s": 0.0}, 0)
    finally:
        manager.close()
    keys = [str(k) for k in data.non_tensor_batch["rollout_key"]]
    jobs = [str(j) for j in data.non_tensor_batch["rollout_job_id"]]
    return {"keys": keys, "jobs": jobs, "uid": [str(u) for u in data.non_tensor_batch["uid"]],
            "stats": {k: data.meta_info["rollout_stats"][k]
                      for k in ("segments_dropped", "rollouts_untrainable")},
            "per_rollout": advantages(data, keys),
            "per_row": advantages(manager_copy(data), None)}


def manager_copy(data: Any) -> Any:
    import copy

    return copy.deepcopy(data)


def v1(req: dict[str, Any]) -> dict[str, Any]:
    import torch
    from verl.protocol import DataProto
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from rollout.trainer_adapters.verl.agent_loop import _output
    from rollout.trainer_adapters.verl.job_mapping import to_verl_samples
    from rollout.v1 import job_pb2, trajectory_pb2

    keys, fields = [], []
    for g, group in enumerate(req["groups"]):
        for r, rollout in enumerate(group):
            traj = trajectory_pb2.Trajectory(job_id=f"job-{g}-{r}", reward=rollout["reward"])
            for seg in rollout["segments"]:
                traj.segments.add(first_turn=len(traj.turns))
                p = seg["prompt"]
                traj.turns.add(prompt_ids=seg["ids"][:p], output_ids=seg["ids"][p:],
                               output_logprobs=[-0.5] * (len(seg["ids"]) - p),
                               loss_mask=seg["mask"])
            if len(rollout["segments"]) == 1:
                del traj.segments[:]
            state = (job_pb2.Job.State.STATE_FAILED if rollout.get("failed")
                     else job_pb2.Job.State.STATE_SUCCEEDED)
            outcome = SimpleNamespace(trajectory=traj, state=state, error=None)
            samples = to_verl_samples(outcome, prompt_length=req["prompt_length"],
                                      response_length=req["response_length"])
            outputs = [_output(s) for s in samples if any(s.response_mask)]
            for i, out in enumerate(outputs):  # AgentLoopWorkerTQ._agent_loop_postprocess
                keys.append(f"u{g}_{r}_{i}")
                field = out.as_dict()
                field["uid"] = f"u{g}"
                fields.append(field)
    td = list_of_dict_to_tensordict([{k: f[k] for k in ("responses", "response_mask",
                                                         "rm_scores", "uid")} for f in fields])
    data = DataProto(batch=td.to_padded_tensor())  # as PPOTrainer._compute_advantage reads it
    import numpy as np

    data.non_tensor_batch["uid"] = np.array(data.batch.pop("uid").tolist(), dtype=object)
    assert isinstance(data.batch["response_mask"], torch.Tensor)
    jobs = [f"job-{k.split('_')[0][1:]}-{k.split('_')[1]}" for k in keys]
    return {"keys": keys, "jobs": jobs, "per_rollout": advantages(data, keys)}


if __name__ == "__main__":
    request = json.loads(Path(sys.argv[1]).read_text())
    result = {"streaming": streaming(request), "v1": v1(request)}
    Path(sys.argv[2]).write_text(json.dumps(result))
