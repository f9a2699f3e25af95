# accelerate_c/checkpointing/universal.py: model and optimizer state as logical tensors (the strategy contract of
# slices.py) <-> one rank's pieces file and the index built from all ranks' files (pieces.py).
#
# Model: the owned slices of `strategy.model_slices`; a slice whose memory is that of an earlier slice (tied
# weights) is stored once and recorded as an alias. Loading: when every slice of this rank is a whole tensor,
# the full state dict is read tensor by tensor and given to the module's load_state_dict (strict, hooks and
# casts as torch does); otherwise each slice's range is read and copied into its memory.
# Optimizer: for each owned ParamSlot with state, a tensor of the slot's size is the range of the logical tensor
# "<name>/<key>"; an 8-bit block scale "<key>_absmax" (one fp32 per 256 elements, optim/lowbit.py) is the block
# range of "<name>/<key>_absmax", so a slot must start on a block boundary (and end on one unless it ends the
# tensor); anything else is per-parameter scalar state (encoded like format.py, tensors in the same file).
# Groups are stored with parameter names; the main process's hyperparameters are the groups'. Loading builds the
# state dict of this rank's slots and calls optimizer.load_state_dict (our AdamW converts between layouts).
# Not for: files and coordination (session.py), the byte layout (pieces.py), which rank holds and writes what
# (layout.py).
from __future__ import annotations

from typing import Any, Optional

import torch

from .format import CheckpointError, _dtype_from_name, decode, encode
from .pieces import LazyTensors, PieceReader, build_index, check_entry, dtype_name, numel_of
from .slices import ParamSlot, TensorSlice
from .tied import fill_tied

QBLOCK = 256          # the 8-bit state's block (optim/lowbit.py QBLOCK; not imported: it loads the C extension)
SCALAR_PREFIX = "~state/"
MODEL_INDEX = "accelerate_c.model_index"
OPTIMIZER_INDEX = "accelerate_c.optimizer_index"
INDEX_VERSION = 1


def user_model(model: Any) -> Any:
    return getattr(model, "_orig_mod", model)  # a compiled model: the module itself (its keys carry no prefix)


def is_whole(slices: list[TensorSlice]) -> bool:
    return all(s.start == 0 and s.numel == numel_of(s.shape) for s in slices)


def _alias_key(s: TensorSlice) -> Optional[tuple]:
    d = s.data
    if d.numel() == 0 or d.device.type == "meta":
        return None
    return (d.device.type, d.device.index, d.data_ptr(), d.numel(), d.dtype, s.start, tuple(s.shape))


# --------------------------------------------------------------------------------------------------- model
def model_rank_part(slices: list[TensorSlice]) -> tuple[list, dict, dict]:
    """(pieces to write, extra tensors, header meta) of this rank's model slices."""
    seen: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    logical: dict[str, list] = {}
    pieces = []
    for s in slices:
        if s.data.dim() != 1:
            raise ValueError(f"model slice {s.name!r}: data must be 1-D, got shape {list(s.data.shape)}")
        logical[s.name] = [list(s.shape), dtype_name(s.dtype)]
        key = _alias_key(s)
        if key is not None and key in seen and seen[key] != s.name:
            aliases[s.name] = seen[key]
            continue
        if key is not None:
            seen[key] = s.name
        if s.owner:
            pieces.append((s.name, s.start, s.data.detach(), tuple(s.shape)))
    return pieces, {}, {"kind": "model", "logical": logical, "aliases": aliases}


def model_index(directory: str, files: list[str], metas: list[dict]) -> dict:
    """The model index (JSON-able) from every rank's header meta."""
    logical: dict[str, tuple] = {}
    aliases: dict[str, str] = {}
    for m in metas:
        aliases.update(m["aliases"])
    for m in metas:
        for name, (shape, dtype) in m["logical"].items():
            if name not in aliases:
                logical.setdefault(name, (shape, dtype))
    tensors = build_index(directory, files, metas, logical)
    return {"format": MODEL_INDEX, "version": INDEX_VERSION, "tensors": tensors, "aliases": aliases}


