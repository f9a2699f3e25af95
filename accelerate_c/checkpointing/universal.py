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

from .errors import CheckpointError, StateDictMismatch
from .format import _dtype_from_name, decode, encode
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
        if s.alias is not None and s.alias != s.name:
            aliases[s.name] = s.alias
            continue
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


def check_model(index: dict, target: torch.nn.Module, slices: list[TensorSlice], strict: bool = True) -> None:
    """Everything load_model could refuse, checked before it changes anything: the names (strict), the shapes."""
    aliases = index.get("aliases", {})
    tensors = index["tensors"]
    names = set(tensors) | {a for a, src in aliases.items() if src in tensors}
    if is_whole(slices):
        own = target.state_dict(keep_vars=True)
        present = _with_tied(target, names)
        missing = [k for k in own if k not in present]
        unexpected = sorted(k for k in names if k not in own)
        if strict and (missing or unexpected):
            raise StateDictMismatch(f"Error(s) in loading state_dict for {type(target).__name__} (nothing was "
                                    f"loaded): Missing key(s) in state_dict: {missing[:10]}; Unexpected key(s) in "
                                    f"state_dict: {unexpected[:10]} (strict=False skips both)")
        wrong = [f"{k}: {tensors[aliases.get(k, k)]['shape']} vs {list(t.shape)}" for k, t in own.items()
                 if k in names and isinstance(t, torch.Tensor) and list(t.shape) != tensors[aliases.get(k, k)]["shape"]]
        if wrong:
            raise StateDictMismatch(f"Error(s) in loading state_dict for {type(target).__name__} (nothing was "
                                    f"loaded): size mismatch (checkpoint vs this model): {wrong[:10]}")
        return
    here = set()
    for s in slices:
        here.add(s.name)
        src = aliases.get(s.name, s.name)
        if src not in tensors:
            if strict:
                raise CheckpointError(f"model tensor {s.name!r} is not in the checkpoint (strict=False skips it)")
            continue
        check_entry(s.name, tensors[src], s.shape)
    extra = sorted(n for n in names if n not in here)
    if strict and extra:
        raise CheckpointError(f"the checkpoint holds model tensors this model lacks: {extra[:10]} "
                              "(strict=False ignores them)")


def _with_tied(module: torch.nn.Module, names: set) -> set:
    """`names` with the names fill_tied would add (tensors of `module` sharing memory with a named one)."""
    probe = fill_tied(module, dict.fromkeys(names))
    return set(probe)


def load_model(reader: PieceReader, index: dict, target: torch.nn.Module, slices: list[TensorSlice],
               **load_kwargs: Any) -> None:
    """Reads the checkpoint's model into `target` (check_model first: then only a read error can stop it)."""
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
    filled: set[tuple] = set()
    with torch.no_grad():
        for s in slices:
            key = _alias_key(s)
            if key is not None and key in filled:
                continue                  # tied: this memory was filled under its first name
            if key is not None:
                filled.add(key)
            src = aliases.get(s.name, s.name)
            if src in index["tensors"] and s.numel:
                reader.read_into(src, s.start, s.data)     # straight into the slice's memory


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
    if slot.segments is not None and len(slot.segments) > 1:
        raise ValueError(
            f"optimizer state {slot.name!r}/{key}: 8-bit block scales of this rank's slot cannot be stored as blocks "
            f"of the logical tensor (the slot is {len(slot.segments)} ranges: a tensor-parallel slice along a "
            "dimension other than 0); use state_dtype=torch.float32 or torch.bfloat16 for such parameters")
    if slot.segments:
        slot = ParamSlot(slot.index, slot.name, slot.shape, slot.segments[0][0], slot.numel, slot.local_shape)
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
                flat, off = v.detach().reshape(-1), 0
                for start, count in s.ranges():
                    pieces.append((name, start, flat[off:off + count], tuple(s.shape)))
                    off += count
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


