# accelerate_c/checkpointing/model.py: exporting model weights (`Accelerator.save_model`, `merge-weights`) and the
# safetensors clean-up `utils.other.save` (HF's `save`) uses.
#
# HF-compatible names: `model.safetensors`, or shards `model-00001-of-0000N.safetensors` plus
# `model.safetensors.index.json` ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}).
# Shards are filled greedily in state-dict order (a tensor larger than the limit gets a shard of its own);
# tied tensors (same memory, shape and strides) are written once, under their first name, and refilled
# from the module's own aliasing on load (tied.py); distinct views into one flat buffer are all kept.
# Streaming: the tensors come from the strategy's model_slices. When every rank holds every tensor whole, shard j
# is written by rank j % world straight from memory; otherwise every rank first writes the pieces it owns
# (pieces.py) into a temporary folder and each shard's writer assembles one tensor at a time from them, so no
# rank ever holds the whole model. Sizes: int bytes or "10GB"/"500MB" (decimal, like huggingface_hub) or "1GiB"
# (binary). A killed export leaves `<file>.accelerate_c-tmp` files or the pieces folder: the next export to the
# folder removes them (interrupted.py). Not for: optimizer/RNG state (session.py, format.py).
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from collections import OrderedDict
from typing import Any, Callable, Union

import torch

from ..base.killpoints import kill_point
from . import atomic
from .format import PathLike, _dtype_from_name, fsync_file
from .interrupted import PIECES_DIR, remove_model_leftovers
from .layout import strategy_of
from .pieces import PieceReader, numel_of, rank_file, read_rank_meta, write_rank_file, write_safetensors
from .tied import dedupe_tied
from .universal import is_whole, model_index, model_rank_part, user_model

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


