# `python -m accelerate_c estimate-memory MODEL`: the memory a model needs, from its shapes alone (it is
# built on the meta device, so nothing is allocated). MODEL is a transformers config (a config.json file
# or a local model folder; the Hub is never used) or `module:factory` (`file.py:factory` too) returning
# an nn.Module. Prints HF's table (largest layer, total size, training with Adam per dtype), the
# training breakdown (parameters, gradients, optimizer states) and, with --num_processes N, the bytes
# per rank under DDP and ZeRO stages 1/2/3 (the ZeRO paper's formulas); with --tp_size T, the same per rank of a
# tensor-parallel layout: the model's TP plan applied to the meta model (rank 0's slices), data parallelism over
# N / T ranks.
# Not for: activations or anything that depends on the batch; measuring real memory (the tests do).
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..base.units import convert_bytes as format_bytes  # HF's rendering, as HF's estimate-memory prints it

DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")  # HF's choices + bfloat16
LOAD_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "int4": 0.5}  # per floating-point element


@dataclass(frozen=True)
class Precision:
    """Bytes per trainable element when training in one dtype (ZeRO paper, section 3.1)."""
    param: int   # the parameters the forward pass uses
    grad: int    # their gradients
    master: int  # the fp32 master copy that mixed precision keeps next to the optimizer states


@dataclass(frozen=True)
class OptimizerStates:
    """What an optimizer keeps: bytes per trainable element for each state, plus bytes per parameter tensor."""
    per_element: tuple[tuple[str, float], ...]
    per_tensor: int = 0


# Data, not code: a later precision or optimizer is one more entry here.
PRECISIONS = {"float32": Precision(param=4, grad=4, master=0),
              "float16": Precision(param=2, grad=2, master=4),
              "bfloat16": Precision(param=2, grad=2, master=4)}  # int8/int4: loading only (training "N/A")
# accelerate_c.optim.Adam/AdamW(state_dtype=...): bf16 moments; 8-bit codes plus one fp32 absmax per 256-element
# block each (tensors under 4096 elements keep fp32 state: not counted, a few KiB per layer).
OPTIMIZERS = {"adam": OptimizerStates(per_element=(("exp_avg", 4), ("exp_avg_sq", 4)),
                                      per_tensor=4),  # torch keeps `step` as a float32 scalar per parameter
              "adam-bf16-state": OptimizerStates(per_element=(("exp_avg", 2), ("exp_avg_sq", 2)), per_tensor=4),
              "adam-8bit": OptimizerStates(per_element=(("exp_avg", 1 + 4 / 256), ("exp_avg_sq", 1 + 4 / 256)),
                                           per_tensor=4)}
STRATEGIES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")

FORMULAS = """\
Training memory (model states only; activations, buffers and temporary buffers are not included). For
Psi trainable parameters, P/G bytes per parameter/gradient element and K optimizer bytes per element
(including the fp32 master copy under mixed precision), per rank over N processes:
  DDP     (P + G + K) Psi          ZeRO-1  (P + G) Psi + K Psi / N
  ZeRO-2  P Psi + (G + K) Psi / N  ZeRO-3  (P + G + K) Psi / N
Adam: float32 P=4 G=4 K=8 (16 Psi); float16/bfloat16 mixed precision P=2 G=2 K=4+8=12 (16 Psi), as in
the ZeRO paper (Rajbhandari et al. 2020, K=12). The one-process total also counts torch's per-tensor
Adam step counters (4 bytes per parameter tensor); frozen parameters count in P only."""


class EstimateError(ValueError):
    """A MODEL that cannot be built (bad spec, factory error, not a module); the message says which."""


@dataclass
class ModelCounts:
    """Element counts by dtype: every tensor (parameters and buffers, each once), and per layer."""
    tensors: Counter
    params: Counter             # parameter elements by dtype
    trainable: int              # elements of parameters with requires_grad (Psi)
    trainable_tensors: int
    layers: dict[str, Counter]  # layer name -> elements by dtype (HF's definition of a layer)


