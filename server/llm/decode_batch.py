"""The decode batch of the in-process engine: the active sequences' KV, left-padded.

Rebuilt only when membership changes (a sequence joins or leaves); between changes each decode
step appends one position to every row. Row ``i`` holds its sequence's
``length`` positions right-aligned; the attention mask hides the padding on the left.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

import torch

from server.llm.kv_store import LayerKV, SessionKV


class Member(Protocol):
    """What the batch needs from a sequence."""

    length: int
    """Positions of this sequence that hold KV."""
    kv: SessionKV | None
    """The sequence's own KV until it joins the batch (then None: the batch owns it)."""


M = TypeVar("M", bound=Member)


def cache_from(layers: list[LayerKV]) -> Any:
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=[(k, v) for k, v in layers])


def layers_of(cache: Any) -> list[LayerKV]:
    return [(layer.keys, layer.values) for layer in cache.layers]


class DecodeBatch(Generic[M]):
    """The active sequences' KV, left-padded to a common width ``[B, heads, width, dim]``."""

    def __init__(self, seqs: list[M], cache: Any, width: int) -> None:
        self.seqs = seqs
        self.cache = cache
        self.width = width

    def pad(self, seq: M) -> int:
        return self.width - seq.length

    def attention_mask(self, device: torch.device) -> torch.Tensor:
        """Mask over the cached width plus the token being decoded."""
        mask = torch.ones(len(self.seqs), self.width + 1, dtype=torch.long, device=device)
        for row, seq in enumerate(self.seqs):
            mask[row, : self.pad(seq)] = 0
        return mask

    def extract(self, seq: M) -> list[LayerKV]:
        row, pad = self.seqs.index(seq), self.pad(seq)
        return [(layer.keys[row:row + 1, :, pad:].clone(),
                 layer.values[row:row + 1, :, pad:].clone()) for layer in self.cache.layers]

    @classmethod
    def rebuild(cls, old: DecodeBatch[M] | None, seqs: list[M]) -> DecodeBatch[M]:
        """The batch for ``seqs``: kept as is when membership did not change, else re-padded."""
        if old is not None and old.seqs == seqs:
            return old
        width = max(s.length for s in seqs)
        per_seq: list[list[LayerKV]] = []
        for seq in seqs:
            if old is not None and seq in old.seqs:
                row, pad = old.seqs.index(seq), old.pad(seq)
                per_seq.append([(layer.keys[row:row + 1, :, pad:],
                                 layer.values[row:row + 1, :, pad:]) for layer in old.cache.layers])
            else:
                assert seq.kv is not None
                per_seq.append(seq.kv.layers)
                seq.kv = None  # the batch owns its KV from now on
        layers = []
        for idx in range(len(per_seq[0])):
            keys = torch.cat([left_pad(kv[idx][0], width) for kv in per_seq])
            values = torch.cat([left_pad(kv[idx][1], width) for kv in per_seq])
            layers.append((keys, values))
        return cls(list(seqs), cache_from(layers), width)


def left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - t.shape[2]
    if missing == 0:
        return t
    return torch.nn.functional.pad(t, (0, 0, missing, 0))
