# accelerate_c/facade/feature_api.py: HF 1.15 Accelerator methods that belong to features of other libraries or
# that accelerate_c does not run, as a mixin: `maybe_context_parallel` (context parallelism: cp_size > 1 is refused
# when the layout is built, so the context has no effect, with HF's warning), `deepspeed_ulysses_dl_adapter`
# (DeepSpeed's Ulysses sequence parallelism: sp_size > 1 is refused, so the loader comes back as it is), and
# `lomo_backward` (the fused backward of lomo_optim's Lomo / AdaLomo optimizers, as HF calls it).
# Not for: the parallel layout itself (facade/parallel.py, runtime/layout.py).
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from ..base.imports import is_lomo_available
from ..runtime.logging import get_logger

logger = get_logger(__name__)


class FeatureAPI:
    """maybe_context_parallel, deepspeed_ulysses_dl_adapter and lomo_backward (see the module header)."""

    _optimizers: list

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers: Optional[list] = None, buffer_seq_dims: Optional[list] = None,
                               no_restore_buffers: Optional[set] = None) -> Iterator[None]:
        logger.warning_once("Context parallel training is not enabled. This context manager will have no effect. "
                            "To enable it, set `parallelism_config.cp_size` > 1 in the `Accelerator` constructor.")
        yield

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any) -> Any:
        return dl

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """HF's: the fused backward (and update) of every prepared Lomo / AdaLomo optimizer."""
        if learning_rate is None:
            raise ValueError("A learning rate must be passed in order to call backward pass with LOMO optimizers.")
        lomo: tuple = ()
        if is_lomo_available():
            from lomo_optim import AdaLomo, Lomo
            lomo = (Lomo, AdaLomo)
        called = False
        for optimizer in self._optimizers:
            if lomo and isinstance(optimizer.optimizer, lomo):
                optimizer.optimizer.fused_backward(loss, learning_rate)
                called = True
        if not called:
            raise ValueError("Backward pass not properly called on LOMO optimizers. Are you sure you passed a LOMO "
                             "optimizer in accelerator.prepare()?")
