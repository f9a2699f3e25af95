# accelerate_c/bigmodel/sizes.py: what a model weighs, module by module, and how much memory each device
# offers (HF's accelerate.utils.modeling helpers with HF 1.15's signatures and results): byte sizes of dtypes,
# "5GB"-style sizes, the size of every submodule (optionally at a load dtype), the largest unsplittable layer, tied
# parameters, the per-device budget (`get_max_memory`) and its balanced split (`get_balanced_memory`), and
# `clean_device_map`. Works on meta tensors (a model built under init_empty_weights).
# Not for: choosing devices (device_map.py) or moving weights (hooks.py, dispatch.py).
from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Iterator, Optional, Union

import torch
from torch import nn

Device = Union[int, str, torch.device]


def convert_file_size_to_int(size: Union[int, str]) -> int:
    """`"5GB"` -> 5_000_000_000, `"1MiB"` -> 1_048_576 (a lower-case `b` means bits); an int is returned as is."""
    bad = ValueError(f"`size` {size} is not in a valid format. Use an integer for bytes, or a string with an unit "
                     "(like '5.0GB').")
    if isinstance(size, int):
        if size < 0:
            raise bad
        return size
    units = (("GIB", 2**30, False), ("MIB", 2**20, False), ("KIB", 2**10, False),
             ("GB", 10**9, True), ("MB", 10**6, True), ("KB", 10**3, True))
    for unit, scale, decimal in units:
        if str(size).upper().endswith(unit):
            try:
                value = int(float(size[:-len(unit)]) * scale)
            except ValueError:
                raise bad from None
            if decimal and size.endswith("b"):
                value //= 8
            if value < 0:
                raise bad
            return value
    raise bad


def dtype_byte_size(dtype: torch.dtype) -> float:
    """Bytes per element (bool: 1/8, as HF counts it; the float8 types: 1)."""
    if dtype == torch.bool:
        return 1 / 8
    if "float8" in str(dtype):
        return 1
    bits = re.search(r"[^\d](\d+)$", str(dtype))
    if bits is None:
        raise ValueError(f"`dtype` is not a valid dtype: {dtype}.")
    return int(bits.group(1)) // 8


def _dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    return dtype


def get_non_persistent_buffers(module: nn.Module, recurse: bool = False, fqns: bool = False) -> set:
    found = set(module._non_persistent_buffers_set)
    if recurse:
        for name, sub in module.named_modules():
            if name:
                found |= {f"{name}.{b}" if fqns else b for b in sub._non_persistent_buffers_set}
    return found


