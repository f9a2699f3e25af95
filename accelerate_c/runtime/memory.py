# accelerate_c/runtime/memory.py: HF's memory helpers: `clear_device_cache`, `release_memory` and the
# `find_executable_batch_size` decorator (retry with a smaller batch after an out-of-memory error), with
# HF 1.15's semantics: the batch size is multiplied by 0.9 after each OOM unless `reduce_batch_size_fn` says
# otherwise, and memory is released (gc + the device cache) before the first try and after every OOM.
# give_back_freed_memory: the C heap's free pages back to the system, called once after prepare() and once after
# the first optimizer step (what sharding replaced and the optimizer's first-step temporaries are freed then; glibc
# keeps freed blocks below its mmap threshold in its arenas, so the process would otherwise go on holding them).
# tune_cpu_heap: where large CPU tensors live (ACCELERATE_C_LARGE_TENSOR_PAGES, at Accelerator() on CPU, by default
# where the strategy says so: ZeRO-3 / FULL_SHARD, which gather and free every unit twice per step): each
# tensor of 2 MiB and more in a mapping of its own with transparent huge pages (torch's THP_MEM_ALLOC_ENABLE), and
# glibc's mmap threshold fixed at 4 MiB. By default glibc raises that threshold to the size of each large block
# freed, so a step's temporaries (gathered units, weight gradients, optimizer scratch) land in the heap, where a
# small long-lived block placed among them keeps the pages of the freed ones resident and the top of the heap is
# given back and faulted in again 4 KiB at a time from step to step (benchmarks/memory.py: 100-400 MiB per rank held
# this way, and 50-300 thousand page faults per step). Not the default elsewhere: a fresh mapping is zero-filled by
# the system on first touch, which costs DDP and ZeRO-2 3-9 % of a small model's step (benchmarks/zero_step.py,
# the *_glibc kinds) where their heap reuse was cheap and their memory already low.
# Not for: the Accelerator's own bookkeeping (Accelerator.free_memory calls release_memory).
from __future__ import annotations

import functools
import gc
import inspect
import logging
from typing import Any, Callable, Optional

import torch

from ..base import settings

logger = logging.getLogger(__name__)

# The messages that mean "out of memory" (CUDA/HIP/XPU, MPS, cuDNN's unsupported-size error, the CPU
# allocator, HPU), as HF matches them.
_OOM_MESSAGES = (
    " out of memory.",
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",
)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Empties the caching allocator of the accelerator in use (optionally after gc.collect(), which is slow)."""
    if garbage_collection:
        gc.collect()
    for name in ("xpu", "mlu", "sdaa", "musa", "npu"):
        backend = getattr(torch, name, None)
        try:
            available = backend is not None and backend.is_available()
        except Exception:  # a backend stub that cannot answer
            available = False
        if available:
            backend.empty_cache()
            return
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        torch.mps.empty_cache()
    elif torch.cuda.is_available():
        torch.cuda.empty_cache()


def give_back_freed_memory() -> Optional[bool]:
    """Returns the C heap's free pages to the system (glibc's malloc_trim, GIL released): True when some were
    released, False when none, None where the C library has no such call. Costs a walk of the heap's free
    lists (milliseconds): for the few points where a run frees most of what it held, not for every step."""
    from .. import _C
    return _C.heap_trim()


MMAP_THRESHOLD = 4 << 20  # not below torch's 2 MiB huge-page threshold: a smaller mapped block faults in 4 KiB pages
_PROBE_BYTES = 2 << 20    # torch's huge-page threshold
_tuned: Optional[bool] = None  # None: not decided yet in this process


def tune_cpu_heap(strategy_wants: bool, env: Optional[dict] = None) -> bool:
    """Once per process, where ACCELERATE_C_LARGE_TENSOR_PAGES says so ("auto": where `strategy_wants`, "on",
    "off"): large CPU tensors in huge-page mappings of their own (THP_MEM_ALLOC_ENABLE=1 where the user has not
    set it) and a fixed 4 MiB mmap threshold (glibc; elsewhere nothing). torch reads the variable at its first tensor
    of 2 MiB or more: where one was made before (or the system has no transparent huge pages) the threshold is left
    alone too, since mapped blocks would then fault in 4 KiB at a time, and the run goes on with glibc's defaults
    (logged). Returns whether the policy is on."""
    global _tuned
    mode = settings.get("LARGE_TENSOR_PAGES", env)
    if _tuned is not None or mode == "off" or (mode == "auto" and not strategy_wants):
        return bool(_tuned)
    settings.env_setdefault("THP_MEM_ALLOC_ENABLE", "1")
    _tuned = _torch_marks_huge_pages()
    if _tuned:
        from .. import _C
        _C.heap_mmap_threshold(MMAP_THRESHOLD)
    else:
        logger.info("large CPU tensors stay in the C heap (glibc's defaults): torch made a tensor of 2 MiB or more "
                    "before Accelerator() with THP_MEM_ALLOC_ENABLE unset, or the system has no transparent huge "
                    "pages (docs/sharding.md, 'Memory a rank holds')")
    return _tuned


def _torch_marks_huge_pages() -> bool:
    """Whether torch's CPU allocator now marks a fresh tensor of 2 MiB for transparent huge pages (its mapping's
    VmFlags in /proc/self/smaps say "hg") and the system may give them (not "never")."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return False
        probe = torch.empty(_PROBE_BYTES, dtype=torch.uint8)
        ptr, inside = probe.data_ptr(), False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0] if line.strip() else ""
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= ptr < hi
                elif inside and head == "VmFlags:":
                    return "hg" in line.split()[1:]
    except (OSError, ValueError):
        pass
    return False


def release_memory(*objects: Any) -> list:
    """Returns a list of None, one per object (reassign your variables to it), after gc and an emptied cache."""
    objects = [None] * len(objects)
    clear_device_cache(garbage_collection=True)
    return objects


def should_reduce_batch_size(exception: Exception) -> bool:
    """True when `exception` is an out-of-memory RuntimeError (single-argument, as torch raises them)."""
    if isinstance(exception, RuntimeError) and len(exception.args) == 1:
        return any(msg in str(exception.args[0]) for msg in _OOM_MESSAGES)
    return False


def find_executable_batch_size(function: Optional[Callable] = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Optional[Callable[[], int]] = None) -> Callable:
    """Decorator: calls `function(batch_size, *args, **kwargs)` starting at `starting_batch_size`; after an
    out-of-memory error it frees memory, reduces the batch size (x0.9, or `reduce_batch_size_fn()`) and tries
    again. Raises RuntimeError when the batch size reaches 0; any other exception propagates unchanged.
    The batch size reached is kept for later calls of the decorated function, as in HF."""
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    batch_size = starting_batch_size
    if reduce_batch_size_fn is None:
        def reduce_batch_size_fn() -> int:
            nonlocal batch_size
            batch_size = int(batch_size * 0.9)
            return batch_size

    def decorator(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        clear_device_cache(garbage_collection=True)
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            passed = ", ".join(f"{name}={value}" for name, value in zip(params[1:], args[1:]))
            raise TypeError(f"Batch size was passed into `{function.__name__}` as the first argument when called."
                            f"Remove this as the decorator already does so: `{function.__name__}({passed})`")
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as e:
                if not should_reduce_batch_size(e):
                    raise
            # Outside the except block the failed try's exception, traceback and frames (which hold its
            # tensors) are gone, so this collect really frees them before the next try (HF collects while
            # they are still referenced).
            clear_device_cache(garbage_collection=True)
            batch_size = reduce_batch_size_fn()

    return decorator
