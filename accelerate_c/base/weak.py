# accelerate_c/base/weak.py: tensor hooks that do not keep their owner alive. A hook registered on a parameter
# (register_post_accumulate_grad_hook) that is a bound method of an object holding that parameter makes a cycle
# the garbage collector cannot break (torch keeps tensor hooks out of its traversal): the owner, its buffers and
# everything they map would then live until the process ends, and a notebook or sweep that prepares model after
# model runs out of memory (or, over shared memory, of regions). `weak_hook(self._on_grad)` calls the method while
# its object lives and does nothing after.
# Not for: module hooks (a module's hook dicts are ordinary Python objects the collector sees through).
from __future__ import annotations

import weakref
from typing import Any, Callable


def weak_hook(method: Callable[..., Any]) -> Callable[..., Any]:
    """A function that calls the bound `method` through a weak reference to its object."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any, **kwargs: Any) -> Any:
        fn = ref()
        return fn(*args, **kwargs) if fn is not None else None
    return hook
