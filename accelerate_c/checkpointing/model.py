# accelerate_c/checkpointing/model.py: exporting model weights (`Accelerator.save_model`), the model files inside
# save_state checkpoints, and the safetensors clean-up `utils.other.save` (HF's `save`) uses.
#
# HF-compatible names: `model.safetensors`, or shards `model-00001-of-0000N.safetensors` plus
# `model.safetensors.index.json` ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}).
# Shards are filled greedily in state-dict order (a tensor larger than the limit gets a shard of its own);
# tied tensors (same memory, shape and strides) are written once, under their first name, and refilled
# from the module's own aliasing on load (`fill_tied`); distinct views into one flat buffer are all kept. Sizes: int bytes or "10GB"/"500MB" (decimal, like
# huggingface_hub) or "1GiB" (binary). Not for: optimizer/RNG state (state.py, format.py).
from __future__ import annotations

import json
import logging
import os
import re
from collections import OrderedDict
from typing import Any, Optional, Union

import torch

from .format import PathLike, fsync_file, read_tensors, write_tensors

logger = logging.getLogger(__name__)

SAFE_WEIGHTS_NAME = "model.safetensors"
WEIGHTS_NAME = "pytorch_model.bin"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
_SHARD_RE = re.compile(r"^(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)$")
_UNITS = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10,
          "TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}


def parse_size(size: Union[int, str]) -> int:
    """Bytes from an int or a string like "10GB", "500MB", "1.5GiB"."""
    if isinstance(size, bool):
        raise ValueError(f"invalid size {size!r}")
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        return size
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*", str(size))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot parse size {size!r}; use an int (bytes) or e.g. '10GB', '500MB', '1GiB'")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return value


def _alias_key(t: torch.Tensor) -> Optional[tuple]:
    """Identity of the exact memory a tensor shows: equal keys = the same (tied) tensor. Distinct views into
    one flat buffer (accelerate_c's memory model) have distinct keys and are all kept."""
    if t.numel() == 0 or t.device.type == "meta":
        return None
    return (t.device.type, t.device.index, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def dedupe_tied(state_dict: dict) -> "OrderedDict[str, torch.Tensor]":
    """Drops later names of tied tensors (same memory, shape and strides); no copies."""
    seen: dict[tuple, str] = {}
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    dropped = []
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"model state dict entry {name!r} is a {type(t).__name__}, not a tensor")
        key = _alias_key(t)
        if key is not None and key in seen:
            dropped.append(f"{name} (= {seen[key]})")
            continue
        if key is not None:
            seen[key] = name
        out[name] = t.detach()
    if dropped:
        logger.info("Tied tensors stored once: %s", ", ".join(dropped))
    return out


def materialize(tensors: dict) -> "OrderedDict[str, torch.Tensor]":
    """CPU, contiguous tensors owning their memory, as safetensors needs. Copies only what must be copied:
    device tensors (the .cpu() copy), views into a shared or larger (flat) buffer, non-contiguous tensors."""
    count: dict[int, int] = {}
    for t in tensors.values():
        if t.device.type == "cpu" and t.numel():
            ptr = t.untyped_storage().data_ptr()
            count[ptr] = count.get(ptr, 0) + 1
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, t in tensors.items():
        if t.device.type != "cpu":
            t = t.to("cpu", memory_format=torch.contiguous_format)
        elif t.numel():
            st = t.untyped_storage()
            if (count[st.data_ptr()] > 1 or not t.is_contiguous() or t.storage_offset() != 0
                    or st.nbytes() != t.numel() * t.element_size()):
                t = t.clone(memory_format=torch.contiguous_format)
        else:
            t = t.contiguous()
        out[name] = t
    return out


def clean_state_dict_for_safetensors(state_dict: dict) -> "OrderedDict[str, torch.Tensor]":
    """dedupe_tied + materialize: a state dict safetensors can write."""
    return materialize(dedupe_tied(state_dict))


