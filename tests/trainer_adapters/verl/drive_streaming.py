"""Runs inside .venv-verl: the streaming manager over two training steps.

Usage: drive_streaming.py REQUEST.json RESULT.json. Each step of the request is a list of
groups (uid, task); the driver builds verl's prompt batch (each prompt repeated ``n`` times,
interleaved, as verl's trainer does), calls ``generate_sequences`` with
``meta_info["global_steps"]`` set to the step's ``global_steps`` (verl counts from 1), and records
what came back, or the error it raised.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def main(req: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    from verl.protocol import DataProto

    from rollout.client.batcher import BatcherConfig
    from rollout.trainer_adapters.verl.agent_loop import ServiceSettings
    from rollout.trainer_adapters.verl.async_manager import StreamingRolloutManager

    n = req["n"]
    manager = StreamingRolloutManager(
        settings=ServiceSettings(address=req["address"], environment="episode",
                                 reward_components=("exact",)),
        prompt_length=req["prompt_length"], response_length=req["response_length"],
        pad_token_id=0, group_size=n,
        batcher=BatcherConfig(groups_per_batch=req["groups_per_batch"], group_size=n,
                              max_rounds=1, max_staleness=0, min_group_size=2),
        client_id="verl-streaming-test")
    steps = []
    try:
        for step in req["steps"]:
            groups = step["groups"]
            rows = [g for g in groups for _ in range(n)]
            batch = DataProto.from_dict(non_tensors={
                "raw_prompt": np.array([[{"role": "user", "content": "q"}]] * len(rows),
                                       dtype=object),
                "extra_info": np.array([{"rollout_task": g["task"]} for g in rows],
                                       dtype=object),
                "uid": np.array([g["uid"] for g in rows], dtype=object),
                "index": np.arange(len(rows)),
            }, meta_info={"global_steps": step["global_steps"]})
            try:
                out = manager.generate_sequences(batch)
            except Exception as exc:  # the test reads what was raised
                steps.append({"error": type(exc).__name__, "message": str(exc)})
                continue
            steps.append({
                "tensors": {k: out.batch[k].tolist() for k in out.batch.keys()},
                "uid": [str(u) for u in out.non_tensor_batch.get("uid", [])],
                "min_global_steps": [int(v) for v in out.non_tensor_batch["min_global_steps"]],
                "reward": [float(v) for v in out.non_tensor_batch.get("reward", [])],
                "stats": out.meta_info["rollout_stats"],
                "policy_version": out.meta_info["policy_version"],
            })
    finally:
        manager.close()
    return {"steps": steps}


if __name__ == "__main__":
    request = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(main(request)))