def named_module_tensors(module: nn.Module, include_buffers: bool = True, recurse: bool = False,
                         remove_non_persistent: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's parameters, then (optionally) its buffers, without the non-persistent ones if asked."""
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        skip = get_non_persistent_buffers(module, recurse=recurse) if remove_non_persistent else set()
        for name, buf in module.named_buffers(recurse=recurse):
            if name not in skip:
                yield name, buf


def compute_module_sizes(model: nn.Module, dtype: Optional[Union[str, torch.dtype]] = None,
                         special_dtypes: Optional[dict] = None, buffers_only: bool = False) -> dict[str, int]:
    """{module name: bytes} for every prefix of every tensor name ("" is the whole model). With `dtype`, floating
    tensors count at the smaller of their own and `dtype`'s size; `special_dtypes` overrides per tensor name."""
    size_of = None if dtype is None else dtype_byte_size(_dtype(dtype))
    special = {k: dtype_byte_size(_dtype(v)) for k, v in (special_dtypes or {}).items()}
    sizes: dict[str, int] = defaultdict(int)
    tensors = model.named_buffers(recurse=True) if buffers_only else named_module_tensors(model, recurse=True)
    for name, tensor in tensors:
        own = dtype_byte_size(tensor.dtype)
        if name in special:
            size = tensor.numel() * special[name]
        elif size_of is None or not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
            size = tensor.numel() * own
        else:
            size = tensor.numel() * min(size_of, own)
        parts = name.split(".")
        for i in range(len(parts) + 1):
            sizes[".".join(parts[:i])] += size
    return sizes


def compute_module_total_buffer_size(model: nn.Module, dtype: Optional[Union[str, torch.dtype]] = None,
                                     special_dtypes: Optional[dict] = None) -> int:
    return compute_module_sizes(model, dtype, special_dtypes, buffers_only=True).get("", 0)


def get_max_layer_size(modules: list, module_sizes: dict[str, int],
                       no_split_module_classes: list[str]) -> tuple[int, list[str]]:
    """The largest "layer" among `modules` (named modules or tensors) and the names that reach it: a layer is a
    module without children or one whose class is in `no_split_module_classes`."""
    best, names = 0, []
    todo = list(modules)
    while todo:
        name, module = todo.pop(0)
        children = list(module.named_children()) if isinstance(module, nn.Module) else []
        if not children or module.__class__.__name__ in no_split_module_classes:
            size = module_sizes[name]
            if size > best:
                best, names = size, [name]
            elif size == best:
                names.append(name)
        else:
            todo = [(f"{name}.{n}", c) for n, c in children] + todo
    return best, names


def calculate_maximum_sizes(model: nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """HF's: (the model's bytes, (its largest layer's bytes, the names reaching it)); a transformers model's
    `_no_split_modules` count as layers."""
    sizes = compute_module_sizes(model)
    top = (list(model.named_parameters(recurse=False)) + list(model.named_children())
           + list(model.named_buffers(recurse=False)))
    return sizes[""], get_max_layer_size(top, sizes, list(getattr(model, "_no_split_modules", None) or []))


def find_tied_parameters(model: nn.Module, **kwargs: Any) -> list[list[str]]:
    """Groups of parameter names that are one tensor (sorted names in each group)."""
    first: dict[int, str] = {}
    groups: dict[str, set] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(param), name)
        if owner != name:
            groups.setdefault(owner, set()).add(name)
    return [sorted([owner, *names]) for owner, names in groups.items()]


def _accelerator_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def get_max_memory(max_memory: Optional[dict] = None) -> dict:
    """None: what each visible GPU has free, plus the available RAM as "cpu"; else the given budget with "5GB"
    strings turned into bytes, ordered GPUs, "mps", "cpu", "disk"; an unknown key is a ValueError naming it."""
    import psutil

    if max_memory is None:
        out: dict = {}
        for i in range(_accelerator_count()):
            try:
                out[i] = torch.cuda.mem_get_info(i)[0]
            except Exception:  # noqa: BLE001 - a device that does not answer is left out, as HF does
                continue
        out["cpu"] = psutil.virtual_memory().available
        return out
    for key in max_memory:
        if isinstance(max_memory[key], str):
            max_memory[key] = convert_file_size_to_int(max_memory[key])
    gpus = sorted(k for k in max_memory if isinstance(k, int))
    order = gpus + [k for k in ("mps", "cpu", "disk") if k in max_memory]
    for key in max_memory:
        if key not in order:
            raise ValueError(f"Device {key} is not recognized, available devices are integers(for GPU/XPU), 'mps', "
                             "'cpu' and 'disk'")
    return {k: max_memory[k] for k in order}


def get_module_leaves(module_sizes: dict[str, int]) -> list[str]:
    children: dict[str, int] = {}
    for name in module_sizes:
        if name and "." in name:
            parent = name.rsplit(".", 1)[0]
            children[parent] = children.get(parent, 0) + 1
    return [n for n in module_sizes if n and not children.get(n)]


def get_balanced_memory(model: nn.Module, max_memory: Optional[dict] = None,
                        no_split_module_classes: Optional[list[str]] = None,
                        dtype: Optional[Union[str, torch.dtype]] = None, special_dtypes: Optional[dict] = None,
                        low_zero: bool = False) -> dict:
    """A `max_memory` for infer_auto_device_map that spreads the model evenly over the GPUs (HF's rule: the
    model's size / GPUs, plus 1.25 x the larger of the biggest unsplittable block and the mean leaf block; the
    last GPU keeps its whole budget). Without GPUs: get_max_memory(max_memory) unchanged."""
    user_set = max_memory is not None
    max_memory = get_max_memory(max_memory)
    gpus = [d for d in max_memory if (isinstance(d, int) or d not in ("cpu", "disk", "mps")) and max_memory[d] > 0]
    if not gpus:
        return max_memory
    if len(gpus) == 1:
        low_zero = False
        if not user_set:
            key = next(k for k in max_memory if isinstance(k, int))
            max_memory[key] *= 0.9
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    per_gpu = sizes[""] // (len(gpus) - 1 if low_zero else len(gpus))
    classes = [no_split_module_classes] if isinstance(no_split_module_classes, str) else list(
        no_split_module_classes or [])
    buffer = 0
    if classes:
        seen: dict[str, int] = {}
        modules = dict(model.named_modules())
        for name, size in sizes.items():
            cls = type(modules[name]).__name__ if name in modules else None
            if name and cls in classes and cls not in seen:
                seen[cls] = size
        buffer = max(seen.values(), default=0)
    inner = {n: v for n, v in sizes.items() if n not in set(get_module_leaves(sizes))}
    leaves = get_module_leaves(inner)
    mean_leaves = int(sum(inner[n] for n in leaves) / max(len(leaves), 1))
    per_gpu += int(1.25 * max(buffer, mean_leaves))
    ids = sorted(d for d, m in max_memory.items() if isinstance(d, int) and m > 0)
    for idx in ids[:-1]:
        max_memory[idx] = min(max_memory[0] if low_zero and idx == 0 else per_gpu, max_memory[idx])
    if low_zero:
        max_memory[0] = min(max(0, sizes[""] - sum(max_memory[i] for i in range(1, len(gpus)))), max_memory[0])
    return max_memory


def clean_device_map(device_map: dict, module_name: str = "") -> dict:
    """Merges, in place, every group of entries under one module that all name the same device into one entry for
    that module (recursively from the root); returns the map."""
    prefix = f"{module_name}." if module_name else ""
    values = [v for k, v in device_map.items() if k.startswith(prefix)]
    if len(values) > 1 and len(set(values)) == 1:
        for k in [k for k in device_map if k.startswith(prefix)]:
            del device_map[k]
        device_map[module_name] = values[0]
    depth = len(module_name.split(".")) + 1 if module_name else 1
    children = {".".join(k.split(".")[:depth]) for k in device_map
                if k.startswith(prefix) and len(k) > len(module_name)}
    for child in children:
        clean_device_map(device_map, child)
    return device_map
