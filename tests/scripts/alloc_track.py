# tests/scripts/alloc_track.py: LiveBytes, a context that tracks the tensor storages created by torch ops inside it
# (a TorchDispatchMode sees every factory and op output) and records the peak of their live bytes, sampled after
# every op: distinct storages an op created (not views of its inputs), by data pointer, at their current size (a storage resized to 0 bytes counts 0; a
# dead tensor counts nothing). Storages made outside torch's ops (the shared-memory shard buffers, torch.frombuffer)
# are not seen: the peak is what construction allocates on top of the engine's own buffers.
# Not for: RSS (the benchmark measures that) or anything timed.
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []
        self.peak = 0

    def _sample(self) -> None:
        alive, seen = [], {}
        for r in self.refs:
            t = r()
            if t is None:
                continue
            alive.append(r)
            s = t.untyped_storage()
            if s.data_ptr():
                seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        self.refs = alive
        self.peak = max(self.peak, sum(seen.values()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # only storages this op created: a view of an input (a slice of a shard buffer) is not an allocation
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and not t.is_meta}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().data_ptr() not in inputs:
                self.refs.append(weakref.ref(t))
        self._sample()
        return out
