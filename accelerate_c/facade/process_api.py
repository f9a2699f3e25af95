# accelerate_c/facade/process_api.py: the process-control and collective half of the Accelerator API
# (is_main_process, wait_for_everyone, gather, gather_for_metrics, reduce, triggers, decorators, ...),
# as a mixin so accelerator.py stays small. Everything delegates to PartialState or utils.operations.
# Not for: training-step logic (accelerator.py) or checkpoints (checkpoint_api.py).
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

from ..runtime.state import PartialState
from ..runtime import operations as _ops  # imported here, not per call: gather/reduce are everyday calls


class ProcessAPI:
    state: Any
    gradient_state: Any
    flag_tensor: Optional[torch.Tensor]

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    def wait_for_everyone(self) -> None:
        PartialState().wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        PartialState().print(*args, **kwargs)

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        with PartialState().main_process_first():
            yield

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        with PartialState().local_main_process_first():
            yield

    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        with PartialState().split_between_processes(inputs, apply_padding=apply_padding) as part:
            yield part

    def on_main_process(self, function: Optional[Callable] = None) -> Callable:
        return PartialState().on_main_process(function)

    def on_local_main_process(self, function: Optional[Callable] = None) -> Callable:
        return PartialState().on_local_main_process(function)

    def on_last_process(self, function: Callable) -> Callable:
        return PartialState().on_last_process(function)

    def on_process(self, function: Optional[Callable] = None, process_index: Optional[int] = None) -> Callable:
        return PartialState().on_process(function, process_index=process_index)

    def on_local_process(self, function: Optional[Callable] = None,
                         local_process_index: Optional[int] = None) -> Callable:
        return PartialState().on_local_process(function, local_process_index=local_process_index)

    # -- collectives -----------------------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        return _ops.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gathers like `gather`, then drops the samples the last batch repeated to keep ranks even. Under a layout
        whose TP/CP/PP ranks read the same batch, gathers over the data-parallel ranks only (every sample once;
        HF 1.15 gathers every rank's copy)."""
        if isinstance(input_data, torch.Tensor):
            all_tensors = True
        else:
            try:
                _ops.recursively_apply(lambda x: x, input_data, error_on_other_type=True)
                all_tensors = True
            except TypeError:
                all_tensors = False
        use_gather_object = use_gather_object or not all_tensors
        layout = self.state.parallel_layout
        if layout.data_replicated:  # the ranks of a TP/CP/PP group hold the same samples: each is kept once
            data = _gather_data_parallel(input_data, layout.dim("dp"), use_gather_object)
        else:
            data = _ops.gather_object(input_data) if use_gather_object else _ops.gather(input_data)
        gs = self.gradient_state
        if not gs.end_of_dataloader or gs.remainder <= 0:
            return data
        keep = gs.remainder
        if use_gather_object:
            return data[:keep]
        return _ops.recursively_apply(lambda t: t[:keep], data)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return _ops.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        return _ops.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def set_trigger(self) -> None:
        self.flag_tensor = torch.tensor(1, device=self.state.device)

    def check_trigger(self) -> bool:
        if self.flag_tensor is None:
            self.flag_tensor = torch.tensor(0, device=self.state.device)
        flag = self.reduce(self.flag_tensor)
        if flag.item() >= 1:
            self.flag_tensor = torch.tensor(0, device=self.state.device)
            return True
        return False


def _gather_data_parallel(data: Any, dp: Any, objects: bool) -> Any:
    """gather / gather_object over the data-parallel group `dp` (a layout's DimGroup), in dp order: what every
    process holds once per batch replica."""
    if objects:
        if dp.size == 1:
            return data
        import torch.distributed as dist
        out: list = [None] * dp.size
        dist.all_gather_object(out, data, group=dp.process_group)
        return [x for part in out for x in part]

    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()[None] if t.ndim == 0 else t.contiguous()
        return dp.group.all_gather(t.new_empty((dp.size * t.shape[0], *t.shape[1:])), t)

    return _ops.recursively_apply(one, data, error_on_other_type=True)
