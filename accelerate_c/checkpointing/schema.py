# accelerate_c/checkpointing/schema.py: the shapes of the JSON documents a load reads (checkpoint.json, the model
# and optimizer indexes), checked before anything is loaded, so that a missing or wrongly typed key is a
# CheckpointError naming the file and the key path (never a KeyError or TypeError from deep inside a load).
# A spec is: a type or a tuple of types (bool is never an int), NAT (an int >= 0), NAME (a plain file name,
# files.py), DTYPE (a torch dtype name), ANY, [spec] (a list of any length), Tuple(spec, ...) (a list of fixed
# length), Map(spec) (a JSON object of any keys), or a dict (the keys it names; a key written "?key" may be absent).
# Not for: reading the files (format.py) or what the values must agree with (pieces.py, universal.py).
from __future__ import annotations

from typing import Any

import torch

from .errors import CheckpointError
from .files import check_name

ANY = object()
NAT = "nat"
NAME = "name"
DTYPE = "dtype"


class Map:
    def __init__(self, value: Any) -> None:
        self.value = value


class Tuple:
    def __init__(self, *items: Any) -> None:
        self.items = items


def _fail(where: str, key: str, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {where}: {key or 'the document'} {what}")


def check(doc: Any, spec: Any, where: str, key: str = "") -> Any:
    """`doc` (read from file `where`) matches `spec`; returns doc."""
    if spec is ANY:
        return doc
    if spec == NAT:
        if not isinstance(doc, int) or isinstance(doc, bool) or doc < 0:
            raise _fail(where, key, f"is {doc!r}, not a non-negative integer")
    elif spec == NAME:
        check_name(doc, f"checkpoint file {where}: {key}")
    elif spec == DTYPE:
        if not isinstance(doc, str) or not isinstance(getattr(torch, doc, None), torch.dtype):
            raise _fail(where, key, f"is {doc!r}, not a torch dtype name")
    elif isinstance(spec, (type, tuple)):
        types = spec if isinstance(spec, tuple) else (spec,)
        if isinstance(doc, bool) and bool not in types or not isinstance(doc, types):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise _fail(where, key, f"is {type(doc).__name__} {_short(doc)}, expected {names}")
    elif isinstance(spec, list):
        check(doc, list, where, key)
        for i, v in enumerate(doc):
            check(v, spec[0], where, f"{key}[{i}]")
    elif isinstance(spec, Tuple):
        if not isinstance(doc, list) or len(doc) != len(spec.items):
            raise _fail(where, key, f"is {_short(doc)}, expected a list of {len(spec.items)} values")
        for i, (v, s) in enumerate(zip(doc, spec.items)):
            check(v, s, where, f"{key}[{i}]")
    elif isinstance(spec, Map):
        check(doc, dict, where, key)
        for k, v in doc.items():
            check(v, spec.value, where, f"{key}[{k!r}]")
    elif isinstance(spec, dict):
        check(doc, dict, where, key)
        for k, s in spec.items():
            name = k.lstrip("?")
            if name not in doc:
                if k.startswith("?"):
                    continue
                raise _fail(where, f"{key}.{name}" if key else repr(name), "is missing")
            check(doc[name], s, where, f"{key}.{name}" if key else name)
    else:  # pragma: no cover - a spec of ours is wrong
        raise TypeError(f"bad spec {spec!r}")
    return doc


def _short(doc: Any) -> str:
    text = repr(doc)
    return text if len(text) <= 60 else text[:57] + "..."


CHECKPOINT = {"format": str, "version": int, "world_size": int, "step": NAT, "?iteration": NAT,
              "models": [NAME], "optimizers": [NAME], "schedulers": [NAME], "?custom_objects": [NAME],
              "?scaler": (str, type(None)), "?num_dataloaders": NAT, "files": Map(NAT), "?fp8_states": bool}
_PIECE = Tuple(NAME, str, NAT, NAT)
MODEL_INDEX = {"format": str, "version": int, "?aliases": Map(str),
               "tensors": Map({"shape": [NAT], "dtype": DTYPE, "pieces": [_PIECE]})}
OPTIMIZER_INDEX = {"format": str, "version": int, "groups_file": NAME,
                   "param_groups": [{"hyper": ANY, "params": [str]}],
                   "params": Map({"file": NAME, "start": NAT, "scalar": ANY}),
                   "tensors": Map({"shape": [NAT], "dtype": DTYPE, "pieces": [_PIECE], "param": str, "key": str,
                                   "kind": str})}
