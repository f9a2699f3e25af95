# accelerate_c/bigmodel/prefetch.py: what we add to HF's disk offload. When an offloaded module's forward starts,
# one background thread reads the weights of the module that runs next (safetensors ranges read with pread into
# fresh memory: the read syscalls and torch's kernels both run without the GIL), so the next module's weights are
# in memory when its forward starts instead of being read then, serially, as in HF. "Next" is the order the
# modules ran in the previous forward (the model's module order before the first one has finished). Reads stay at
# most half of the largest offloaded device-map block (a decoder layer) ahead of the module that runs, and always one
# module: memory is the running block's weights plus at most half a block more (infer_auto_device_map keeps room
# for the largest layer on the executing device, so resident memory stays near the budget + the largest layer).
# Read weights live in mappings of their own (offload.read_weight); the loader's RegionPool keeps up to that much
# (the running block and half a block) mapped between reads, so the next layer's read reuses the last one's memory.
# Not for: the hooks (hooks.py) or the file format (offload.py).
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from torch import nn

from .hooks import AlignDevicesHook, SequentialHook


class Prefetcher:
    """Shared by the offloaded AlignDevicesHooks of one dispatched model (hook.prefetcher). Reads run in the order the
    modules' forwards are expected in, one at a time, and stay at most `ahead_bytes` ahead of the module that runs.
    `blocks`: each hook's device-map block (a decoder layer), for the first forward's guess."""

    def __init__(self, hooks: list[tuple[AlignDevicesHook, nn.Module]], ahead_bytes: int = 0,
                 blocks: Optional[list[str]] = None) -> None:
        self.modules = {id(h): m for h, m in hooks}
        self.by_id = {id(h): h for h, _ in hooks}
        self.nbytes = {id(h): _bytes(h, m) for h, m in hooks}
        self.ahead_bytes = ahead_bytes
        self.order = [id(h) for h, _ in hooks]  # registration order until one forward has been seen
        names = blocks or [str(i) for i in range(len(hooks))]
        first: dict[str, int] = {}
        for i, name in enumerate(names):
            first.setdefault(name, i)
        # hook id -> index in the registration order of its block's first hook
        self.block_start = {id(h): first[name] for (h, _), name in zip(hooks, names)}
        self.observed = False  # True once a whole forward's order is known
        self.seen: dict[int, None] = {}  # the hooks that ran in this forward, in their order
        self.ahead: dict = {}  # hook id -> Future, in the order they are expected to be taken
        self.lock = threading.Lock()
        self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="accelerate_c-prefetch")
        for h, _ in hooks:
            h.prefetcher = self

    def _read(self, key: int) -> dict:
        hook, module = self.by_id[key], self.modules[key]
        return {n: hook.weights_map[n] for n in hook.offloaded_names(module)}

    def take(self, hook: AlignDevicesHook) -> Optional[dict]:
        """The weights read ahead for `hook`, or None (read them now)."""
        with self.lock:
            found = self.ahead.pop(id(hook), None)
        return None if found is None else found.result()  # a read error surfaces in the forward that needs it

    def _upcoming(self, key: int) -> list[int]:
        """The hooks expected to run after `key`: the last forward's order after it; in the first forward, the
        registration order from the start of `key`'s block (a block's modules need not run in the order they were
        registered: a decoder layer's norms are registered after its linears), less those that ran already."""
        if self.observed:
            try:
                return self.order[self.order.index(key) + 1:]
            except ValueError:
                return []
        return [k for k in self.order[self.block_start[key]:] if k not in self.seen]

    def started(self, hook: AlignDevicesHook, module: nn.Module) -> None:
        """`hook`'s forward has its weights: note the order and queue reads of the modules expected next, up to
        `ahead_bytes` (always the next one). Reads queued for modules that ran without them are dropped."""
        key = id(hook)
        with self.lock:
            if key in self.seen:  # a new forward: the last one's order is the guess from now on
                self.order, self.seen, self.observed = list(self.seen), {}, True
                stale = list(self.ahead)
            else:
                stale = [k for k in self.ahead if k in self.seen]
            for k in stale:
                self.ahead.pop(k).cancel()
            self.seen[key] = None
            total = sum(self.nbytes[k] for k in self.ahead)
            for nxt in self._upcoming(key):
                if nxt in self.ahead:
                    continue
                if self.ahead and total + self.nbytes[nxt] > self.ahead_bytes:
                    break
                self.ahead[nxt] = self.reader.submit(self._read, nxt)
                total += self.nbytes[nxt]

    def close(self) -> None:
        with self.lock:
            for fut in self.ahead.values():
                fut.cancel()
            self.ahead.clear()
        self.reader.shutdown(wait=True)


def _bytes(hook: AlignDevicesHook, module: nn.Module) -> int:
    tensors = dict(module.named_parameters(recurse=hook.place_submodules))
    tensors.update(module.named_buffers(recurse=hook.place_submodules))
    return sum(tensors[n].numel() * tensors[n].element_size() for n in hook.offloaded_names(module) if n in tensors)


def _align_hooks(hook: Any) -> list[AlignDevicesHook]:
    if isinstance(hook, SequentialHook):
        return [h for inner in hook.hooks for h in _align_hooks(inner)]
    return [hook] if isinstance(hook, AlignDevicesHook) else []


def attach_prefetcher(model: nn.Module, device_map: Optional[dict] = None) -> Optional[Prefetcher]:
    """A Prefetcher over the model's offloaded hooks whose weights are (partly) on disk; None when there are none.
    Reads go ahead by half the largest block of `device_map` that is on disk (none: one module)."""
    found, blocks, block_of = [], {}, []
    for name, module in model.named_modules():
        for hook in _align_hooks(getattr(module, "_hf_hook", None)):
            probe = getattr(hook.weights_map, "is_on_disk", None)
            if hook.offload and probe is not None and any(probe(n) for n in hook.offloaded_names(module)):
                found.append((hook, module))
                block = max((k for k in (device_map or {}) if k == "" or name == k or name.startswith(k + ".")),
                            key=len, default=name)
                blocks[block] = blocks.get(block, 0) + _bytes(hook, module)
                block_of.append(block)
    if not found:
        return None
    largest = max(blocks.values(), default=0)
    for hook, _ in found:  # what a forward holds at most: the running block and the reads ahead of it
        pool = getattr(hook.weights_map, "pool", None)
        if pool is not None:
            pool.set_cap(max(pool.cap, largest + largest // 2))
    return Prefetcher(found, largest // 2, block_of)
