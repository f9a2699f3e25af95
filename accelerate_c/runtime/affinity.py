# accelerate_c/runtime/affinity.py: HF's `--enable_cpu_affinity` (ACCELERATE_CPU_AFFINITY=1 in each rank): binds the
# process to the CPUs that suit its local rank, once, when PartialState is made. On a GPU, the CPUs of the GPU's NUMA
# node (as HF: from NVML, else from the PCI device's local_cpulist in sysfs), within the CPUs the process may use. On
# the CPU (where HF binds nothing) the usable CPUs are split into one contiguous, disjoint share per local rank, so
# ranks that meet at every collective stop trading cores (a 2-rank tensor-parallel step spent 5.3 % of its time in
# collectives unbound and 3.7 % bound, one run each, tp_step.py).
# Not for: thread counts (the launcher's OMP_NUM_THREADS, state.py's set_num_threads), choosing the device (device.py).
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

logger = logging.getLogger(__name__)
MAX_CPU = 65535  # above any kernel's CPU count: a larger number in a cpulist is garbage, not a range to expand


def parse_cpu_list(text: str) -> list[int]:
    """The kernel's cpulist format ("0-3,8,10-11") as a sorted list; a malformed entry (or a CPU number above
    MAX_CPU) is a ValueError naming it."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"cpu list {text.strip()!r}: {part!r} is not a CPU number or range") from None
        if a < 0 or b < a or b > MAX_CPU:
            raise ValueError(f"cpu list {text.strip()!r}: {part!r} is not a CPU number or range (0..{MAX_CPU})")
        cpus.update(range(a, b + 1))
    return sorted(cpus)


def share_of(usable: list[int], local_index: int, local_count: int) -> list[int]:
    """Local rank `local_index` of `local_count`: its contiguous share of the sorted usable CPUs (the first
    len % count ranks one more); with more ranks than CPUs, CPU local_index mod len alone."""
    cpus = sorted(usable)
    n, k = len(cpus), max(1, local_count)
    if n == 0:
        return []
    if k >= n:
        return [cpus[local_index % n]]
    base, extra = divmod(n, k)
    start = local_index * base + min(local_index, extra)
    return cpus[start:start + base + (1 if local_index < extra else 0)]


def gpu_local_cpus(index: int) -> Optional[list[int]]:
    """The CPUs of GPU `index`'s NUMA node, or None when neither NVML nor sysfs says."""
    try:
        import pynvml as nvml
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        words = nvml.nvmlDeviceGetCpuAffinity(handle, -(-(os.cpu_count() or 1) // 64))
        return [64 * w + b for w, word in enumerate(words) for b in range(64) if (int(word) >> b) & 1]
    except Exception:  # no NVML here: try sysfs
        pass
    bus = getattr(torch.cuda.get_device_properties(index), "pci_bus_id", None)
    if not bus:
        return None
    try:
        with open(f"/sys/bus/pci/devices/{str(bus).lower()}/local_cpulist") as fh:
            return parse_cpu_list(fh.read())
    except (OSError, ValueError):
        return None


def cpus_for(device: torch.device, local_index: int, local_count: int, usable: list[int]) -> list[int]:
    """The CPUs this rank is bound to (see the header); never empty while `usable` is not."""
    if device.type == "cuda":
        node = gpu_local_cpus(device.index if device.index is not None else torch.cuda.current_device())
        inside = sorted(set(node or ()) & set(usable))
        if inside:
            return inside
    return share_of(usable, local_index, local_count)


def apply(device: torch.device, local_index: int, local_count: int, verbose: bool = False) -> list[int]:
    """Binds this process (see the header) and returns the CPUs it now runs on."""
    if not hasattr(os, "sched_setaffinity"):
        return []
    usable = sorted(os.sched_getaffinity(0))
    cpus = cpus_for(device, local_index, local_count, usable)
    if cpus:
        os.sched_setaffinity(0, cpus)
    if verbose:
        logger.info("Assigning %d cpu cores to process %d: %s", len(cpus), local_index, cpus)
    return cpus