def load_model(reader: PieceReader, index: dict, target: torch.nn.Module, slices: list[TensorSlice],
               **load_kwargs: Any) -> None:
    aliases = index.get("aliases", {})
    if is_whole(slices):
        # read straight into the module's own tensors where they match (then load_state_dict's copy is a no-op:
        # copy_ of a tensor onto itself), into new ones otherwise (load_state_dict casts or reports the mismatch)
        own = target.state_dict(keep_vars=True)
        sd = {}
        for name, e in index["tensors"].items():
            t = own.get(name)
            if isinstance(t, torch.Tensor) and _fits(t, e["dtype"], numel_of(e["shape"])) and \
                    list(t.shape) == list(e["shape"]):
                reader.read_into(name, 0, t.detach().view(-1))
                sd[name] = t
            else:
                sd[name] = reader.read_whole(name)
        for name, src in aliases.items():
            if src in sd:
                sd.setdefault(name, sd[src])
        target.load_state_dict(fill_tied(target, sd), **load_kwargs)
        return
    strict = load_kwargs.get("strict", True)
    here = set()
    filled: set[tuple] = set()
    with torch.no_grad():
        for s in slices:
            here.add(s.name)
            key = _alias_key(s)
            if key is not None and key in filled:
                continue                  # tied: this memory was filled under its first name
            if key is not None:
                filled.add(key)
            src = aliases.get(s.name, s.name)
            if src not in index["tensors"]:
                if strict:
                    raise CheckpointError(f"model tensor {s.name!r} is not in the checkpoint (strict=False skips it)")
                continue
            check_entry(s.name, index["tensors"][src], s.shape)
            if s.numel:
                reader.read_into(src, s.start, s.data)     # straight into the slice's memory
    extra = sorted(n for n in list(index["tensors"]) + list(aliases) if n not in here)
    if strict and extra:
        raise CheckpointError(f"the checkpoint holds model tensors this model lacks: {extra[:10]} "
                              "(strict=False ignores them)")


def _fits(t: Any, dtype: str, numel: int) -> bool:
    """An existing tensor the checkpoint's bytes can be read into directly (no new memory, no page faults)."""
    return (isinstance(t, torch.Tensor) and t.dtype == _dtype_from_name(dtype) and t.numel() == numel
            and t.is_contiguous() and t.device.type == "cpu")


# ----------------------------------------------------------------------------------------------- optimizer
def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)


def _blocks(n: int) -> int:
    return -(-n // QBLOCK)


def _block_range(slot: ParamSlot, key: str) -> tuple[int, int]:
    total = numel_of(slot.shape)
    end = slot.start + slot.numel
    if slot.numel == 0:
        return 0, 0
    if slot.start % QBLOCK or (end % QBLOCK and end != total):
        raise CheckpointError(
            f"optimizer state {slot.name!r}/{key}: this rank's slot holds elements [{slot.start}, {end}), not "
            f"aligned to the 8-bit state's {QBLOCK}-element blocks; its block scales cannot be split there "
            "(shard on multiples of 256 elements, or use state_dtype=torch.float32/bfloat16)")
    return slot.start // QBLOCK, _blocks(slot.numel)


def optimizer_rank_part(opt_sd: dict, slots: list[ParamSlot]) -> tuple[list, dict, dict]:
    """(pieces, scalar-state tensors, header meta) of this rank's optimizer state."""
    pieces, logical, params = [], {}, {}
    group_of = {}
    i = 0
    for g, group in enumerate(opt_sd["param_groups"]):
        for _ in group["params"]:
            group_of[i] = g
            i += 1
    if i != len(slots):
        raise ValueError(f"the strategy describes {len(slots)} optimizer parameters, the optimizer has {i}")
    members = [[group_of[s.index], s.name] for s in slots]
    scalars: dict[str, dict] = {}
    state = opt_sd["state"]
    for s in slots:
        st = state.get(s.index)
        if not s.owner or not st:
            continue
        scalar = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and k.endswith("_absmax") and v.numel() == _blocks(s.numel):
                b0, _ = _block_range(s, k)
                name = f"{s.name}/{k}"
                logical[name] = [[_blocks(numel_of(s.shape))], dtype_name(v.dtype), s.name, k, "blocks"]
                pieces.append((name, b0, v.detach().reshape(-1), (_blocks(numel_of(s.shape)),)))
            elif isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == s.numel:
                name = f"{s.name}/{k}"
                logical[name] = [list(s.shape), dtype_name(v.dtype), s.name, k, "elements"]
                pieces.append((name, s.start, v.detach().reshape(-1), tuple(s.shape)))
            else:
                scalar[k] = v
        scalars[s.name] = scalar
        params[s.name] = {"start": s.start}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt_sd["param_groups"]]
    data, tensors = encode({"groups": groups, "scalars": scalars})
    for name, entry in params.items():
        entry["scalar"] = data["scalars"][name]
    meta = {"kind": "optimizer", "logical": logical, "members": members, "params": params, "groups": data["groups"]}
    return pieces, {f"{SCALAR_PREFIX}{k}": t for k, t in tensors.items()}, meta


