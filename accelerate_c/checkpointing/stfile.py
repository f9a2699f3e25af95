# accelerate_c/checkpointing/stfile.py: reading a safetensors file that someone else may have written. The header
# is validated before any tensor memory is allocated, with the rules of the safetensors library: a header of at
# most 100 MB holding one JSON object; `__metadata__` maps strings to strings; every other entry has a known
# dtype, a shape of non-negative integers and `data_offsets` [begin, end] with end - begin = elements x element
# size; sorted by begin, the entries tile the data section exactly (the first begins at 0, each begins where the
# previous ends, the last ends at the end of the file): no negative, overlapping, aliased or out-of-file range,
# and a shape can claim no more elements than the file has bytes. Tensors are read with pread into memory of
# our own (nothing stays mapped).
# Not for: which files a checkpoint holds (session.py) or the pieces' meaning (pieces.py).
from __future__ import annotations

import json
import os
import struct
from typing import Any, Optional

import torch

from .errors import CheckpointError
from .files import open_regular, pread_exact

MAX_HEADER = 100_000_000
ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
             torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
DTYPE_OF = {v: k for k, v in ST_DTYPES.items()}
ITEMSIZE = {v: torch.empty((), dtype=k).element_size() for k, v in ST_DTYPES.items()}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def entry_numel(entry: dict) -> int:
    n = 1
    for d in entry["shape"]:
        n *= d
    return n


def _check_entry(key: str, e: Any) -> tuple[int, int]:
    """(begin, end) of a validated entry; ValueError naming what is wrong."""
    if not isinstance(e, dict) or set(e) - {"dtype", "shape", "data_offsets"} or len(e) != 3:
        raise ValueError(f"entry {key!r} is not {{dtype, shape, data_offsets}}")
    if e["dtype"] not in ITEMSIZE:
        raise ValueError(f"entry {key!r} has unknown dtype {e['dtype']!r}")
    shape, offs = e["shape"], e["data_offsets"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise ValueError(f"entry {key!r} has an invalid shape {shape!r}")
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) and o >= 0 for o in offs)):
        raise ValueError(f"entry {key!r} has invalid data_offsets {offs!r}")
    begin, end = offs
    if end - begin != entry_numel(e) * ITEMSIZE[e["dtype"]]:
        raise ValueError(f"entry {key!r}: data_offsets {offs} hold {end - begin} bytes, its shape {shape} of "
                         f"{e['dtype']} needs {entry_numel(e) * ITEMSIZE[e['dtype']]}")
    return begin, end


def validate_header(header: Any, data_bytes: int) -> tuple[dict, dict]:
    """(metadata, entries) of a parsed header whose data section has `data_bytes` bytes; ValueError otherwise."""
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ValueError("__metadata__ is not a map of strings to strings")
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    ranges = sorted((_check_entry(k, e), k) for k, e in entries.items())
    at = 0
    for (begin, end), key in ranges:
        if begin != at:
            what = "overlaps the previous tensor" if begin < at else f"leaves bytes [{at}, {begin}) unused"
            raise ValueError(f"entry {key!r}: data_offsets [{begin}, {end}] {what}")
        at = end
    if at != data_bytes:
        raise ValueError(f"the tensors hold {at} bytes, the data section has {data_bytes}")
    return meta, entries


class TensorFile:
    """A safetensors file opened for ranged reads: its header parsed and validated once, bytes read with pread."""

    def __init__(self, path: str, expected_size: Optional[int] = None) -> None:
        self.path = path
        self.fd = open_regular(path, expected_size)
        try:
            self.size = os.fstat(self.fd).st_size
            if self.size < 8:
                raise ValueError(f"{self.size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", pread_exact(self.fd, 8, 0, path))
            if n > min(MAX_HEADER, self.size - 8):
                raise ValueError(f"header of {n} bytes in a file of {self.size}")
            header = json.loads(pread_exact(self.fd, n, 8, path).decode("utf-8"))
            self.base = 8 + n
            self.metadata, self.entries = validate_header(header, self.size - self.base)
        except (ValueError, RecursionError, struct.error, UnicodeDecodeError) as e:
            os.close(self.fd)
            raise CheckpointError(f"checkpoint file {path} is not a valid safetensors file "
                                  f"(truncated or corrupt?): {e}") from None
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def keys(self) -> list[str]:
        return list(self.entries)

    def entry(self, key: str) -> dict:
        e = self.entries.get(key)
        if e is None:
            raise CheckpointError(f"checkpoint file {self.path} has no tensor {key!r}")
        return e

    def read_into(self, key: str, first: int, out: torch.Tensor) -> None:
        """Elements [first, first + out.numel()) of stored tensor `key` (row-major) into the contiguous 1-D `out`."""
        e = self.entry(key)
        if ST_DTYPES.get(out.dtype) != e["dtype"]:
            raise CheckpointError(f"checkpoint file {self.path}: {key!r} is {e['dtype']}, expected {out.dtype}")
        if first < 0 or first + out.numel() > entry_numel(e):
            raise CheckpointError(f"checkpoint file {self.path}: {key!r} has no elements "
                                  f"[{first}, {first + out.numel()})")
        es = out.element_size()
        off, nbytes = self.base + e["data_offsets"][0] + first * es, out.numel() * es
        if not nbytes:
            return
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        done = 0
        while done < nbytes:
            got = os.preadv(self.fd, [view[done:]], off + done)
            if got <= 0:
                raise CheckpointError(f"checkpoint file {self.path}: short read of {key!r} (truncated?)")
            done += got

    def tensor(self, key: str) -> torch.Tensor:
        """A whole stored tensor, in memory of its own (its size is bounded by the file's: validated header)."""
        e = self.entry(key)
        out = torch.empty(entry_numel(e), dtype=DTYPE_OF[e["dtype"]])
        self.read_into(key, 0, out)
        return out.view(e["shape"])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: self.tensor(k) for k in self.entries}
