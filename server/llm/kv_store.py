"""Per-session KV caches kept between the turns of a trajectory, bounded by a byte budget.

Turn k+1 of an agent trajectory repeats turn k's prompt and output and appends a few new
tokens (a tool observation). Keeping the session's keys and values means the engine prefills
only those new tokens. Idle sessions are evicted least-recently-used first once the cached bytes
exceed the budget; a session that is generating is checked out of the store, so it can neither be
evicted nor counted twice.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""Keys and values of one layer, shaped ``[1, kv_heads, tokens, head_dim]``."""


@dataclass
class SessionKV:
    """The cached state of one session: ``tokens[i]``'s keys/values sit at position ``i``."""

    tokens: list[int]
    layers: list[LayerKV]

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in self.layers)

    def crop(self, length: int) -> SessionKV:
        """The first ``length`` positions (views, no copy)."""
        return SessionKV(self.tokens[:length],
                         [(k[:, :, :length], v[:, :, :length]) for k, v in self.layers])


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KVStore:
    """LRU map session id → :class:`SessionKV` under a byte budget. Thread-safe: the engine's
    worker thread checks sessions out and in while the event loop releases them."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, SessionKV] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evictions = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def checkout(self, session_id: str) -> SessionKV | None:
        """Remove and return the session's cache (the caller owns it while generating)."""
        with self._lock:
            entry = self._entries.pop(session_id, None)
            if entry is not None:
                self._bytes -= entry.nbytes
            return entry

    def checkin(self, session_id: str, entry: SessionKV) -> None:
        """Store the session's cache as most recently used, evicting the oldest over budget."""
        size = entry.nbytes
        with self._lock:
            old = self._entries.pop(session_id, None)
            if old is not None:
                self._bytes -= old.nbytes
            if size > self.budget_bytes:
                return  # larger than the whole budget: not worth keeping
            self._entries[session_id] = entry
            self._bytes += size
            while self._bytes > self.budget_bytes and self._entries:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
                self.evictions += 1

    def drop(self, session_id: str) -> None:
        with self._lock:
            entry = self._entries.pop(session_id, None)
            if entry is not None:
                self._bytes -= entry.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
