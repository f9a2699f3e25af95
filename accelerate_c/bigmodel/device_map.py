# accelerate_c/bigmodel/device_map.py: which device each part of a model goes to. `infer_auto_device_map` fills
# the GPUs in order, then the CPU, then the disk, with HF 1.15's rules (and so its maps): a module that does not
# fit is split into its children unless its class is in `no_split_module_classes`; the first GPU (or the CPU when
# there is no GPU) keeps room for the largest layer, which an offloaded layer needs when it runs; tied parameters
# go with the module that uses them first. `check_device_map` checks that a map covers the model and names only
# its modules and devices that exist.
# Not for: sizes and budgets (sizes.py) or placing weights (dispatch.py).
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Optional, Union

import torch
from torch import nn

from .sizes import (clean_device_map, compute_module_sizes, compute_module_total_buffer_size, find_tied_parameters,
                    get_max_layer_size, get_max_memory)

logger = logging.getLogger(__name__)


def _with_ties(tied: list[str], size: int, sizes: dict[str, int], todo: list) -> tuple[int, list[str], list]:
    """The module's size plus the whole modules (still to place) that hold the parameters tied to it."""
    names, modules = [], []
    for param in tied:
        i = next(i for i, (n, _) in enumerate(todo) if param.startswith(n + "."))
        names.append(todo[i][0])
        modules.append(todo[i][1])
    total = size + sum(sizes[m] - sizes[p] for p, m in zip(tied, names))
    return total, names, modules


def _children(name: str, module: Any) -> list:
    if isinstance(module, torch.Tensor):
        return []
    kids = list(module.named_children())
    return [(f"{name}.{n}", v) for n, v in list(module.named_parameters(recurse=False)) + kids] if kids else []


def _layers(todo: list, sizes: dict, classes: list) -> tuple[int, list[str]]:
    return get_max_layer_size([(n, m) for n, m in todo if isinstance(m, nn.Module)], sizes, classes)


def infer_auto_device_map(model: nn.Module, max_memory: Optional[dict] = None,
                          no_split_module_classes: Optional[list[str]] = None,
                          dtype: Optional[Union[str, torch.dtype]] = None, special_dtypes: Optional[dict] = None,
                          verbose: bool = False, clean_result: bool = True, offload_buffers: bool = False,
                          fallback_allocation: bool = False) -> "OrderedDict[str, Union[int, str]]":
    """{module name: device} filling GPUs, then "cpu", then "disk" (HF 1.15's placement). ValueError when the
    device that runs offloaded layers has less memory than the largest unsplittable layer (that layer could never
    be brought there), naming the layer, its size and the budget. `fallback_allocation` is accepted and, as HF's
    default, not used."""
    max_memory = get_max_memory(None if max_memory is None else dict(max_memory))
    classes = [no_split_module_classes] if isinstance(no_split_module_classes, str) else list(
        no_split_module_classes or [])
    devices = list(max_memory) + ([] if "disk" in max_memory else ["disk"])
    gpus = [d for d in devices if d not in ("cpu", "disk")]
    main = ["mps"] if "mps" in gpus else ([gpus[0], "cpu"] if gpus else ["cpu"])
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    tied_groups = find_tied_parameters(model)
    todo = (list(model.named_parameters(recurse=False)) + list(model.named_children())
            + list(model.named_buffers(recurse=False)))
    device_map: OrderedDict = OrderedDict()
    used = {d: 0 for d in devices}
    current = 0
    biggest, biggest_names = get_max_layer_size(todo, sizes, classes)
    runner = main[0]
    if runner in max_memory and biggest_names and max_memory[runner] < biggest:
        raise ValueError(f"max_memory[{runner!r}] = {max_memory[runner]} bytes is smaller than the largest layer "
                         f"that cannot be split, {biggest_names[0]!r} ({biggest} bytes): an offloaded layer must fit "
                         f"on {runner!r} to run; allowed: at least {biggest} bytes (or more no_split classes split)")
    while todo:
        name, module = todo.pop(0)
        biggest_names = [n for n in biggest_names if n != name and not n.startswith(name + ".")]
        if not biggest_names:
            biggest, biggest_names = _layers(todo, sizes, classes)
        size = sizes[name]
        groups = [g for g in tied_groups
                  if any(name + "." in k + "." for k in g) and not all(name + "." in k + "." for k in g)]
        tied = [p for g in groups for p in g if name + "." not in p + "."]
        device = devices[current]
        limit = max_memory[device] if device != "disk" else None
        reserved = 0
        if device in main:
            limit, reserved = limit - biggest, biggest
        total, tied_names, tied_modules = _with_ties(tied, size, sizes, todo)
        if verbose:
            print(f"Treating module {name} (size={size}, with ties {total}) for {device}.")
        if limit is None or used[device] + total <= limit:
            used[device] += total
            device_map[name] = device
            for tname in tied_names:
                idx = next((i for i, (n, _) in enumerate(todo) if n == tname), None)
                if idx is not None:
                    todo.pop(idx)
                device_map[tname] = device
            continue
        if tied and used[device] + size <= limit:
            split = False
            for tname, tmod in zip(tied_names, tied_modules):
                kids = _children(tname, tmod)
                if not kids or tmod.__class__.__name__ in classes:
                    continue
                idx = next(i for i, (n, _) in enumerate(todo) if n == tname)
                todo = [(name, module)] + todo[:idx] + kids + todo[idx + 1:]
                biggest, biggest_names = _layers(todo, sizes, classes)
                split = True
                break
            if split:
                continue
        if used[device] + size >= limit:
            kids = _children(name, module)
            if kids and module.__class__.__name__ not in classes:
                todo = kids + todo
                biggest, biggest_names = _layers(todo, sizes, classes)
                continue
        used[device] += reserved
        current += 1
        todo = [(name, module)] + todo
    if clean_result:
        device_map = clean_device_map(device_map)
    _warn_buffers(model, device_map, max_memory, used, gpus, offload_buffers, dtype, special_dtypes)
    return device_map


