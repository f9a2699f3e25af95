# accelerate_c/bigmodel/offload.py: weights kept off the model: on disk (safetensors files, read with pread into
# memory of our own through checkpointing/stfile.TensorFile, so nothing stays mapped and the process's resident
# memory is what it holds) or in a CPU state dict. HF 1.15's names: offload_state_dict / offload_weight /
# save_offload_index write an offload folder (here one safetensors file per weight plus index.json, never pickle and
# never numpy memmaps), OffloadedWeightsLoader reads an index whose entries name a "safetensors_file" (as transformers
# writes them) or a weight of that folder, PrefixedDataset views one module's part of it.
# Not for: when weights are read (hooks.py: AlignDevicesHook and the prefetcher).
from __future__ import annotations

import json
import mmap
import os
import threading
from collections.abc import Mapping
from typing import Any, Iterator, Optional, Union

import torch
from safetensors.torch import save_file

from ..checkpointing.stfile import DTYPE_OF, TensorFile, entry_numel
from .regions import RegionPool

INDEX = "index.json"
OWN_MAPPING = 1 << 20  # bytes from which a weight read from disk gets a mapping of its own


def read_weight(fh: TensorFile, key: str, pool: RegionPool) -> torch.Tensor:
    """Tensor `key` of `fh` in fresh memory. A large one lives in a mapping of `pool`'s (regions.py) that goes back
    to the pool, or to the system, when the tensor dies, so reading a layer, using it and dropping it (every
    offloaded forward) gives its pages back: from malloc's heap, freed weights of varying sizes would stay resident
    (the process grows by fragmentation, as HF's offloaded forward does)."""
    entry = fh.entry(key)
    dtype, numel = DTYPE_OF[entry["dtype"]], entry_numel(entry)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < OWN_MAPPING or not hasattr(mmap, "MAP_ANONYMOUS"):
        return fh.tensor(key)
    out = pool.empty(dtype, numel)
    fh.read_into(key, 0, out)
    return out.view(entry["shape"])


def _file_of(folder: str, weight_name: str) -> str:
    return os.path.join(folder, f"{weight_name}.safetensors")


def offload_weight(weight: torch.Tensor, weight_name: str, offload_folder: str,
                   index: Optional[dict] = None) -> dict:
    """Writes `weight` to `offload_folder`/<name>.safetensors and records it in `index` (returned)."""
    os.makedirs(offload_folder, exist_ok=True)
    tensor = weight.detach().to("cpu").contiguous()
    save_file({weight_name: tensor}, _file_of(offload_folder, weight_name))
    index = {} if index is None else index
    index[weight_name] = {"dtype": str(tensor.dtype).replace("torch.", ""), "shape": list(tensor.shape),
                          "safetensors_file": _file_of(offload_folder, weight_name), "weight_name": weight_name}
    return index


def save_offload_index(index: dict, offload_folder: str) -> None:
    """Merges `index` into `offload_folder`/index.json."""
    if not index:
        return
    path = os.path.join(offload_folder, INDEX)
    current = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            current = json.load(fh)
    current.update(index)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(current, fh, indent=2)


def offload_state_dict(save_dir: Union[str, os.PathLike], state_dict: dict) -> None:
    """Writes every tensor of `state_dict` to `save_dir` with its index."""
    os.makedirs(save_dir, exist_ok=True)
    index: dict = {}
    for name, tensor in state_dict.items():
        index = offload_weight(tensor, name, str(save_dir), index=index)
    save_offload_index(index, str(save_dir))


def load_offloaded_weight(weight_file: str, weight_info: dict) -> torch.Tensor:
    with TensorFile(os.path.realpath(weight_file)) as fh:
        return fh.tensor(weight_info.get("weight_name", next(iter(fh.keys()))))


class _Files:
    """One open TensorFile per safetensors path (headers parsed once), shared by the loader's threads."""

    def __init__(self) -> None:
        self._open: dict[str, TensorFile] = {}
        self._lock = threading.Lock()

    def get(self, path: str) -> TensorFile:
        with self._lock:
            fh = self._open.get(path)
            if fh is None:
                fh = self._open[path] = TensorFile(os.path.realpath(path))
            return fh

    def close(self) -> None:
        with self._lock:
            for fh in self._open.values():
                fh.close()
            self._open.clear()


class OffloadedWeightsLoader(Mapping):
    """A read-only mapping name -> CPU tensor over a `state_dict` (kept in memory) and an offload `index` (read from
    disk at each access, into fresh memory). Index entries name a "safetensors_file" and its "weight_name", or a
    weight of `save_folder` (its <name>.safetensors)."""

    def __init__(self, state_dict: Optional[dict] = None, save_folder: Optional[Union[str, os.PathLike]] = None,
                 index: Optional[Mapping] = None, device: Any = None) -> None:
        if state_dict is None and save_folder is None and index is None:
            raise ValueError("Need either a `state_dict`, a `save_folder` or an `index` containing offloaded weights.")
        self.state_dict = {} if state_dict is None else state_dict
        self.save_folder = None if save_folder is None else str(save_folder)
        if index is None and self.save_folder is not None and os.path.isfile(os.path.join(self.save_folder, INDEX)):
            with open(os.path.join(self.save_folder, INDEX), encoding="utf-8") as fh:
                index = json.load(fh)
        self.index = {} if index is None else dict(index)
        self.all_keys = list(self.state_dict) + [k for k in self.index if k not in self.state_dict]
        self.device = device
        self._files = _Files()
        self.pool = RegionPool()  # keeps nothing unless a prefetcher sets its cap (prefetch.attach_prefetcher)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        info = self.index[key]
        path = info.get("safetensors_file") or _file_of(self.save_folder or "", key)
        tensor = read_weight(self._files.get(path), info.get("weight_name", key), self.pool)
        dtype = info.get("dtype")
        if dtype and str(tensor.dtype).replace("torch.", "") != dtype and hasattr(torch, dtype):
            tensor = tensor.to(getattr(torch, dtype))
        return tensor if self.device is None else tensor.to(self.device)

    def is_on_disk(self, key: str) -> bool:
        return key not in self.state_dict and key in self.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)

    def close(self) -> None:
        self._files.close()


class PrefixedDataset(Mapping):
    """`dataset` seen under `prefix`: key k reads dataset[prefix + k]."""

    def __init__(self, dataset: Mapping, prefix: str) -> None:
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> Any:
        return self.dataset[f"{self.prefix}{key}"]

    def __iter__(self) -> Iterator[str]:
        return iter([k for k in self.dataset if k.startswith(self.prefix)])

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def pool(self) -> Optional[RegionPool]:
        return getattr(self.dataset, "pool", None)

    def is_on_disk(self, key: str) -> bool:
        probe = getattr(self.dataset, "is_on_disk", None)
        return bool(probe and probe(f"{self.prefix}{key}"))


def extract_submodules_state_dict(state_dict: dict, submodule_names: list[str]) -> dict:
    """The entries of `state_dict` that belong to one of `submodule_names`."""
    return {k: v for k, v in state_dict.items()
            if any(k == m or k.startswith(m + ".") for m in submodule_names)}