def split_into_shards(sizes: list[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Greedy, in order: start a new shard when the next tensor (name, bytes) would overflow the current one."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes:
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


def _is_writer(accelerator: Any) -> bool:
    pc = getattr(accelerator, "project_configuration", None)
    if pc is not None and getattr(pc, "save_on_each_node", False):
        return bool(getattr(accelerator, "is_local_main_process", accelerator.is_main_process))
    return bool(accelerator.is_main_process)


def _replace_file(write, final: str) -> None:
    """Writes through `write(tmp_path)`, fsyncs, then renames over `final` (readers never see half a file). The
    temp file is held (atomic.hold) while it is written, so `cleanup` leaves it alone."""
    tmp = f"{final}{atomic.TMP_SUFFIX}"
    try:
        open(tmp, "wb").close()
        atomic.hold(tmp)
        write(tmp)
        fsync_file(tmp)
        kill_point("save_model.tmp_written")
        os.replace(tmp, final)
    finally:
        atomic.release(tmp)
        if os.path.exists(tmp):
            os.remove(tmp)


def write_hf_model(save_directory: str, specs: list[tuple[str, tuple[int, ...], torch.dtype]],
                   get: Callable[[str], torch.Tensor], max_shard_size: int, safe_serialization: bool = True,
                   writes: Callable[[int], bool] = lambda j: True,
                   finish: bool = True) -> tuple[list[str], list[list[str]], dict[str, int]]:
    """Writes the logical tensors `specs` (name, shape, dtype; state-dict order) as HF-named shards, each tensor
    produced by `get(name)` when its shard is written; shard j only where `writes(j)`. With `finish`, also the
    index (or its removal when one file suffices) and the removal of stale shards. Returns (shard file names,
    tensor names per shard, bytes per tensor): what finish_hf_model needs."""
    sizes = [(n, numel_of(shape) * torch.empty((), dtype=dt).element_size()) for n, shape, dt in specs]
    shards = split_into_shards(sizes, max_shard_size)
    n = len(shards)
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    names = [f"{stem}.{ext}"] if n == 1 else [f"{stem}-{i + 1:05d}-of-{n:05d}.{ext}" for i in range(n)]
    by_name = {s[0]: s for s in specs}
    for j, (fname, keys) in enumerate(zip(names, shards)):
        if not writes(j):
            continue
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, fname)
        if safe_serialization:
            part = [by_name[k] for k in keys]
            _replace_file(lambda p, part=part: write_safetensors(
                p, part, lambda i, part=part: get(part[i][0]).reshape(part[i][1]), metadata={"format": "pt"}), path)
        else:
            shard = materialize(OrderedDict((k, get(k).reshape(by_name[k][1])) for k in keys))
            _replace_file(lambda p, s=shard: torch.save(s, p), path)
    if finish:
        finish_hf_model(save_directory, names, shards, dict(sizes), safe_serialization)
    return names, shards, dict(sizes)


def finish_hf_model(save_directory: str, names: list[str], shards: list[list[str]], sizes: dict[str, int],
                    safe_serialization: bool) -> None:
    """The index of a sharded export (none for one file) and the removal of stale shards of an earlier layout."""
    stem = "model" if safe_serialization else "pytorch_model"
    os.makedirs(save_directory, exist_ok=True)
    remove_model_leftovers(save_directory)  # of killed saves (temp files, pieces): what no running save holds
    for fname in os.listdir(save_directory):
        if _SHARD_RE.match(fname) and fname.startswith(stem + "-") and fname not in names:
            os.remove(os.path.join(save_directory, fname))
    index_path = os.path.join(save_directory, SAFE_WEIGHTS_INDEX_NAME if safe_serialization else WEIGHTS_INDEX_NAME)
    if len(names) > 1:
        weight_map = {k: fname for fname, keys in zip(names, shards) for k in keys}
        total = sum(sizes.values())
        text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)

        def write_index(p: str) -> None:
            with open(p, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
        _replace_file(write_index, index_path)
        logger.info("Model split into %d shards; index at %s", len(names), index_path)
    elif os.path.exists(index_path):
        os.remove(index_path)   # an index left by an earlier sharded save would point at deleted shards


def save_model(accelerator: Any, model: torch.nn.Module, save_directory: PathLike,
               max_shard_size: Union[int, str] = "10GB", safe_serialization: bool = True) -> None:
    """`Accelerator.save_model`, called on every rank: HF-named shards plus an index, streamed from the strategy's
    model_slices (see the header: no gather of the whole model to one rank)."""
    save_directory = os.fspath(save_directory)
    if os.path.isfile(save_directory):
        logger.error("Provided path (%s) should be a directory, not a file", save_directory)
        return
    limit = parse_size(max_shard_size)
    if any(p.device.type == "meta" for p in model.parameters()):
        raise RuntimeError("You can't save the model since some parameters are on the meta device.")
    strategy = strategy_of(accelerator)
    # DeepSpeed: 16-bit weights, or HF's ZeRO-3 error (a strategy-like object without the hook: as held)
    dtype = strategy.saved_weights_dtype() if hasattr(strategy, "saved_weights_dtype") else None
    slices = strategy.model_slices(user_model(model))
    if dtype is not None:
        slices = [dataclasses.replace(s, dtype=dtype, data=s.data.to(dtype)) if s.dtype.is_floating_point else s
                  for s in slices]
    rank, world = int(accelerator.process_index), int(accelerator.num_processes)
    main = _is_writer(accelerator)
    if is_whole(slices):
        pieces, _, meta = model_rank_part([dataclasses.replace(s, owner=True) for s in slices])
        specs = [(name, tuple(shape), data.dtype) for name, _, data, shape in pieces]
        local = {name: data for name, _, data, _ in pieces}
        layout = write_hf_model(save_directory, specs, local.__getitem__, limit, safe_serialization,
                                writes=lambda j: j % world == rank, finish=False)
        accelerator.wait_for_everyone()
        if main:
            finish_hf_model(save_directory, *layout, safe_serialization)
        accelerator.wait_for_everyone()
        return
    tmp = os.path.join(save_directory, PIECES_DIR)
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        atomic.hold(tmp)
    accelerator.wait_for_everyone()
    pieces, extra, meta = model_rank_part(slices)
    write_rank_file(os.path.join(tmp, rank_file("model", rank, world)), pieces, extra, meta)
    accelerator.wait_for_everyone()
    files = [rank_file("model", r, world) for r in range(world)]
    index = model_index(tmp, files, [read_rank_meta(os.path.join(tmp, f)) for f in files])
    specs = [(n, tuple(e["shape"]), _dtype_from_name(e["dtype"])) for n, e in index["tensors"].items()]
    with PieceReader(tmp, index["tensors"]) as reader:
        layout = write_hf_model(save_directory, specs, reader.read_whole, limit, safe_serialization,
                                writes=lambda j: j % world == rank, finish=False)
    accelerator.wait_for_everyone()
    if main:
        finish_hf_model(save_directory, *layout, safe_serialization)
        shutil.rmtree(tmp, ignore_errors=True)
        atomic.release(tmp)
    accelerator.wait_for_everyone()
