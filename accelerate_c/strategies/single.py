# accelerate_c/strategies/single.py: one process, no communication. The reference behaviour every other
# strategy is tested against. Not for: anything distributed.
from __future__ import annotations

from typing import Any

from . import register
from .base import Strategy


@register("single")
class SingleProcess(Strategy):
    priority = 0

    @classmethod
    def applies(cls, state: Any, handlers: dict[str, Any]) -> bool:
        # one process, or one data-parallel rank (the other processes hold other slices of the model)
        return state.parallel_layout.dp_size == 1
