"""The batches of the in-process engine: decode (the active sequences' KV, left-padded) and
prefill (sequences joining together, each with its own cached prefix).

:class:`DecodeBatch` is rebuilt only when membership changes (a sequence joins or leaves); between
changes each decode step appends one position to every row. Row ``i`` holds its sequence's
``length`` positions right-aligned; the attention mask hides the padding on the left.

:class:`PrefillBatch` lets turns that reuse a session's cached KV prefill in one forward even
though their cached prefixes and their new tokens differ in length. Each row is laid out as
``[pad | cached prefix | pad | new tokens]``: the cached prefixes are right-aligned in the
``past_width`` slots of the cache, the new tokens right-aligned in the ``new_width`` input slots
(so the last input column is every row's last prompt token and ``logits_to_keep=1`` works). The
2-D attention mask hides both pads (HF builds the causal 4-D mask from it, holes included) and
each row's position ids continue from its own prefix, so a row computes exactly what it would
alone. Afterwards :meth:`PrefillBatch.row_kv` cuts the two real spans out and joins them.

Padding is not free: a row with 60 new tokens next to one with 170 computes 110 wasted
positions, and prefill is compute-bound, so one padded forward over very unequal rows can cost
more than the rows one at a time, while equal-length rows batch well (``rollout bench llm``,
batched prefill). :func:`plan_prefill` therefore splits the joining
sequences into groups of similar length, trading padding against the fixed cost of a forward.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

import torch

from rollout.server.llm.kv_store import LayerKV, SessionKV


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


def plan_prefill(new_tokens: list[int], overhead_tokens: int) -> list[list[int]]:
    """Split rows into prefill forwards minimising ``sum(overhead + rows * longest)``.

    ``new_tokens[i]`` is row ``i``'s count of tokens to compute; ``overhead_tokens`` is a forward's
    fixed cost (per-layer launches, Python, sampling) expressed in tokens of compute. Returns
    groups of row indices. Sorting by length makes contiguous groups optimal, so an O(n²) DP
    over the sorted rows finds the best split (n is at most the batch size).
    """
    order = sorted(range(len(new_tokens)), key=new_tokens.__getitem__)
    best = [0] + [1 << 62] * len(order)
    cut = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        longest = new_tokens[order[end - 1]]
        for begin in range(end):
            cost = best[begin] + overhead_tokens + (end - begin) * longest
            if cost < best[end]:
                best[end], cut[end] = cost, begin
    groups: list[list[int]] = []
    end = len(order)
    while end > 0:
        groups.append(order[cut[end]:end])
        end = cut[end]
    return groups[::-1]


class PrefillBatch:
    """Inputs of one prefill forward over several sequences; see the module docstring."""

    def __init__(self, prompts: list[list[int]], pasts: list[list[LayerKV] | None],
                 device: torch.device) -> None:
        """``pasts[i]`` is the cached KV of ``prompts[i][:n]`` (n = its length), or None."""
        self.cached = [0 if p is None else p[0][0].shape[2] for p in pasts]
        self.new = [len(t) - c for t, c in zip(prompts, self.cached, strict=True)]
        assert all(n > 0 for n in self.new), "every row must have a token to prefill"
        self.past_width, self.new_width = max(self.cached), max(self.new)
        rows, width = len(prompts), max(self.cached) + max(self.new)
        self.ids = torch.zeros(rows, self.new_width, dtype=torch.long, device=device)
        self.mask = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, self.new_width, dtype=torch.long, device=device)
        for row, (prompt, cached, new) in enumerate(zip(prompts, self.cached, self.new,
                                                        strict=True)):
            self.ids[row, self.new_width - new:] = torch.tensor(prompt[cached:], device=device)
            self.positions[row, self.new_width - new:] = torch.arange(cached, len(prompt),
                                                                      device=device)
            self.mask[row, self.past_width - cached:self.past_width] = 1
            self.mask[row, width - new:] = 1
        self.cache: Any = None
        template = next((p for p in pasts if p is not None), None)
        if template is not None:
            layers: list[LayerKV] = []
            for idx, (k0, v0) in enumerate(template):
                keys = k0.new_zeros(rows, k0.shape[1], self.past_width, k0.shape[3])
                values = v0.new_zeros(rows, v0.shape[1], self.past_width, v0.shape[3])
                for row, (past, cached) in enumerate(zip(pasts, self.cached, strict=True)):
                    if past is not None and cached:
                        keys[row, :, self.past_width - cached:] = past[idx][0][0]
                        values[row, :, self.past_width - cached:] = past[idx][1][0]
                layers.append((keys, values))
            self.cache = cache_from(layers)

    def row_kv(self, cache: Any, row: int) -> list[LayerKV]:
        """Row ``row``'s KV after the forward, contiguous ``[1, heads, prompt, dim]``."""
        if len(self.new) == 1:  # a single row has no padding: keep the tensors, no copy
            return layers_of(cache)
        lo, hi = self.past_width - self.cached[row], self.past_width + self.new_width - \
            self.new[row]
        return [(torch.cat([k[row:row + 1, :, lo:self.past_width], k[row:row + 1, :, hi:]], 2),
                 torch.cat([v[row:row + 1, :, lo:self.past_width], v[row:row + 1, :, hi:]], 2))
                for k, v in layers_of(cache)]


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
