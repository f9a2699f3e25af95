# accelerate_c/checkpointing/format.py: the on-disk format of one checkpoint "state file".
#
# A state file is a pair: `<name>.json` (the structure, strict JSON) and, when the object holds tensors,
# `<name>.safetensors` (the tensor bytes). Any nested state dict (optimizer, scheduler, RNG, dataloader,
# custom objects) is encoded as JSON in which every tensor leaf is replaced by a reference
# {"__t__": "tensor", "key": ..., "dtype": ..., "shape": ...} into the safetensors file. Nothing here
# ever pickles: JSON carries Python scalars/containers, safetensors carries tensor bytes.
#
# Encoding rules (decode(encode(x)) == x, types included):
#   None/bool/int/str/finite float -> JSON scalars (floats round-trip exactly through repr);
#   nan/inf/-inf -> {"__t__": "float", "v": "nan"}; list -> JSON array; tuple -> {"__t__": "tuple"};
#   dict with only str keys (none equal to "__t__") -> JSON object; any other dict (int keys, as in
#   optimizer state dicts) -> {"__t__": "dict", "items": [[k, v], ...]} with k encoded like a value;
#   numpy arrays/scalars, bytes, torch.dtype, torch.device have their own tags.
# Not for: deciding which files a checkpoint holds (session.py) or atomicity (atomic.py).
from __future__ import annotations

import base64
import json
import math
import os
from typing import Any, Optional, Union

import numpy as np
import torch
from safetensors.torch import save_file

from .errors import CheckpointError
from .files import member, read_bytes
from .stfile import TensorFile

FORMAT_NAME = "accelerate_c.runtime.state"
FORMAT_VERSION = 1
TAG = "__t__"

