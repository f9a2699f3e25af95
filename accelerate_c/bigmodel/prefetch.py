# accelerate_c/bigmodel/prefetch.py: what we add to HF's disk offload. When an offloaded module's forward starts,
# one background thread reads the weights of the module that runs next (safetensors ranges read with pread into
# fresh memory: the read syscalls and torch's kernels both run without the GIL), so the next module's weights are
# in memory when its forward starts instead of being read then, serially, as in HF. "Next" is the order the
# modules ran in the previous forward (the model's module order before the first one has finished). At most one
# read is ahead: memory is the current module's weights plus the next one's (infer_auto_device_map keeps room for
# the largest layer on the executing device, so the budget holds: resident layers + 2 x the largest layer at most).
# Not for: the hooks (hooks.py) or the file format (offload.py).
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from torch import nn

from .hooks import AlignDevicesHook, SequentialHook


class Prefetcher:
    """Shared by the offloaded AlignDevicesHooks of one dispatched model (hook.prefetcher)."""

    def __init__(self, hooks: list[tuple[AlignDevicesHook, nn.Module]]) -> None:
        self.modules = {id(h): m for h, m in hooks}
        self.by_id = {id(h): h for h, _ in hooks}
        self.order = [id(h) for h, _ in hooks]  # registration order until one forward has been seen
        self.seen: list[int] = []
        self.ahead: Optional[tuple[int, Future]] = None
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="accelerate_c-prefetch")
        for h, _ in hooks:
            h.prefetcher = self

    def _read(self, key: int) -> dict:
        hook, module = self.by_id[key], self.modules[key]
        return {n: hook.weights_map[n] for n in hook.offloaded_names(module)}

    def take(self, hook: AlignDevicesHook) -> Optional[dict]:
        """The weights read ahead for `hook`, or None (read them now)."""
        with self.lock:
            ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        key, future = ahead
        if key != id(hook):
            future.cancel()  # a wrong guess: its memory is dropped with the future
            return None
        return future.result()  # a read error surfaces here, in the forward that needs the weights

    def started(self, hook: AlignDevicesHook, module: nn.Module) -> None:
        """`hook`'s forward has its weights: note the order and start reading the next module's weights."""
        key = id(hook)
        if key in self.seen:  # a new forward: the last one's order is the guess from now on
            self.order, self.seen = self.seen, []
        self.seen.append(key)
        try:
            nxt = self.order[self.order.index(key) + 1]
        except (ValueError, IndexError):
            return
        with self.lock:
            if self.ahead is None:
                self.ahead = (nxt, self.pool.submit(self._read, nxt))

    def close(self) -> None:
        with self.lock:
            ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead[1].cancel()
        self.pool.shutdown(wait=True)


def _align_hooks(hook: Any) -> list[AlignDevicesHook]:
    if isinstance(hook, SequentialHook):
        return [h for inner in hook.hooks for h in _align_hooks(inner)]
    return [hook] if isinstance(hook, AlignDevicesHook) else []


def attach_prefetcher(model: nn.Module) -> Optional[Prefetcher]:
    """A Prefetcher over the model's offloaded hooks whose weights are (partly) on disk; None when there are none."""
    found = []
    for module in model.modules():
        for hook in _align_hooks(getattr(module, "_hf_hook", None)):
            probe = getattr(hook.weights_map, "is_on_disk", None)
            if hook.offload and probe is not None and any(probe(n) for n in hook.offloaded_names(module)):
                found.append((hook, module))
    return Prefetcher(found) if found else None
