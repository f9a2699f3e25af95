# accelerate_c/checkpointing/pieces.py: the tensor files of universal checkpoints. Each rank writes its own
# safetensors file of "pieces" (contiguous element ranges of logical tensors) with a JSON description in the
# safetensors header metadata; after a barrier every rank reads those headers (no tensor bytes) and builds the
# same index: logical name -> shape, dtype, pieces [file, key, start, numel] covering [0, numel) exactly once.
# Loading reads only the ranges a rank needs: the safetensors header gives each stored piece's byte offsets, and
# a range of a row-major tensor is one contiguous byte range, read with pread straight into the destination
# (safetensors' own safe_open maps the file: its tensors are copy-on-write views that fault page by page and
# keep the mapping alive; one read into memory of our own is faster and leaves nothing mapped).
# Storage of a piece: a whole tensor is stored under its logical name with its logical shape (so a one-process
# file is a plain safetensors state dict, readable by HF's loaders); a partial piece is stored 1-D under
# "<name>@<start>". Files are written by a streaming writer (header first, then one tensor at a time, no copy
# of views into flat buffers, fsync), so a writer holds at most one produced tensor at a time.
# Not for: what the pieces mean (universal.py: model and optimizer state) or which files a checkpoint holds
# (session.py).
from __future__ import annotations

import json
import math
import os
import struct
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from ..base.killpoints import kill_point
from .errors import CheckpointError
from .files import check_name
from .format import PathLike, _dtype_from_name, _dtype_name
from .stfile import ST_DTYPES, TensorFile, entry_numel

META_KEY = "accelerate_c"
_ST_DTYPES = ST_DTYPES


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
            if i == 0:
                kill_point("save.mid_piece")
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


def read_rank_meta(path: str, expected_size: Optional[int] = None) -> dict:
    """The JSON description a rank stored in its file's header (reads the header only)."""
    with TensorFile(path, expected_size) as f:
        return rank_meta(f)


def rank_meta(f: TensorFile) -> dict:
    """The JSON description a rank stored in the header of the opened file `f`."""
    raw = f.metadata.get(META_KEY)
    if raw is None:
        raise CheckpointError(f"checkpoint file {f.path} has no accelerate_c piece description")
    doc = json.loads(raw)
    if not isinstance(doc, dict):
        raise CheckpointError(f"checkpoint file {f.path}: its piece description is not a JSON object")
    return doc


def build_index(directory: str, files: list[str], metas: list[dict], logical: dict[str, tuple[list, str]]) -> dict:
    """The index of the pieces listed in `metas` (one per file): {name: {"shape", "dtype", "pieces"}}; every
    logical tensor of `logical` (name -> (shape, dtype name)) must be covered exactly once (an error names the
    tensor and the missing or doubly written range)."""
    found: dict[str, list] = {name: [] for name in logical}
    for fname, meta in zip(files, metas):
        for key, (name, start, numel) in meta["pieces"].items():
            if not numel:
                continue
            if name not in found:
                raise CheckpointError(f"{fname}: piece {key!r} of unknown tensor {name!r}")
            found[name].append([fname, key, start, numel])
    index = {}
    for name, (shape, dtype) in logical.items():
        check_cover(name, found[name], numel_of(shape))
        index[name] = {"shape": list(shape), "dtype": dtype, "pieces": sorted(found[name], key=lambda p: p[2])}
    return index


def check_cover(name: str, pieces: list, total: int) -> None:
    """The pieces [file, key, start, numel] of logical tensor `name` cover [0, total) exactly once."""
    at = 0
    for fname, key, start, numel in sorted(pieces, key=lambda p: p[2]):
        if start != at:
            what = "written twice" if start < at else "written by no rank"
            lo, hi = (start, at) if start < at else (at, start)
            raise CheckpointError(f"tensor {name!r}: elements [{lo}, {hi}) {what} ({fname})")
        at = start + numel
    if at != total:
        raise CheckpointError(f"tensor {name!r}: elements [{at}, {total}) written by no rank")