def bytes_at(counts: Counter, dtype: str) -> float:
    """Bytes of `counts` loaded in `dtype`: floating-point tensors take its size, others keep theirs."""
    return sum(n * (LOAD_BYTES[dtype] if dt.is_floating_point else dt.itemsize) for dt, n in counts.items())


def count(model: Any) -> ModelCounts:
    """Counts for `model` (on any device, meta included). A layer, as in HF: a module without children or
    of a class in the model's `_no_split_modules`, plus any tensor held directly by a module with children."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    owner: dict[str, str] = {}  # module path -> the layer it belongs to
    for name, module in model.named_modules():
        parent = owner.get(name.rpartition(".")[0]) if name else None
        if parent is not None:
            owner[name] = parent
        elif name and (not any(True for _ in module.children()) or type(module).__name__ in no_split):
            owner[name] = name
    tensors, params, layers = Counter(), Counter(), {}
    trainable = trainable_tensors = 0
    items = [(n, t, True) for n, t in model.named_parameters()] + [(n, t, False) for n, t in model.named_buffers()]
    for name, t, is_param in items:
        module = name.rpartition(".")[0]
        layer = owner.get(module, name)  # a tensor held by a module with children is a layer of its own
        layers.setdefault(layer, Counter())[t.dtype] += t.numel()
        tensors[t.dtype] += t.numel()
        if is_param:
            params[t.dtype] += t.numel()
            if t.requires_grad:
                trainable += t.numel()
                trainable_tensors += 1
    return ModelCounts(tensors, params, trainable, trainable_tensors, layers)


def largest_layer(counts: ModelCounts, dtype: str) -> tuple[float, list[str]]:
    sizes = {name: bytes_at(c, dtype) for name, c in counts.layers.items()}
    top = max(sizes.values(), default=0)
    return top, [n for n, s in sizes.items() if s == top]


def training_bytes(counts: ModelCounts, dtype: str, optimizer: str = "adam") -> dict[str, float] | None:
    """One process, training in `dtype` with `optimizer`: bytes of parameters, gradients, optimizer states
    (None for a dtype that is not trained: int8/int4)."""
    prec, opt = PRECISIONS.get(dtype), OPTIMIZERS[optimizer]
    if prec is None:
        return None
    psi = counts.trainable
    floating = sum(n for dt, n in counts.params.items() if dt.is_floating_point)
    other = bytes_at(Counter({dt: n for dt, n in counts.params.items() if not dt.is_floating_point}), dtype)
    states = prec.master + sum(b for _, b in opt.per_element)
    return {"params": floating * prec.param + other, "grads": psi * prec.grad,
            "optimizer": psi * states + counts.trainable_tensors * opt.per_tensor}


def per_rank_bytes(counts: ModelCounts, dtype: str, n: int, optimizer: str = "adam") -> dict[str, float] | None:
    """Bytes per rank for each of STRATEGIES over `n` processes (FORMULAS)."""
    one = training_bytes(counts, dtype, optimizer)
    if one is None:
        return None
    prec, opt = PRECISIONS[dtype], OPTIMIZERS[optimizer]
    params, grads = one["params"], one["grads"]
    states = counts.trainable * (prec.master + sum(b for _, b in opt.per_element))
    return {"DDP": params + grads + one["optimizer"], "ZeRO-1": params + grads + states / n,
            "ZeRO-2": params + (grads + states) / n, "ZeRO-3": (params + grads + states) / n}


# ---- building the model on the meta device ---------------------------------------------------------

def build_model(spec: str) -> Any:
    """The nn.Module that `spec` names, built on the meta device."""
    import torch

    path, sep, attr = spec.rpartition(":")
    if os.path.exists(spec) or spec.endswith(".json") or not sep:
        return _from_transformers(spec)
    with torch.device("meta"):
        factory = _factory(path, attr, spec)
        try:
            model = factory()
        except Exception as exc:  # noqa: BLE001 - any error of the user's factory, named in one line
            raise EstimateError(f"{spec}: the factory raised {type(exc).__name__}: {exc}") from None
    if not isinstance(model, torch.nn.Module):
        raise EstimateError(f"{spec}: the factory returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _factory(path: str, attr: str, spec: str) -> Any:
    if path.endswith(".py"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{spec}: no file {path!r}")
        module_spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
        module = importlib.util.module_from_spec(module_spec)
        loader = module_spec.loader
    else:
        sys.path.insert(0, os.getcwd())  # what `python -m` puts first, so a local module is found
        module, loader = None, None
    try:
        if loader is not None:
            loader.exec_module(module)
        else:
            module = importlib.import_module(path)
    except Exception as exc:  # noqa: BLE001 - import errors of the user's module, named in one line
        raise EstimateError(f"{spec}: cannot import {path!r}: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        what = "has no attribute" if factory is None else "has a non-callable"
        raise EstimateError(f"{spec}: module {path!r} {what} {attr!r}; expected module:factory, a callable "
                            "returning a torch.nn.Module")
    return factory


def _from_transformers(spec: str) -> Any:
    import torch

    config_file = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{spec}: no such config file or model folder (MODEL is a config.json, a local "
                                "model folder or module:factory; the Hub is not used)")
    try:
        import transformers
    except ImportError:
        raise EstimateError(f"{spec}: reading a transformers config needs `transformers` installed") from None
    transformers.logging.set_verbosity_error()
    try:
        config = transformers.AutoConfig.from_pretrained(config_file, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise EstimateError(f"{config_file}: not a transformers config: {exc}") from None
    # The class the config names (e.g. GPT2LMHeadModel, with its head), else the base AutoModel.
    arch = next((getattr(transformers, a) for a in (config.architectures or []) if hasattr(transformers, a)), None)
    with torch.device("meta"):
        try:
            if arch is not None:
                return arch(config)  # float32 parameters (the config's own dtype is applied only on loading)
            return transformers.AutoModel.from_config(config, dtype=torch.float32)
        except Exception as exc:  # noqa: BLE001 - transformers' own error, with the file named
            raise EstimateError(f"{config_file}: transformers cannot build this model: {exc}") from None


# ---- output ------------------------------------------------------------------------------------------

def table(title: str, headers: list[str], rows: list[list[str]]) -> str:
    """A box-drawn table with a title row; every cell centred."""
    widths = [max(len(r[i]) for r in [headers, *rows]) + 2 for i in range(len(headers))]
    inner = sum(widths) + len(widths) - 1
    if len(title) + 2 > inner:
        widths[-1] += len(title) + 2 - inner
        inner = len(title) + 2

    def line(left: str, mid: str, right: str) -> str:
        return left + mid.join("─" * w for w in widths) + right

    def cells(row: list[str]) -> str:
        return "│" + "│".join(c.center(w) for c, w in zip(row, widths)) + "│"

    top = ["┌" + "─" * inner + "┐", "│" + title.center(inner) + "│", line("├", "┬", "┤")]
    body = [cells(headers), line("├", "┼", "┤"), *(cells(r) for r in rows), line("└", "┴", "┘")]
    return "\n".join(top + body)


class _SlicingGroup:
    """Rank 0 of `size` for apply_tensor_parallel on a meta model (it communicates nothing while slicing)."""

    def __init__(self, size: int) -> None:
        self.rank, self.size = 0, size

    def __getattr__(self, name: str) -> Any:
        raise EstimateError(f"estimate-memory: the tensor-parallel plan asked for a collective ({name})")


def tp_counts(model: Any, tp: int) -> ModelCounts:
    """The counts of what one rank holds at tensor-parallel degree `tp` (the model's own TP plan, sliced on the meta
    device); a model without a plan, or sizes the degree does not divide, is an error naming it."""
    from ..tensor_parallel import apply_tensor_parallel
    try:
        apply_tensor_parallel(model, _SlicingGroup(tp))
    except ValueError as exc:
        raise EstimateError(f"--tp_size {tp}: {exc}") from None
    return count(model)


def report(spec: str, counts: ModelCounts, dtypes: list[str], num_processes: int | None,
           optimizer: str = "adam", tp: int = 1, tp_counted: "ModelCounts | None" = None) -> str:
    name = optimizer.capitalize()
    rows = []
    for dt in dtypes:
        train = training_bytes(counts, dt, optimizer)
        rows.append([dt, format_bytes(largest_layer(counts, dt)[0]), format_bytes(bytes_at(counts.tensors, dt)),
                     "N/A" if train is None else format_bytes(sum(train.values()))])
    parts = [table(f"Memory Usage for loading `{spec}`", ["dtype", "Largest Layer", "Total Size",
                                                         f"Training using {name}"], rows)]
    params = sum(counts.params.values())
    parts.append(f"{params:,} parameters ({counts.trainable:,} trainable, in {counts.trainable_tensors:,} tensors), "
                 f"{sum(counts.tensors.values()) - params:,} buffer elements")
    trained = [dt for dt in dtypes if dt in PRECISIONS]
    if trained:
        rows = [[dt, *(format_bytes(v) for v in training_bytes(counts, dt, optimizer).values()),
                 format_bytes(sum(training_bytes(counts, dt, optimizer).values()))] for dt in trained]
        parts.append(table(f"Training with {name} on one process (model states)",
                           ["dtype", "Parameters", "Gradients", f"{name} states", "Total"], rows))
        if num_processes:
            ranks = {dt: per_rank_bytes(counts, dt, num_processes, optimizer) for dt in trained}
            rows = [[s, *(format_bytes(ranks[dt][s]) for dt in trained)] for s in STRATEGIES]
            parts.append(table(f"Per rank, {num_processes} processes, {name}", ["strategy", *trained], rows))
        if tp_counted is not None:
            dp = (num_processes or tp) // tp
            ranks = {dt: per_rank_bytes(tp_counted, dt, dp, optimizer) for dt in trained}
            rows = [[f"tp={tp} x {s}", *(format_bytes(ranks[dt][s]) for dt in trained)] for s in STRATEGIES]
            parts.append(table(f"Per rank, tensor parallel tp={tp} x data parallel {dp}, {name}",
                               ["layout", *trained], rows))
    return "\n".join(parts)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from .config_flags import HelpFormatter, add_flag

    class Formatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    p = subparsers.add_parser("estimate-memory", help="memory a model needs to load and to train (no allocation)",
                              description="Estimate the memory of MODEL from its shapes (built on the meta "
                                          "device).\n\n" + FORMULAS, formatter_class=Formatter)
    p.add_argument("model_name", metavar="MODEL", help="a transformers config.json, a local model folder, or "
                   "module:factory / file.py:factory (a callable returning a torch.nn.Module)")
    add_flag(p, "--dtypes", nargs="+", default=["float32", "float16", "int8", "int4"], choices=DTYPES,
             help="dtypes to show (default: HF's float32 float16 int8 int4)")
    add_flag(p, "--num_processes", type=int, default=None, help="also show the bytes per rank over this many "
             "processes under DDP and ZeRO 1/2/3")
    add_flag(p, "--optimizer", default="adam", choices=tuple(OPTIMIZERS), help="optimizer whose states are counted")
    add_flag(p, "--tp_size", type=int, default=None, help="also show the bytes per rank with tensor parallelism of "
             "this degree (the model's own TP plan; data parallelism over num_processes / tp_size ranks)")
    p.set_defaults(func=estimate_command)
    return p


def estimate_command(args: argparse.Namespace) -> int:
    if args.num_processes is not None and args.num_processes < 1:
        raise EstimateError(f"--num_processes {args.num_processes}: allowed: an integer >= 1")
    tp = args.tp_size
    if tp is not None and (tp < 1 or (args.num_processes and args.num_processes % tp)):
        raise EstimateError(f"--tp_size {tp}: allowed: an integer >= 1 that divides --num_processes "
                            f"({args.num_processes})")
    counts = count(build_model(args.model_name))
    sliced = tp_counts(build_model(args.model_name), tp) if tp and tp > 1 else None
    print(report(args.model_name, counts, list(dict.fromkeys(args.dtypes)), args.num_processes, args.optimizer,
                 tp or 1, sliced))
    return 0