def _kind(v: Any) -> Any:
    """What a hyperparameter must stay: a number (bool apart), a string, None, or a sequence of such of a length."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return type(v)
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape))
    if isinstance(v, (list, tuple)):
        return ("sequence", tuple(_kind(x) for x in v))
    return type(v)


def _check_hyper(g: int, hyper: Any, group: dict) -> None:
    """The saved hyperparameters of group g have the kinds this optimizer's group has (what its load_state_dict and
    step would otherwise refuse half-way: a string lr, a betas of another length)."""
    if not isinstance(hyper, dict):
        raise CheckpointError(f"optimizer group {g}: hyperparameters are {type(hyper).__name__}, not a dict")
    for key, value in hyper.items():
        if key in group and key != "params" and group[key] is not None and value is not None \
                and _kind(value) != _kind(group[key]):
            raise CheckpointError(f"optimizer group {g}: hyperparameter {key!r} is {value!r} in the checkpoint, "
                                  f"this optimizer holds a {type(group[key]).__name__} ({group[key]!r})")


class OptimizerLoad:
    """A validated optimizer load (plan_optimizer): the state dict to give the optimizer, less the range reads
    that apply() does (into the state tensors the optimizer already holds where they fit)."""

    def __init__(self, optimizer: Any, sd: dict, reads: list, reader: PieceReader, device: Optional[str]) -> None:
        self.optimizer, self.sd, self.reads, self.reader, self.device = optimizer, sd, reads, reader, device

    def apply(self) -> None:
        for st, key, name, ranges, shape, into in self.reads:
            if into is not None:
                flat, off = into.view(-1), 0
                for first, n in ranges:
                    self.reader.read_into(name, first, flat[off:off + n])
                    off += n
                t = into
            else:
                parts = [self.reader.read(name, first, n) for first, n in ranges]
                t = parts[0] if len(parts) == 1 else torch.cat(parts)
            t = t.view(shape)
            st[key] = t.to(self.device) if self.device else t
        self.optimizer.load_state_dict(self.sd)


def plan_optimizer(reader: PieceReader, index: dict, optimizer: Any, slots: list[ParamSlot],
                   device: Optional[str] = None) -> OptimizerLoad:
    """Checks the checkpoint's optimizer against this one (groups, members, shapes, block alignment) and decodes
    its scalar state; changes nothing (the returned load does, with apply())."""
    inner = _inner(optimizer)
    saved = index["param_groups"]
    if len(saved) != len(inner.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved)} parameter groups, this one "
                              f"{len(inner.param_groups)}")
    by_param: dict[str, list[tuple[str, dict]]] = {}
    for name, e in index["tensors"].items():
        if e["kind"] not in ("blocks", "elements"):
            raise CheckpointError(f"optimizer state {name!r} has unknown kind {e['kind']!r}")
        by_param.setdefault(e["param"], []).append((name, e))
    groups_src = LazyTensors(reader, index["groups_file"], SCALAR_PREFIX)
    sd: dict[str, Any] = {"state": {}, "param_groups": []}
    i = 0
    for g, (group, sg) in enumerate(zip(inner.param_groups, saved)):
        hyper = decode(sg["hyper"], groups_src, where=f"optimizer group {g}")
        _check_hyper(g, hyper, group)
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
    reads = []
    for slot in slots:
        entry = index["params"].get(slot.name)
        current = inner.state.get(params[slot.index], {})
        if entry is None:
            continue                      # no state saved for it (it never stepped)
        st = decode(entry["scalar"], LazyTensors(reader, entry["file"], SCALAR_PREFIX), where=f"optimizer {slot.name}")
        if not isinstance(st, dict):
            raise CheckpointError(f"optimizer state of {slot.name!r} is {type(st).__name__}, not a dict")
        for name, e in by_param.get(slot.name, []):
            if e["kind"] == "blocks":
                first, n = _block_range(slot, e["key"])
                ranges, shape = [(first, n)], (n,)
                if list(e["shape"]) != [_blocks(numel_of(slot.shape))]:
                    raise CheckpointError(f"optimizer state {name!r} has shape {e['shape']}, the 8-bit blocks of "
                                          f"{slot.name!r} need [{_blocks(numel_of(slot.shape))}]")
            else:
                check_entry(name, e, slot.shape)
                ranges, n, shape = slot.ranges(), slot.numel, slot.local_shape
            t = current.get(e["key"])
            into = t if _fits(t, e["dtype"], n) and not device else None   # held state: filled in place
            reads.append((st, e["key"], name, ranges, shape, into))
        sd["state"][slot.index] = st
    return OptimizerLoad(optimizer, sd, reads, reader, device)