def split_into_shards(state_dict: dict, max_shard_size: int) -> list[list[str]]:
    """Greedy, in order: start a new shard when the next tensor would overflow the current one."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, t in state_dict.items():
        size = t.numel() * t.element_size()
        if size > max_shard_size:
            shards.append([name])
            continue
        if current and current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current or not shards:
        shards.append(current)
    return shards


def write_model_file(path: PathLike, state_dict: dict) -> int:
    """One safetensors file for a (cleaned or raw) model state dict; returns its size."""
    return write_tensors(path, clean_state_dict_for_safetensors(state_dict), metadata={"format": "pt"})


def fill_tied(module: torch.nn.Module, state_dict: dict) -> dict:
    """Adds names missing from state_dict that alias (share storage with) a present name in `module`."""
    groups: dict[tuple, list[str]] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        key = _alias_key(t) if isinstance(t, torch.Tensor) else None
        if key is not None:
            groups.setdefault(key, []).append(name)
    for names in groups.values():
        present = [n for n in names if n in state_dict]
        if present:
            for n in names:
                if n not in state_dict:
                    state_dict[n] = state_dict[present[0]]
    return state_dict


def load_model_file(path: PathLike, device: str = "cpu", expected_size: Optional[int] = None) -> dict:
    return read_tensors(path, device=device, expected_size=expected_size)


def _is_writer(accelerator: Any) -> bool:
    pc = getattr(accelerator, "project_configuration", None)
    if pc is not None and getattr(pc, "save_on_each_node", False):
        return bool(getattr(accelerator, "is_local_main_process", accelerator.is_main_process))
    return bool(accelerator.is_main_process)


def _replace_file(write, final: str) -> None:
    """Writes through `write(tmp_path)`, fsyncs, then renames over `final` (readers never see half a file)."""
    tmp = f"{final}.accelerate_c-tmp"
    try:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_model(accelerator: Any, model: torch.nn.Module, save_directory: PathLike,
               max_shard_size: Union[int, str] = "10GB", safe_serialization: bool = True) -> None:
    """`Accelerator.save_model`: full state dict (via accelerator.get_state_dict, called on every rank since
    sharded strategies gather there), written by the main process as HF-named shards plus an index."""
    save_directory = os.fspath(save_directory)
    if os.path.isfile(save_directory):
        logger.error("Provided path (%s) should be a directory, not a file", save_directory)
        return
    limit = parse_size(max_shard_size)
    if any(p.device.type == "meta" for p in model.parameters()):
        raise RuntimeError("You can't save the model since some parameters are on the meta device.")
    state_dict = accelerator.get_state_dict(model)
    if state_dict is None or not _is_writer(accelerator):
        return
    os.makedirs(save_directory, exist_ok=True)
    clean = dedupe_tied(state_dict)
    shards = split_into_shards(clean, limit)
    n = len(shards)
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    names = [f"{stem}.{ext}"] if n == 1 else [f"{stem}-{i + 1:05d}-of-{n:05d}.{ext}" for i in range(n)]
    for fname in os.listdir(save_directory):   # stale shards of an earlier save with another layout
        if _SHARD_RE.match(fname) and fname.startswith(stem + "-") and fname not in names:
            os.remove(os.path.join(save_directory, fname))
    weight_map: dict[str, str] = {}
    total = 0
    for fname, keys in zip(names, shards):
        shard = materialize(OrderedDict((k, clean[k]) for k in keys))   # one shard's copies at a time
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update({k: fname for k in keys})
        if safe_serialization:
            _replace_file(lambda p, s=shard: write_tensors(p, s, metadata={"format": "pt"}),
                          os.path.join(save_directory, fname))
        else:
            _replace_file(lambda p, s=shard: torch.save(s, p), os.path.join(save_directory, fname))
    index_path = os.path.join(save_directory, SAFE_WEIGHTS_INDEX_NAME if safe_serialization else WEIGHTS_INDEX_NAME)
    if n > 1:
        text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)

        def write_index(p: str) -> None:
            with open(p, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
        _replace_file(write_index, index_path)
        logger.info("Model split into %d shards; index at %s", n, index_path)
    elif os.path.exists(index_path):
        os.remove(index_path)   # an index left by an earlier sharded save would point at deleted shards