def _warn_buffers(model: nn.Module, device_map: dict, max_memory: dict, used: dict, gpus: list,
                  offload_buffers: bool, dtype: Any, special_dtypes: Any) -> None:
    if offload_buffers or not gpus:
        return
    modules = dict(model.named_modules())
    size = sum(compute_module_total_buffer_size(modules[n], dtype, special_dtypes)
               for n, d in device_map.items() if d in ("cpu", "disk") and n in modules)
    if size and not any(max_memory[g] >= size + used.get(g, 0) for g in gpus):
        logger.warning(f"Current model requires {size} bytes of buffer for offloaded layers, which seems does not fit "
                       "any GPU's remaining memory. If you are experiencing a OOM later, please consider using "
                       "offload_buffers=True.")


def _device_ok(device: Any) -> bool:
    if device in ("cpu", "disk", "meta", "mps"):
        return True
    try:
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    except (RuntimeError, TypeError):
        return False
    if dev.type == "cpu":
        return True
    if dev.type == "cuda":
        return torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()
    return False


def check_device_map(model: nn.Module, device_map: dict) -> None:
    """Every tensor of the model has a device in `device_map`; every key names a module, parameter or buffer of
    the model and every value a device that is there ("cpu", "disk", a visible GPU). ValueError naming what is
    wrong (HF only warns about unknown keys; here a typo would silently leave the intended module unplaced)."""
    names = set(dict(model.named_modules())) | set(model.state_dict())
    unknown = [k for k in device_map if k != "" and k not in names]
    if unknown:
        raise ValueError(f"device_map names modules that are not in the model: {unknown}; allowed: the names of "
                         f"model.named_modules() / its parameters and buffers")
    absent = sorted({str(v) for v in device_map.values() if not _device_ok(v)})
    if absent:
        raise ValueError(f"device_map names devices that are not there: {absent}; allowed: 'cpu', 'disk'"
                         + (f", GPUs 0..{torch.cuda.device_count() - 1}" if torch.cuda.is_available() else ""))
    if "" in device_map:
        return
    missing = [t for t in model.state_dict()
               if not any(t == k or t.startswith(k + ".") for k in device_map)]
    if missing:
        raise ValueError("The device_map provided does not give any device for the following parameters: "
                         + ", ".join(missing))


def device_of(name: str, device_map: Optional[dict]) -> Any:
    """The device `device_map` gives the module or tensor `name` (its own entry or its nearest parent's; "cpu" without
    a map); a ValueError naming it when the map gives none."""
    if device_map is None:
        return "cpu"
    key = name
    while key not in device_map:
        if not key:
            raise ValueError(f"device_map gives no device for {name!r}")
        key = key.rpartition(".")[0]
    return device_map[key]


def check_tied_parameters_on_same_device(tied_params: list, device_map: dict) -> None:
    """HF's: a warning naming each group of tied parameters that `device_map` puts on more than one device."""
    for group in tied_params:
        devices = {name: device_of(name, device_map) for name in group}
        if len(set(map(str, devices.values()))) > 1:
            logger.warning(f"Tied parameters are on different devices: {devices}. Please modify your custom device "
                           "map or set `device_map='auto'`. ")