PathLike = Union[str, "os.PathLike[str]"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown torch dtype {name!r}")
    return dtype


class _Encoder:
    """Walks an object once; collects tensors into `self.tensors` (key -> CPU contiguous tensor)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._by_id: dict[int, dict] = {}        # same tensor object -> same reference
        self._storages: set[tuple[str, int]] = set()
        self._keep: list[Any] = []               # keeps ids stable while encoding

    def tensor(self, t: torch.Tensor, path: str) -> dict:
        ref = self._by_id.get(id(t))
        if ref is not None:
            return ref
        self._keep.append(t)
        if t.layout != torch.strided:
            raise TypeError(f"{path}: sparse tensors are not supported in checkpoints")
        data = t.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        data = data.contiguous()
        # safetensors refuses tensors that share memory or view part of a storage: give those their own copy.
        st = data.untyped_storage()
        sid = (str(data.device), st.data_ptr())
        if sid in self._storages or data.storage_offset() != 0 or st.nbytes() != data.nbytes:
            data = data.clone()
            sid = (str(data.device), data.untyped_storage().data_ptr())
        if data.numel() > 0:
            self._storages.add(sid)
        key = f"t{len(self.tensors)}"
        self.tensors[key] = data
        ref = {TAG: "tensor", "key": key, "dtype": _dtype_name(t.dtype), "shape": list(t.shape)}
        self._by_id[id(t)] = ref
        return ref

    def value(self, obj: Any, path: str) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, np.generic):  # before int/float: np.float64 subclasses float
            if obj.dtype.kind not in "biuf":
                raise TypeError(f"{path}: numpy scalar of dtype {obj.dtype} cannot be stored without pickle")
            return {TAG: "npscalar", "dtype": obj.dtype.str, "v": self.value(obj.item(), path)}
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            if math.isfinite(obj):
                return float(obj)
            return {TAG: "float", "v": "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if isinstance(obj, list):
            return [self.value(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return {TAG: "tuple", "v": [self.value(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, dict):
            if all(isinstance(k, str) for k in obj) and TAG not in obj:
                return {k: self.value(v, f"{path}.{k}") for k, v in obj.items()}
            items = []
            for k, v in obj.items():
                if isinstance(k, (torch.Tensor, list, dict)):
                    raise TypeError(f"{path}: dict key of type {type(k).__name__} cannot be stored")
                items.append([self.value(k, f"{path}<key>"), self.value(v, f"{path}[{k!r}]")])
            return {TAG: "dict", "items": items}
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in "biufc":
                raise TypeError(f"{path}: numpy array of dtype {obj.dtype} cannot be stored without pickle")
            raw = torch.frombuffer(bytearray(np.ascontiguousarray(obj).tobytes()), dtype=torch.uint8) \
                if obj.nbytes else torch.empty(0, dtype=torch.uint8)
            return {TAG: "ndarray", "dtype": obj.dtype.str, "shape": list(obj.shape), "data": self.tensor(raw, path)}
        if isinstance(obj, (bytes, bytearray)):
            return {TAG: "bytes", "v": base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, torch.dtype):
            return {TAG: "torch_dtype", "v": _dtype_name(obj)}
        if isinstance(obj, torch.device):
            return {TAG: "torch_device", "v": str(obj)}
        raise TypeError(f"{path}: object of type {type(obj).__module__}.{type(obj).__qualname__} cannot be "
                        "stored in an accelerate_c checkpoint (no pickle); convert it to tensors, numbers, "
                        "strings, lists, tuples or dicts in its state_dict()")


def encode(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Returns (JSON-able structure, tensors by key). Raises TypeError naming the path of an unsupported leaf."""
    enc = _Encoder()
    return enc.value(obj, "state"), enc.tensors


def decode(data: Any, tensors: dict[str, torch.Tensor], where: str = "<memory>") -> Any:
    """Inverse of encode. `where` names the file in errors."""
    memo: dict[str, torch.Tensor] = {}

    def tensor(ref: dict) -> torch.Tensor:
        key = ref.get("key")
        if key not in tensors:
            raise CheckpointError(f"{where}: tensor {key!r} is referenced but missing from the tensor file")
        t = tensors[key]
        if _dtype_name(t.dtype) != ref.get("dtype") or list(t.shape) != ref.get("shape"):
            raise CheckpointError(f"{where}: tensor {key!r} is {t.dtype}{list(t.shape)} in the tensor file but "
                                  f"{ref.get('dtype')}{ref.get('shape')} in the index")
        return memo.setdefault(key, t)

    def value(x: Any) -> Any:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, list):
            return [value(v) for v in x]
        if not isinstance(x, dict):
            raise CheckpointError(f"{where}: unexpected JSON value {x!r}")
        tag = x.get(TAG)
        if tag is None:
            return {k: value(v) for k, v in x.items()}
        if tag == "tensor":
            return tensor(x)
        if tag == "tuple":
            return tuple(value(v) for v in x["v"])
        if tag == "dict":
            return {value(k): value(v) for k, v in x["items"]}
        if tag == "float":
            return float(x["v"])
        if tag == "npscalar":
            return np.dtype(x["dtype"]).type(value(x["v"]))
        if tag == "ndarray":
            raw = tensor(x["data"])
            return np.frombuffer(raw.numpy().tobytes(), dtype=np.dtype(x["dtype"])).reshape(x["shape"]).copy()
        if tag == "bytes":
            return base64.b64decode(x["v"])
        if tag == "torch_dtype":
            return _dtype_from_name(x["v"])
        if tag == "torch_device":
            return torch.device(x["v"])
        raise CheckpointError(f"{where}: unknown tag {tag!r} (written by a newer accelerate_c?)")

    try:
        return value(data)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise CheckpointError(f"{where}: malformed entry ({type(e).__name__}: {e})") from e
    except RecursionError:
        raise CheckpointError(f"{where}: nested too deeply") from None


