# accelerate_c/checkpointing/pieces.py: the tensor files of universal checkpoints. Each rank writes its own
# safetensors file of "pieces" (contiguous element ranges of logical tensors) with a JSON description in the
# safetensors header metadata; after a barrier every rank reads those headers (no tensor bytes) and builds the
# same index: logical name -> shape, dtype, pieces [file, key, start, numel] covering [0, numel) exactly once.
# Loading reads only the ranges a rank needs (safe_open + get_slice on the stored pieces).
# Storage of a piece: a whole tensor is stored under its logical name with its logical shape (so a one-process
# file is a plain safetensors state dict, readable by HF's loaders); a partial piece is stored 1-D under
# "<name>@<start>". Files are written by a streaming writer (header first, then one tensor at a time, no copy
# of views into flat buffers, fsync), so a writer holds at most one produced tensor at a time.
# Not for: what the pieces mean (universal.py: model and optimizer state) or the checkpoint layout (state.py).
from __future__ import annotations

import json
import math
import os
import struct
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from safetensors import SafetensorError, safe_open

from .format import CheckpointError, PathLike, _dtype_from_name, _dtype_name

META_KEY = "accelerate_c"
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def numel_of(shape: Sequence[int]) -> int:
    return int(math.prod(shape))


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a tensor without a copy when it is a contiguous CPU tensor (views into flat buffers too)."""
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def write_safetensors(path: PathLike, specs: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
                      produce: Callable[[int], torch.Tensor], metadata: Optional[dict[str, str]] = None) -> int:
    """Streams a safetensors file: the header from `specs` (key, shape, dtype), then `produce(i)` for each spec in
    order (called once each, so a caller can build one tensor at a time). fsyncs; returns the file size."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
    off = 0
    for key, shape, dtype in specs:
        if dtype not in _ST_DTYPES:
            raise TypeError(f"tensor {key!r}: dtype {dtype} cannot be stored in safetensors")
        n = numel_of(shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * (-len(hb) % 8)  # keeps the data 8-byte aligned, as safetensors' own writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for i, (key, shape, dtype) in enumerate(specs):
            t = produce(i)
            if t.dtype != dtype or t.numel() != numel_of(shape):
                raise ValueError(f"tensor {key!r}: produced {t.dtype}{list(t.shape)}, header says {dtype}{list(shape)}")
            if t.numel():
                f.write(_raw_bytes(t))
        f.flush()
        os.fsync(f.fileno())
    return os.path.getsize(path)


def rank_file(base: str, rank: int, world: int) -> str:
    """The tensor file of `rank`: `<base>.safetensors` on one process (a plain state-dict file), else
    `<base>-rank00001-of-00004.safetensors`."""
    return f"{base}.safetensors" if world == 1 else f"{base}-rank{rank:05d}-of-{world:05d}.safetensors"


def piece_key(name: str, start: int, numel: int, shape: Sequence[int]) -> str:
    return name if start == 0 and numel == numel_of(shape) else f"{name}@{start}"


def write_rank_file(path: PathLike, pieces: list[tuple[str, int, torch.Tensor, tuple[int, ...]]],
                    extra: dict[str, torch.Tensor], meta: dict) -> int:
    """One rank's file: `pieces` (logical name, start, 1-D data, logical shape) and `extra` tensors (small
    per-rank state referenced from `meta`); `meta` (JSON-able) goes into the header, with "pieces" added."""
    specs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    datas: list[torch.Tensor] = []
    listing: dict[str, list] = {}
    for name, start, data, shape in pieces:
        key = piece_key(name, start, data.numel(), shape)
        if key in listing:
            raise ValueError(f"tensor {name!r}: elements from {start} are described twice on this rank")
        whole = key == name
        specs.append((key, tuple(shape) if whole else (data.numel(),), data.dtype))
        datas.append(data)
        listing[key] = [name, int(start), int(data.numel())]
    for key, t in extra.items():
        specs.append((key, tuple(t.shape), t.dtype))
        datas.append(t)
    doc = dict(meta, pieces=listing)
    return write_safetensors(path, specs, lambda i: datas[i],
                             metadata={"format": "pt", META_KEY: json.dumps(doc, separators=(",", ":"))})


def _open(path: str) -> Any:
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {path} is not a readable safetensors file "
                              f"(truncated or corrupt?): {e}") from e


