"""Copy new policy weights into a live model in place (checkpoint directory or state dict).

In-place ``copy_`` keeps every parameter tensor (and anything holding a reference to it) valid,
and costs no second copy of the model in memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch


def read_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors checkpoint (single file or shards) or a ``.bin`` file."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if directory.is_file():
        files = [directory]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        bins = sorted(directory.glob("*.bin")) if directory.is_dir() else []
        if not bins:
            raise FileNotFoundError(f"no *.safetensors or *.bin weights in {directory}")
        state: dict[str, torch.Tensor] = {}
        for path in bins:
            state.update(torch.load(path, map_location="cpu", weights_only=True))
        return state
    state = {}
    for path in files:
        state.update(load_file(str(path)))
    return state


def load_state_dict_into(model: Any, source: Mapping[str, torch.Tensor] | Path) -> None:
    """Load ``source`` into ``model``; refuse a checkpoint of a different architecture."""
    state = dict(source) if isinstance(source, Mapping) else read_checkpoint(source)
    expected = model.state_dict()
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = [k for k in expected if k not in state and k not in tied]
    unexpected = [k for k in state if k not in expected]
    wrong = [k for k, v in state.items() if k in expected and v.shape != expected[k].shape]
    # Check everything before copying anything: a half-loaded model would serve garbage.
    if missing or unexpected or wrong:
        raise ValueError(f"checkpoint does not match the model: missing={missing[:5]} "
                         f"unexpected={unexpected[:5]} wrong_shape={wrong[:5]}")
    with torch.no_grad():
        model.load_state_dict(state, strict=False)
    if tied:
        model.tie_weights()
