# accelerate_c/comm/solo.py: SoloGroup, the CollectiveGroup of a dimension of size 1 (a layout's tp group when
# tp_size == 1, ...): every collective of one rank is the identity (or a copy for the out-of-place ones), so code
# written against a group never branches on the size. No process group, no shared memory, no communication.
# Not for: groups of several ranks (group.py picks those).
from __future__ import annotations

from typing import Any, Optional

import torch

from accelerate_c.comm.shm import Work, _op_code, check_scatter_input


def _done() -> Work:
    w = Work()
    w._done.set()
    return w


class SoloGroup:
    """The CollectiveGroup interface (group.py) for a group holding only this rank: rank 0 of size 1."""

    rank = 0
    size = 1
    pg = None

    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        _op_code(op)  # an unknown op is still an error
        return tensor

    def all_reduce_into(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        _op_code(op)
        return output.copy_(input)

    def all_reduce_async(self, tensor: torch.Tensor, op: Any = "sum") -> Work:
        _op_code(op)
        return _done()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        _op_code(op)
        return output.copy_(input.reshape(output.shape))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        return output.copy_(input.reshape(output.shape))

    def reduce_scatter_async(self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum") -> Work:
        self.reduce_scatter(output, input, op)
        return _done()

    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        self.all_gather(output, input)
        return _done()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if src != 0:
            raise ValueError(f"broadcast: src={src} is not a rank of a group of size 1")
        return tensor

    def scatter(self, output: torch.Tensor, input: Optional[torch.Tensor], src: int = 0) -> torch.Tensor:
        if src != 0:
            raise ValueError(f"scatter: src={src} is not a rank of a group of size 1")
        return output.copy_(check_scatter_input(output, input, 1, 0).reshape(output.shape))

    def barrier(self) -> None:
        pass

    def alloc(self, numel: int, dtype: torch.dtype = torch.float32,
              device: Optional[torch.device] = None) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=device)

    def host_group(self) -> None:
        """No shared memory: nothing to share with."""
        return None

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return "SoloGroup(size=1)"
