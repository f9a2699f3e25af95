# accelerate_c/bigmodel/checkpoint.py: a safetensors checkpoint into a model placed by a device map (HF 1.15's
# load_checkpoint_in_model / load_state_dict; never pickle). The checkpoint is one .safetensors file, an index
# (*.safetensors.index.json, its "weight_map") or a folder holding one of them. Every file's header is read and the
# keys and shapes are checked against the model before any weight is loaded, so a mismatch is one error naming the
# keys and leaves the model untouched. Weights mapped to "disk" are not copied: the offload index points into the
# checkpoint's own files (a copy is written to `offload_folder` only when a `dtype` changes them).
# Not for: the hooks that later read offloaded weights (dispatch.py, offload.py).
from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

import torch
from torch import nn

from ..checkpointing.stfile import DTYPE_OF, TensorFile
from .device_map import device_of
from .offload import offload_weight, save_offload_index
from .sizes import find_tied_parameters
from .tensors import set_module_tensor_to_device


def _files(checkpoint: Union[str, os.PathLike]) -> dict[str, list[str]]:
    """{file path: [keys]} of the checkpoint (an index lists them, else the file's header)."""
    path = str(checkpoint)
    if os.path.isdir(path):
        idx = [f for f in os.listdir(path) if f.endswith(".safetensors.index.json")]
        sts = [f for f in os.listdir(path) if f.endswith(".safetensors")]
        if len(idx) == 1:
            path = os.path.join(path, idx[0])
        elif not idx and len(sts) == 1:
            path = os.path.join(path, sts[0])
        else:
            raise ValueError(f"{checkpoint} is not a folder containing one .safetensors.index.json or one .safetensors "
                             f"file (found {sorted(idx + sts)}); pickled checkpoints (.bin) are not read")
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{path}: no \"weight_map\" object")
        out: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            out.setdefault(os.path.join(os.path.dirname(path), name), []).append(key)
        return out
    if not path.endswith(".safetensors"):
        raise ValueError(f"{checkpoint}: only safetensors checkpoints are read (never pickle); allowed: a "
                         ".safetensors file, a .safetensors.index.json or a folder holding one")
    return {path: None}


def load_state_dict(checkpoint_file: str, device_map: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, in memory of its own on CPU."""
    if not str(checkpoint_file).endswith(".safetensors"):
        raise ValueError(f"{checkpoint_file}: only safetensors files are read (never pickle)")
    with TensorFile(os.path.realpath(checkpoint_file)) as fh:
        return fh.tensors()


def _check(model: nn.Module, headers: dict[str, dict], strict: bool) -> None:
    expected = dict(model.state_dict(keep_vars=True))
    found = {k: e for entries in headers.values() for k, e in entries.items()}
    tied = {n for g in find_tied_parameters(model) for n in g if any(m in found for m in g)}
    missing = sorted(k for k in expected if k not in found and k not in tied)
    unexpected = sorted(k for k in found if k not in expected)
    shapes = [f"{k}: checkpoint {list(e['shape'])}, model {list(expected[k].shape)}" for k, e in sorted(found.items())
              if k in expected and list(e["shape"]) != list(expected[k].shape)]
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {missing}")
    if unexpected:
        problems.append(f"not in the model: {unexpected}")
    if shapes:
        problems.append(f"shapes differ: {shapes}")
    if problems:
        raise ValueError("the checkpoint does not match the model (nothing was loaded): " + "; ".join(problems))


def load_checkpoint_in_model(model: nn.Module, checkpoint: Union[str, os.PathLike], device_map: Optional[dict] = None,
                             offload_folder: Optional[Union[str, os.PathLike]] = None,
                             dtype: Optional[Union[str, torch.dtype]] = None, offload_state_dict: bool = False,
                             offload_buffers: bool = False, keep_in_fp32_modules: Optional[list[str]] = None,
                             offload_8bit_bnb: bool = False, strict: bool = False, full_state_dict: bool = True,
                             broadcast_from_rank0: bool = False) -> None:
    """Loads the checkpoint into `model`, each tensor on its device of `device_map` (none: CPU); "disk" tensors
    are recorded in `offload_folder`/index.json for dispatch_model. ValueError naming the keys when the checkpoint
    and the model differ, before anything is loaded."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    if device_map is not None and "disk" in device_map.values() and offload_folder is None:
        raise ValueError("At least one of the model submodule will be offloaded to disk, please pass along an "
                         "`offload_folder`.")
    files = {p: TensorFile(os.path.realpath(p)) for p in _files(checkpoint)}
    groups = find_tied_parameters(model)  # before loading: setting one name of a tied pair unties it
    try:
        _check(model, {p: fh.entries for p, fh in files.items()}, strict)
        keep = keep_in_fp32_modules or []
        index: dict = {}
        for path, fh in files.items():
            for key, entry in fh.entries.items():
                stored = DTYPE_OF[entry["dtype"]]
                target = dtype if dtype is not None and stored.is_floating_point else None
                if target is not None and any(m in key.split(".") or key.startswith(m + ".") for m in keep):
                    target = torch.float32
                device = device_of(key, device_map)
                if device == "disk":
                    if target is None or target == stored:
                        index[key] = {"safetensors_file": os.path.realpath(path), "weight_name": key,
                                      "dtype": str(stored).replace("torch.", "")}
                    else:
                        index = offload_weight(fh.tensor(key).to(target), key, str(offload_folder), index=index)
                    continue
                set_module_tensor_to_device(model, key, device, value=fh.tensor(key), dtype=target)
        _tied_on_disk(model, groups, {k for fh in files.values() for k in fh.entries}, device_map, index,
                      offload_folder)
        if index:
            os.makedirs(str(offload_folder), exist_ok=True)
            save_offload_index(index, str(offload_folder))
    finally:
        for fh in files.values():
            fh.close()
    loaded = {k for fh in files.values() for k in fh.entries}
    retie_parameters(model, [sorted(g, key=lambda n: n not in loaded) for g in groups])


def _tied_on_disk(model: nn.Module, groups: list[list[str]], stored: set, device_map: Optional[dict], index: dict,
                  offload_folder: Any) -> None:
    """A tied name the checkpoint leaves out (save_pretrained stores one of each group) that goes to "disk" gets the
    stored one's index entry (or, when that one was loaded into the model, a copy of it on disk)."""
    for group in groups:
        source = next((n for n in group if n in stored), None)
        for name in group:
            if source is None or name in stored or device_of(name, device_map) != "disk":
                continue
            if source in index:
                index[name] = dict(index[source])
            else:
                owner, _, attr = source.rpartition(".")
                value = getattr(model.get_submodule(owner) if owner else model, attr)
                offload_weight(value, name, str(offload_folder), index=index)


def retie_parameters(model: nn.Module, tied_params: list[list[str]]) -> None:
    """Makes every name of each group point to the group's first parameter again."""
    for group in tied_params:
        first = None
        for name in group:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            if first is None:
                first = getattr(owner, attr)
            else:
                setattr(owner, attr, first)
