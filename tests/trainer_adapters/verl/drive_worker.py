"""Runs inside .venv-verl: verl's real AgentLoopWorker.generate_sequences on a DataProto.

Usage: drive_worker.py REQUEST.json RESULT.json, where the request holds the service address,
the tokenizer/model directory, the lengths and the samples (``extra_info`` with a
``rollout_task`` per sample, a ``uid`` per group). The result holds the batch verl produced,
as lists, for the test in the main environment to compare with what the tasks spell out.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any


def build_config(req: dict[str, Any]) -> Any:
    import verl.trainer.config as config_pkg
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    config_dir = str(Path(config_pkg.__file__).parent)
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={req['model_dir']}",
            f"actor_rollout_ref.rollout.prompt_length={req['prompt_length']}",
            f"actor_rollout_ref.rollout.response_length={req['response_length']}",
            f"actor_rollout_ref.rollout.n={req['n']}",
            f"+rollout_service.neutral_wait_s={req.get('neutral_wait_s', 60)}",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            # Mandatory in verl's schema; its engine is never started (the service generates).
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.agent.default_agent_loop=rollout_service",
            f"+rollout_service.address={req['address']}",
            f"+rollout_service.environment={req.get('environment', 'episode')}",
            f"+rollout_service.reward_components=[{','.join(req['components'])}]",
        ])
    with open_dict(cfg):
        # The model dir holds only a tiny config and tokenizer: no flash-attn on a CPU.
        cfg.actor_rollout_ref.model.override_config = {"attn_implementation": "eager"}
    OmegaConf.resolve(cfg)
    return cfg


async def main(req: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, _agent_loop_registry
    from verl.protocol import DataProto

    # Registered by `import verl` through the verl.plugins entry point, not by this script.
    assert "rollout_service" in _agent_loop_registry, sorted(_agent_loop_registry)
    worker = AgentLoopWorker(build_config(req), llm_client=None)
    samples = req["samples"]
    batch = DataProto.from_dict(non_tensors={
        "raw_prompt": np.array([s["raw_prompt"] for s in samples], dtype=object),
        "extra_info": np.array([s["extra_info"] for s in samples], dtype=object),
        "uid": np.array([s["uid"] for s in samples], dtype=object),
        "index": np.arange(len(samples)),
        "data_source": np.array(["episode"] * len(samples), dtype=object),
    })
    out = await worker.generate_sequences(batch)
    tensors = {k: out.batch[k].tolist() for k in out.batch.keys()}
    non_tensors = {k: [_plain(x) for x in v] for k, v in out.non_tensor_batch.items()
                   if k not in ("raw_prompt", "extra_info")}
    return {"tensors": tensors, "non_tensors": non_tensors,
            "reward_extra_keys": list(out.meta_info.get("reward_extra_keys", [])),
            "advantages": {str(norm): advantages(out, norm) for norm in (True, False)},
            "data_metrics": data_metrics(out)}


def data_metrics(out: Any) -> dict[str, float]:
    """verl's own step metrics (``compute_data_metrics``, what its trainer logs) over the batch
    with GRPO advantages, as the legacy trainer computes them."""
    import copy

    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.metric_utils import compute_data_metrics
    from verl.trainer.ppo.ray_trainer import compute_advantage

    data = copy.deepcopy(out)
    data.batch["token_level_scores"] = data.batch["rm_scores"]
    data.batch["token_level_rewards"] = data.batch["rm_scores"]
    data = compute_advantage(data, adv_estimator=AdvantageEstimator.GRPO)
    return {k: float(v) for k, v in compute_data_metrics(data, use_critic=False).items()
            if k.startswith(("critic/score", "critic/rewards", "response_length"))}


def advantages(out: Any, norm_by_std: bool) -> list[float]:
    """verl's own GRPO advantage of each row (legacy trainer: rows grouped by ``uid``), read
    at the row's first trained token (0 for a masked row, which verl multiplies by its mask)."""
    import copy

    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.ray_trainer import compute_advantage

    data = copy.deepcopy(out)
    data.batch["token_level_rewards"] = data.batch["rm_scores"]
    data = compute_advantage(data, adv_estimator=AdvantageEstimator.GRPO,
                             norm_adv_by_std_in_grpo=norm_by_std)
    adv, mask = data.batch["advantages"], data.batch["response_mask"]
    return [float(adv[i, mask[i].nonzero()[0, 0]]) if mask[i].any() else 0.0
            for i in range(adv.shape[0])]


def _plain(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x


if __name__ == "__main__":
    request = json.loads(Path(sys.argv[1]).read_text())
    result = asyncio.run(main(request))
    Path(sys.argv[2]).write_text(json.dumps(result))
