# accelerate_c/tracking/base.py: the contract every experiment tracker follows (HF Accelerate 1.15's
# GeneralTracker), the `on_main_process` method decorator trackers use, and `plain_values`, which turns
# what scripts log (tensors, numpy scalars, nested dicts) into plain Python numbers.
# Not for: any concrete tracker (local.py, hosted.py) or choosing trackers (tracking/__init__.py).
from __future__ import annotations

from functools import wraps
from typing import Any, Callable, Optional


def on_main_process(function: Callable) -> Callable:
    """Runs a tracker method on the main process only when the tracker's `main_process_only` is true.

    The check happens at call time, so constructing a tracker never creates the PartialState (a user may
    build tracker instances before the Accelerator and its InitProcessGroupKwargs)."""

    @wraps(function)
    def run_on_main(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False):
            from ..runtime.state import PartialState

            return PartialState().on_main_process(function)(self, *args, **kwargs)
        return function(self, *args, **kwargs)

    return run_on_main


class GeneralTracker:
    """Base class for trackers, built-in or the user's own (pass an instance in `log_with`).

    A subclass defines `name` (str), `requires_logging_directory` (bool) and a `tracker` property (the
    underlying run/writer object), and overrides what it needs of `start`, `store_init_configuration`,
    `log` and `finish`. `main_process_only` (default True) makes the `on_main_process`-decorated methods
    run on the main process only. `GeneralTracker(_blank=True)` is the placeholder `get_tracker` returns
    on ranks that hold no trackers.
    """

    main_process_only = True

    def __init__(self, _blank: bool = False) -> None:
        if _blank:
            return
        missing = [f"`{attr}`" for attr in ("name", "requires_logging_directory") if not hasattr(self, attr)]
        if "tracker" not in dir(self):  # a property that may only work after start(): look, don't call
            missing.append("`tracker`")
        if missing:
            raise NotImplementedError(
                f"The implementation for this tracker class ({type(self).__name__}) is missing the following "
                f"required attributes. Please define them in the class definition: {', '.join(missing)}")

    def start(self) -> None:
        """Creates the underlying run. Called by `Accelerator.init_trackers`, after the process group exists."""

    def store_init_configuration(self, values: dict) -> None:
        """Records `values` (str/bool/int/float/None) as the run's hyperparameters."""

    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        """Records `values` for this run, at `step` when given."""

    def finish(self) -> None:
        """Flushes and closes the run (called by `Accelerator.end_training`)."""


def _is_numpy(value: Any) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "tolist")


def plain_values(values: dict) -> dict:
    """`values` with tensors and numpy values turned into Python numbers (0-d → a number, else lists)."""
    if not isinstance(values, dict):
        raise TypeError(f"tracker values must be a dict of name -> value, got {type(values).__name__}")
    from ..runtime.operations import listify, recursively_apply

    return recursively_apply(lambda v: v.tolist(), listify(values), test_type=_is_numpy)
