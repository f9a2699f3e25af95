# accelerate_c/runtime/logging.py: `get_logger(name, log_level=None)`, a stdlib logger wrapped so that, on N
# processes, a record is emitted by the main process only (default), by every process
# (`main_process_only=False`), or by every process one after the other in rank order (`in_order=True`).
# Records are prefixed with "[RANK i] ". HF Accelerate 1.15's MultiProcessAdapter semantics.
# Not for: configuring handlers or formats (that stays the script's business, as with stdlib logging).
from __future__ import annotations

import functools
import logging
from typing import Any, Optional

from ..base import settings
from .state import PartialState


class MultiProcessAdapter(logging.LoggerAdapter):
    """A LoggerAdapter whose logging calls accept `main_process_only` (default True) and `in_order`
    (default False; when True every rank logs, in rank order, and `main_process_only` is ignored)."""

    @staticmethod
    def _should_log(main_process_only: bool) -> bool:
        return not main_process_only or PartialState().is_main_process

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        msg, kwargs = super().process(msg, kwargs)
        # Point findCaller at the user's line, not at this adapter, unless the caller chose a level.
        kwargs.setdefault("stacklevel", 2)
        return f"[RANK {PartialState().process_index}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        if not PartialState._shared_state:
            raise RuntimeError("You must initialize the accelerate state by calling either `PartialState()` or "
                               "`Accelerator()` before using the logging utility.")
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        msg, kwargs = self.process(msg, kwargs)
        if not in_order:
            if self._should_log(main_process_only):
                self.logger.log(level, msg, *args, **kwargs)
            return
        # Rank i writes in round i; the barrier after each round orders the writes across processes.
        # Every rank must make this call (it is collective), exactly as with wait_for_everyone().
        state = PartialState()
        for rank in range(state.num_processes):
            if rank == state.process_index:
                self.logger.log(level, msg, *args, **kwargs)
            state.wait_for_everyone()

    @functools.lru_cache(None)
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """`warning`, emitted once per distinct arguments (the cache key is the arguments, not the caller)."""
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: Optional[str | int] = None) -> MultiProcessAdapter:
    """A multi-process-aware logger for `name`. `log_level` (default: env ACCELERATE_LOG_LEVEL, else left
    unset) sets the level of this logger and of the root logger, as HF Accelerate does."""
    source = "log_level"
    if log_level is None:
        log_level, source = settings.env_value("ACCELERATE_LOG_LEVEL"), "ACCELERATE_LOG_LEVEL"
    logger = logging.getLogger(name)
    if log_level is not None:
        level = log_level if isinstance(log_level, int) else str(log_level).upper()
        if not isinstance(level, int) and not isinstance(logging.getLevelName(level), int):
            raise ValueError(f"get_logger: unknown {source} {log_level!r}; use one of DEBUG, INFO, WARNING, "
                             "ERROR, CRITICAL")
        logger.setLevel(level)
        logger.root.setLevel(level)
    return MultiProcessAdapter(logger, {})


__all__ = ["MultiProcessAdapter", "get_logger"]