def read_rank_meta(path: str) -> dict:
    """The JSON description a rank stored in its file's header (reads the header only)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing (its rank did not write it)")
    with _open(path) as f:
        raw = (f.metadata() or {}).get(META_KEY)
    if raw is None:
        raise CheckpointError(f"checkpoint file {path} has no accelerate_c piece description")
    return json.loads(raw)


def build_index(directory: str, files: list[str], metas: list[dict], logical: dict[str, tuple[list, str]]) -> dict:
    """The index of the pieces listed in `metas` (one per file): {name: {"shape", "dtype", "pieces"}}; every
    logical tensor of `logical` (name -> (shape, dtype name)) must be covered exactly once (an error names the
    tensor and the missing or doubly written range)."""
    found: dict[str, list] = {name: [] for name in logical}
    for fname, meta in zip(files, metas):
        for key, (name, start, numel) in meta["pieces"].items():
            if name not in found:
                raise CheckpointError(f"{fname}: piece {key!r} of unknown tensor {name!r}")
            if numel:
                found[name].append([fname, key, start, numel])
    index = {}
    for name, (shape, dtype) in logical.items():
        pieces = sorted(found[name], key=lambda p: p[2])
        at, total = 0, numel_of(shape)
        for fname, key, start, numel in pieces:
            if start != at:
                what = "written twice" if start < at else "written by no rank"
                lo, hi = (start, at) if start < at else (at, start)
                raise CheckpointError(f"tensor {name!r}: elements [{lo}, {hi}) {what} ({fname})")
            at = start + numel
        if at != total:
            raise CheckpointError(f"tensor {name!r}: elements [{at}, {total}) written by no rank")
        index[name] = {"shape": list(shape), "dtype": dtype, "pieces": pieces}
    return index


class PieceReader:
    """Reads element ranges of logical tensors from an index's pieces, opening each file once (sizes, when
    given, are checked first: a truncated file is named)."""

    def __init__(self, directory: str, index: dict, sizes: Optional[dict[str, int]] = None) -> None:
        self.directory, self.index, self.sizes = directory, index, sizes or {}
        self._files: dict[str, Any] = {}

    def file(self, fname: str) -> Any:
        f = self._files.get(fname)
        if f is None:
            path = os.path.join(self.directory, fname)
            if os.path.basename(fname) != fname:
                raise CheckpointError(f"checkpoint index names an invalid file {fname!r}")
            if not os.path.isfile(path):
                raise CheckpointError(f"checkpoint file {path} is missing")
            want = self.sizes.get(fname)
            if want is not None and os.path.getsize(path) != want:
                raise CheckpointError(f"checkpoint file {path} has {os.path.getsize(path)} bytes but {want} were "
                                      "written (truncated or replaced?)")
            f = self._files[fname] = _open(path).__enter__()
        return f

    def close(self) -> None:
        for f in self._files.values():
            f.__exit__(None, None, None)
        self._files.clear()

    def __enter__(self) -> "PieceReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def entry(self, name: str) -> dict:
        e = self.index.get(name)
        if e is None:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint")
        return e

    def _piece_range(self, fname: str, key: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of a stored piece (row-major), reading whole rows of an N-d stored tensor."""
        f = self.file(fname)
        try:
            sl = f.get_slice(key)
            shape = sl.get_shape()
            if a == 0 and b == numel_of(shape):
                return f.get_tensor(key).reshape(-1)
            if len(shape) == 1:
                return sl[a:b]
            row = numel_of(shape[1:])
            r0, r1 = a // row, -(-b // row)
            return sl[r0:r1].reshape(-1)[a - r0 * row: b - r0 * row]
        except SafetensorError as e:
            raise CheckpointError(f"checkpoint file {os.path.join(self.directory, fname)}: cannot read {key!r}: "
                                  f"{e}") from e

    def read(self, name: str, start: int, numel: int) -> torch.Tensor:
        """Elements [start, start + numel) of the logical tensor `name`, 1-D, in its stored dtype. Possibly a
        copy-on-write view of the file's mapping (safetensors maps files): copy it into memory that lasts."""
        e = self.entry(name)
        total = numel_of(e["shape"])
        if start < 0 or start + numel > total:
            raise CheckpointError(f"tensor {name!r}: elements [{start}, {start + numel}) requested, it has {total}")
        end = start + numel
        parts = []
        for fname, key, p0, pn in e["pieces"]:
            lo, hi = max(start, p0), min(end, p0 + pn)
            if lo < hi:
                parts.append(self._piece_range(fname, key, lo - p0, hi - p0))
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return torch.empty(0, dtype=_dtype_from_name(e["dtype"]))
        return torch.cat(parts)

    def read_whole(self, name: str) -> torch.Tensor:
        e = self.entry(name)
        return self.read(name, 0, numel_of(e["shape"])).view(e["shape"])


class LazyTensors:
    """The mapping `format.decode` needs for tensor references stored in one rank file under `prefix`: opens the
    file only when a reference is decoded."""

    def __init__(self, reader: PieceReader, fname: str, prefix: str) -> None:
        self.reader, self.fname, self.prefix = reader, fname, prefix

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and f"{self.prefix}{key}" in self.reader.file(self.fname).keys()

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.reader.file(self.fname).get_tensor(f"{self.prefix}{key}").clone()  # not a view of the mapping


def dtype_name(dtype: torch.dtype) -> str:
    return _dtype_name(dtype)


def check_entry(name: str, entry: dict, shape: Iterable[int], dtype: Optional[torch.dtype] = None) -> None:
    """The checkpoint's logical tensor must have the shape (and dtype, when given) this rank expects."""
    if list(entry["shape"]) != list(shape):
        raise CheckpointError(f"tensor {name!r} has shape {entry['shape']} in the checkpoint but {list(shape)} here")
    if dtype is not None and entry["dtype"] != _dtype_name(dtype):
        raise CheckpointError(f"tensor {name!r} is {entry['dtype']} in the checkpoint but {_dtype_name(dtype)} here")
