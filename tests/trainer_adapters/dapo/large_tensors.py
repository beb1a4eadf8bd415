"""A test helper: how many bytes of large tensors are alive at once while some torch code runs
(counted per storage, over every op the dispatcher sees), so memory tests assert what is held,
not what the machine's allocator happens to report."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargeTensors(TorchDispatchMode):
    """Bytes of the large tensors alive at once (by storage), over every op run inside."""

    def __init__(self, floor: int) -> None:
        super().__init__()
        self.floor = floor
        self.alive: dict[int, list[tuple[weakref.ref[torch.Tensor], int]]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= self.floor:
                storage = t.untyped_storage()
                self.alive.setdefault(storage.data_ptr(), []).append(
                    (weakref.ref(t), storage.nbytes()))
        live = 0
        for key in list(self.alive):
            refs = [(r, n) for r, n in self.alive[key] if r() is not None]
            if refs:
                self.alive[key] = refs
                live += refs[0][1]
            else:
                del self.alive[key]
        self.peak = max(self.peak, live)
        return out