def fsync_file(path: PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: PathLike, doc: Any) -> None:
    """Strict JSON (allow_nan=False), flushed and fsynced."""
    text = json.dumps(doc, allow_nan=False, separators=(",", ":"))
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def read_json(path: PathLike, expected_size: Optional[int] = None) -> Any:
    """Reads a JSON file (a regular file, not followed if a link); CheckpointError naming the file when it is
    missing, of another size than `expected_size`, truncated, nested too deeply or not JSON."""
    path = os.fspath(path)
    raw = read_bytes(path, expected_size=expected_size)
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {path} is not valid JSON (truncated or corrupt?): {e}") from None
    except RecursionError:
        raise CheckpointError(f"checkpoint file {path} is not valid JSON: nested too deeply") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def write_tensors(path: PathLike, tensors: dict[str, torch.Tensor], metadata: Optional[dict] = None) -> int:
    """Writes a safetensors file, fsyncs it, returns its size in bytes."""
    save_file(tensors, os.fspath(path), metadata=metadata)
    fsync_file(path)
    return os.path.getsize(path)


def read_tensors(path: PathLike, device: str = "cpu", expected_size: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Reads a whole safetensors file (header validated first, stfile.py); CheckpointError naming the file."""
    with TensorFile(os.fspath(path), expected_size) as f:
        tensors = f.tensors()
    return tensors if str(device) == "cpu" else {k: t.to(device) for k, t in tensors.items()}


def write_state(directory: PathLike, name: str, obj: Any, kind: str) -> list[str]:
    """Writes `<name>.json` (+ `<name>.safetensors` when obj holds tensors) into directory; returns file names."""
    data, tensors = encode(obj)
    files = []
    doc: dict[str, Any] = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "kind": kind, "tensor_file": None}
    if tensors:
        tname = f"{name}.safetensors"
        doc["tensor_file"] = tname
        doc["tensor_file_size"] = write_tensors(os.path.join(directory, tname), tensors,
                                                metadata={"format": "pt", "accelerate_c": kind})
        doc["tensor_count"] = len(tensors)
        files.append(tname)
    doc["data"] = data
    write_json(os.path.join(directory, f"{name}.json"), doc)   # written last: the JSON refers to the tensors
    files.append(f"{name}.json")
    return files


def check_format(path: PathLike, doc: Any, name: str, version: int, what: str) -> dict:
    """`doc` (read from `path`) must be a JSON object of format `name`, version `version`; else a
    CheckpointError naming the file (`what`: e.g. "state file")."""
    if not isinstance(doc, dict) or doc.get("format") != name:
        raise CheckpointError(f"checkpoint file {path} is not an accelerate_c {what}")
    if doc.get("version") != version:
        raise CheckpointError(f"checkpoint file {path} has format version {doc.get('version')!r}; this "
                              f"accelerate_c reads version {version}")
    return doc


def read_state(directory: PathLike, name: str, kind: Optional[str] = None, device: str = "cpu",
               sizes: Optional[dict] = None) -> Any:
    """Reads a state file pair written by write_state (`name` confined to `directory`; file sizes checked against
    `sizes` when given: checkpoint.json's "files"); every problem is a CheckpointError naming the file."""
    directory = os.fspath(directory)
    sizes = sizes or {}
    path = member(directory, name, f"checkpoint {directory}", ".json")
    doc = check_format(path, read_json(path, sizes.get(f"{name}.json")), FORMAT_NAME, FORMAT_VERSION, "state file")
    if kind is not None and doc.get("kind") != kind:
        raise CheckpointError(f"checkpoint file {path} holds {doc.get('kind')!r} state, expected {kind!r}")
    tensors: dict[str, torch.Tensor] = {}
    tfile = doc.get("tensor_file")
    if tfile is not None:
        tpath = member(directory, tfile, f"checkpoint file {path}")
        size = doc.get("tensor_file_size")
        if not isinstance(size, int) or isinstance(size, bool):
            raise CheckpointError(f"checkpoint file {path}: 'tensor_file_size' is {size!r}, not a byte count")
        tensors = read_tensors(tpath, device=device, expected_size=size)
        if len(tensors) != doc.get("tensor_count"):
            raise CheckpointError(f"checkpoint file {tpath} holds {len(tensors)} tensors, index says "
                                  f"{doc.get('tensor_count')}")
    if "data" not in doc:
        raise CheckpointError(f"checkpoint file {path} has no 'data' entry")
    return decode(doc["data"], tensors, where=path)