def optimizer_index(directory: str, files: list[str], metas: list[dict]) -> dict:
    """The optimizer index from every rank's header meta (groups' hyperparameters: the first file's)."""
    logical: dict[str, list] = {}
    for m in metas:
        for name, entry in m["logical"].items():
            prev = logical.setdefault(name, entry)
            if prev[:2] != entry[:2]:
                raise CheckpointError(f"optimizer state {name!r} is {prev[1]}{prev[0]} on one rank and "
                                      f"{entry[1]}{entry[0]} on another (mixed state layouts cannot be merged)")
    tensors = build_index(directory, files, metas, {n: (e[0], e[1]) for n, e in logical.items()})
    for name, e in logical.items():
        tensors[name].update(param=e[2], key=e[3], kind=e[4])
    ngroups = max(len(m["groups"]) for m in metas)
    names: list[list[str]] = [[] for _ in range(ngroups)]
    seen: set[str] = set()
    for m in metas:
        for g, name in m["members"]:
            if name not in seen:
                seen.add(name)
                names[g].append(name)
    params: dict[str, dict] = {}
    for fname, m in zip(files, metas):
        for name, entry in m["params"].items():
            if name not in params or entry["start"] < params[name]["start"]:
                params[name] = {"file": fname, "start": entry["start"], "scalar": entry["scalar"]}
    groups = [{"hyper": h, "params": n} for h, n in zip(metas[0]["groups"], names)]
    return {"format": OPTIMIZER_INDEX, "version": INDEX_VERSION, "groups_file": files[0], "param_groups": groups,
            "params": params, "tensors": tensors}


def load_optimizer(reader: PieceReader, index: dict, optimizer: Any, slots: list[ParamSlot],
                   device: Optional[str] = None) -> None:
    inner = _inner(optimizer)
    saved = index["param_groups"]
    if len(saved) != len(inner.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved)} parameter groups, this one "
                              f"{len(inner.param_groups)}")
    by_param: dict[str, list[tuple[str, dict]]] = {}
    for name, e in index["tensors"].items():
        by_param.setdefault(e["param"], []).append((name, e))
    groups_src = LazyTensors(reader, index["groups_file"], SCALAR_PREFIX)
    sd: dict[str, Any] = {"state": {}, "param_groups": []}
    i = 0
    for g, (group, sg) in enumerate(zip(inner.param_groups, saved)):
        hyper = decode(sg["hyper"], groups_src, where=f"optimizer group {g}")
        names = set(sg["params"])
        ids = []
        for _ in group["params"]:
            slot = slots[i]
            if slot.name not in names:
                raise CheckpointError(f"optimizer parameter {slot.name!r} is in group {g} here but not in the "
                                      f"checkpoint's group {g}")
            ids.append(slot.index)
            i += 1
        sd["param_groups"].append({**hyper, "params": ids})
    params = [p for g in inner.param_groups for p in g["params"]]
    for slot in slots:
        entry = index["params"].get(slot.name)
        current = inner.state.get(params[slot.index], {})
        if entry is None:
            continue                      # no state saved for it (it never stepped)
        st = decode(entry["scalar"], LazyTensors(reader, entry["file"], SCALAR_PREFIX), where=f"optimizer {slot.name}")
        for name, e in by_param.get(slot.name, []):
            if e["kind"] == "blocks":
                first, n = _block_range(slot, e["key"])
                shape: tuple = (n,)
            else:
                check_entry(name, e, slot.shape)
                first, n, shape = slot.start, slot.numel, slot.local_shape
            t = current.get(e["key"])
            if _fits(t, e["dtype"], n) and not device:   # the state this optimizer already holds: fill it in place
                reader.read_into(name, first, t.view(-1))
            else:
                t = reader.read(name, first, n)
            t = t.view(shape)
            st[e["key"]] = t.to(device) if device else t
        sd["state"][slot.index] = st
    optimizer.load_state_dict(sd)