class PieceReader:
    """Reads element ranges of logical tensors from an index's pieces, opening each file once (sizes, when
    given, are checked first: a truncated file is named)."""

    def __init__(self, directory: str, index: dict, sizes: Optional[dict[str, int]] = None) -> None:
        self.directory, self.index, self.sizes = directory, index, sizes or {}
        self._files: dict[str, Any] = {}

    def file(self, fname: str) -> TensorFile:
        f = self._files.get(fname)
        if f is None:
            check_name(fname, "the checkpoint's tensor index")
            f = self._files[fname] = TensorFile(os.path.join(self.directory, fname), self.sizes.get(fname))
        return f

    def validate(self) -> None:
        """Every tensor of the index: a known dtype, pieces that tile it exactly once, each piece a whole stored
        tensor of its file with that dtype and element count (files opened and their headers validated); nothing
        is read or allocated beyond the headers."""
        for name, e in self.index.items():
            want = ST_DTYPES.get(_dtype_from_name(e["dtype"]))
            if want is None:
                raise CheckpointError(f"tensor {name!r} has dtype {e['dtype']!r}, which safetensors cannot hold")
            check_cover(name, e["pieces"], numel_of(e["shape"]))
            for fname, key, start, numel in e["pieces"]:
                stored = self.file(fname).entry(key)
                if stored["dtype"] != want or entry_numel(stored) != numel:
                    raise CheckpointError(
                        f"checkpoint file {os.path.join(self.directory, fname)}: tensor {key!r} is "
                        f"{stored['dtype']}{stored['shape']}, the index says {numel} elements of {want} "
                        f"(elements [{start}, {start + numel}) of {name!r})")

    def close(self) -> None:
        for f in self._files.values():
            f.close()
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

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Elements [start, start + out.numel()) of the logical tensor `name` into `out` (1-D): read straight
        into it when it is a contiguous CPU tensor of the stored dtype, else through a temporary (cast, device)."""
        e = self.entry(name)
        total, end = numel_of(e["shape"]), start + out.numel()
        if start < 0 or end > total:
            raise CheckpointError(f"tensor {name!r}: elements [{start}, {end}) requested, it has {total}")
        dtype = _dtype_from_name(e["dtype"])
        direct = out.is_contiguous() and out.dtype == dtype and out.device.type == "cpu"
        dst = out if direct else torch.empty(out.numel(), dtype=dtype)
        for fname, key, p0, pn in e["pieces"]:
            lo, hi = max(start, p0), min(end, p0 + pn)
            if lo < hi:
                self.file(fname).read_into(key, lo - p0, dst[lo - start: hi - start])
        if dst is not out:
            out.copy_(dst)

    def read(self, name: str, start: int, numel: int) -> torch.Tensor:
        """Elements [start, start + numel) of the logical tensor `name`: a new 1-D tensor of its stored dtype."""
        out = torch.empty(numel, dtype=_dtype_from_name(self.entry(name)["dtype"]))
        self.read_into(name, start, out)
        return out

    def read_whole(self, name: str) -> torch.Tensor:
        e = self.entry(name)
        return self.read(name, 0, numel_of(e["shape"])).view(e["shape"])


class LazyTensors:
    """The mapping `format.decode` needs for tensor references stored in one rank file under `prefix`: opens the
    file only when a reference is decoded."""

    def __init__(self, reader: PieceReader, fname: str, prefix: str) -> None:
        self.reader, self.fname, self.prefix = reader, fname, prefix

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and f"{self.prefix}{key}" in self.reader.file(self.fname).entries

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.reader.file(self.fname).tensor(f"{self.prefix}{key}")


def dtype_name(dtype: torch.dtype) -> str:
    return _dtype_name(dtype)


def check_entry(name: str, entry: dict, shape: Iterable[int], dtype: Optional[torch.dtype] = None) -> None:
    """The checkpoint's logical tensor must have the shape (and dtype, when given) this rank expects."""
    if list(entry["shape"]) != list(shape):
        raise CheckpointError(f"tensor {name!r} has shape {entry['shape']} in the checkpoint but {list(shape)} here")
    if dtype is not None and entry["dtype"] != _dtype_name(dtype):
        raise CheckpointError(f"tensor {name!r} is {entry['dtype']} in the checkpoint but {_dtype_name(dtype)} here")
