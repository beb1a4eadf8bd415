"""Runs inside .venv-verl: verl's own GRPO advantage, one batch per line.

Reads JSON lines ``{"scores": [...], "uids": [...], "trained": [...], "norm": bool}`` on
stdin and writes, per line, ``{"advantages": [...]}``: ``compute_grpo_outcome_advantage`` from
verl's ``core_algos`` (float64, so that what the test compares is the algebra, not float32
rounding), read at each row's last response token; an untrained row has an all-zero response
mask, which verl multiplies in.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage


def advantages(req: dict) -> list[float]:
    n = len(req["scores"])
    rewards = torch.zeros((n, 2), dtype=torch.float64)
    rewards[:, 1] = torch.tensor(req["scores"], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0] if t else [0.0, 0.0] for t in req["trained"]],
                        dtype=torch.float64)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, np.array(req["uids"], dtype=object),
                                            norm_adv_by_std_in_grpo=req["norm"])
    return [float(a) for a in adv[:, 1]]


def main() -> None:
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps({"advantages": advantages(json.loads(line))}), flush=True)


if __name__ == "__main__":
    main()
