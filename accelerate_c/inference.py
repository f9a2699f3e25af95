# accelerate_c/inference.py: HF's `accelerate.inference` (prepare_pippy): pipeline-parallel inference of a model
# split across the processes of a launched job by torch.distributed.pipelining (its tracer cuts the model at the
# split points, each process builds its own stage, a GPipe schedule runs the micro-batches). With
# split_points="auto" the cuts balance the model's bytes over num_chunks stages (our infer_auto_device_map with an
# equal budget per stage, no_split_module_classes kept whole), as HF does. The wrapped model's forward takes the
# whole batch on the first process (padded to a multiple of num_chunks) and returns the output on the last one
# (None elsewhere), or on every process with gather_output=True. One process: the model's own forward.
# Not for: training with pipeline parallelism (pipeline/, through ParallelismConfig(pp_size=...)).
from __future__ import annotations

import math
from types import MethodType
from typing import Any, Optional, Union

import torch

from .bigmodel.device_map import infer_auto_device_map
from .bigmodel.sizes import compute_module_sizes
from .runtime.operations import broadcast_object_list, send_to_device
from .runtime.state import PartialState
from .runtime.structures import ignorant_find_batch_size, pad_input_tensors


def _auto_split_points(model: torch.nn.Module, stages: int, no_split: Optional[list[str]]) -> list[str]:
    """The first module of stages 1..stages-1 when the model's bytes are spread evenly (10 % headroom each)."""
    budget = math.ceil(compute_module_sizes(model)[""] / stages * 1.1)
    device_map = infer_auto_device_map(model, max_memory={i: budget for i in range(stages)},
                                       no_split_module_classes=no_split, clean_result=False)
    points = []
    for i in range(1, stages):
        first = next((name for name, dev in device_map.items() if dev == i), None)
        if first is None:
            raise ValueError(f"prepare_pippy: the model does not split into {stages} stages of about {budget} bytes "
                             "(too few modules that may be split); pass split_points")
        points.append(first)
    return points


def _contiguous_boundaries(pipe: Any) -> None:
    """What one stage sends another (and the buffer the receiver allocates from the traced metadata) made
    contiguous: torch's pipelining keeps the traced strides, and gloo (and NCCL) send and receive only contiguous
    tensors, so an expanded attention mask crossing a cut (BERT's) failed there."""
    import torch.fx as fx

    for sub in pipe.split_gm.children():
        if not isinstance(sub, fx.GraphModule):
            continue
        graph = sub.graph
        for node in list(graph.nodes):
            val = node.meta.get("val")
            if node.op == "placeholder" and isinstance(val, torch.Tensor) and not val.is_contiguous():
                node.meta["val"] = val.contiguous()
            if node.op != "output":
                continue

            def fix(arg: fx.Node, out: fx.Node = node, graph: fx.Graph = graph) -> fx.Node:
                v = arg.meta.get("val")
                if not isinstance(v, torch.Tensor) or v.is_contiguous():
                    return arg
                with graph.inserting_before(out):
                    c = graph.call_method("contiguous", (arg,))
                c.meta = {**arg.meta, "val": v.contiguous()}
                return c
            node.args = fx.node.map_arg(node.args, fix)
        sub.recompile()


def _batch_size(args: tuple, kwargs: dict) -> Optional[int]:
    for value in (*args, *kwargs.values()):
        found = ignorant_find_batch_size(value)
        if found is not None:
            return found
    return None


def prepare_pippy(model: torch.nn.Module, split_points: Union[str, list[str]] = "auto",
                  no_split_module_classes: Optional[list[str]] = None, example_args: Optional[tuple] = (),
                  example_kwargs: Optional[dict[str, Any]] = None, num_chunks: Optional[int] = None,
                  gather_output: Optional[bool] = False) -> torch.nn.Module:
    """HF 1.15's prepare_pippy: `model` with its forward replaced by this process's part of the pipeline
    (example_args / example_kwargs: one micro-batch's inputs, used to trace the model)."""
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

    state = PartialState()
    example_args = send_to_device(tuple(example_args or ()), "cpu")
    example_kwargs = send_to_device(dict(example_kwargs or {}), "cpu")
    num_chunks = state.num_processes if num_chunks is None else int(num_chunks)
    if split_points == "auto":
        split_points = _auto_split_points(model, num_chunks, no_split_module_classes)
    elif isinstance(split_points, str):
        raise ValueError(f"prepare_pippy: split_points={split_points!r}: 'auto' or a list of module names")
    if len(split_points) + 1 != state.num_processes:
        raise ValueError(f"prepare_pippy: {len(split_points)} split points make {len(split_points) + 1} stages for "
                         f"{state.num_processes} processes (one stage per process)")
    pipe = pipeline(model, mb_args=example_args, mb_kwargs=example_kwargs,
                    split_spec={name: SplitPoint.BEGINNING for name in split_points})
    _contiguous_boundaries(pipe)
    schedule = ScheduleGPipe(pipe.build_stage(state.local_process_index, device=state.device), num_chunks)
    model._original_forward, model._original_call = model.forward, model.__call__
    model.pippy_stage, model.hf_split_points = schedule, list(split_points)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return _pipelined(schedule, num_chunks, bool(gather_output), args, kwargs)

    forward.__wrapped__ = MethodType(forward, model)
    model.forward = forward
    return model


def _pipelined(schedule: Any, num_chunks: int, gather: bool, args: tuple, kwargs: dict) -> Any:
    state = PartialState()
    if state.num_processes == 1:
        return schedule.step(*args, **kwargs)
    output = None
    if state.process_index == 0:
        n = _batch_size(args, kwargs)
        if n is None:
            raise ValueError("prepare_pippy: no batch dimension found in the forward's inputs")
        if n % num_chunks:
            args, kwargs = pad_input_tensors(args, n, num_chunks), pad_input_tensors(kwargs, n, num_chunks)
        schedule.step(*args, **kwargs)
    elif state.is_last_process:
        output = schedule.step()
    else:
        schedule.step()
    if gather:
        box = [output]
        broadcast_object_list(box, from_process=state.num_processes - 1)
        output = box[0]
    return output
